"""A graceful stop of the front end (``pipeline serve`` on SIGTERM/SIGINT): :class:`Drain`, the state of one, and
:class:`DrainGate`, the ASGI middleware that carries it out (``pipeline.serving.app`` puts it behind the observer;
``pipeline.serving.run`` starts it on the first signal and cuts it on the second)."""
from __future__ import annotations

from typing import Any

from pipeline.serving import observe

RETRY_AFTER_S = 5  # what a client answered 503 is told to wait (Retry-After)


class Drain:
    """A graceful stop of the front end (``pipeline serve`` on SIGTERM/SIGINT): new requests get 503 with
    ``Retry-After`` (``GET /metrics`` is still answered), requests in flight may finish for ``drain_s``, then each
    remaining event stream ends with an OpenAI error event and ``[DONE]`` (a whole answer still unsent gets the 503).
    A second SIGTERM/SIGINT during the drain makes that cut at once. ``completed``: every request in flight finished
    within the drain; ``cut_inflight``: how many were still running when it was cut."""

    GRACE_S = 5.0  # after the cut: how long the cut requests may take to end

    def __init__(self, drain_s: float):
        self.drain_s = float(drain_s)
        self.started = False
        self.completed: bool | None = None
        self.inflight = 0
        self.cut: Any = None  # an asyncio.Event, made on the server's loop
        self.signal: int | None = None
        self.second: int | None = None  # the second signal, where one cut the drain short
        self.cut_inflight = 0
        self.cut_after_s: float | None = None
        self._start = 0.0  # the loop's time when the drain began

    def message(self) -> str:
        return "the server is shutting down; retry on another replica or after it restarts"

    def cut_message(self) -> str:
        """What a cut stream's error event says."""
        if self.second is not None:
            return f"{self.message()}: this stream was ended by a second {_signame(self.second)} to the server"
        return f"{self.message()}: this stream was ended after serve.drain_s={self.drain_s:g} s"

    def outcome(self) -> str:
        """How the drain ended, in the words ``pipeline serve`` prints."""
        if self.completed:
            return "drained: every request in flight finished"
        n = f"the {self.cut_inflight} request{'s' if self.cut_inflight != 1 else ''} still running"
        if self.second is not None:
            return (f"drain cut by a second {_signame(self.second)} after {self.cut_after_s or 0:.1f} s: {n} "
                    f"ended at once with an error event and [DONE]")
        return (f"drain cut after serve.drain_s={self.drain_s:g} s: {n} ended with an error event and [DONE]")

    def interrupt(self, sig: int) -> None:
        """A second signal during the drain (on the server's loop): end the requests still in flight now."""
        import asyncio

        if self.second is None and self.completed is None and self.cut is not None:
            self.second, self.cut_inflight = sig, self.inflight
            self.cut_after_s = asyncio.get_running_loop().time() - self._start
            self.cut.set()

    async def run(self, server) -> None:
        """Wait for the requests in flight (up to ``drain_s``, or until a second signal), cut the rest, then let
        uvicorn exit."""
        import asyncio

        loop = asyncio.get_running_loop()
        self._start = loop.time()
        deadline = self._start + self.drain_s
        while self.inflight and loop.time() < deadline and not self.cut.is_set():
            await asyncio.sleep(0.05)
        if self.second is not None:  # cut short by a second signal, with what was in flight then
            self.completed = self.cut_inflight == 0
        else:
            self.completed = self.inflight == 0
            if not self.completed:
                self.cut_inflight, self.cut_after_s = self.inflight, loop.time() - self._start
                self.cut.set()
        if not self.completed:
            end = loop.time() + self.GRACE_S
            while self.inflight and loop.time() < end:
                await asyncio.sleep(0.02)
        server.should_exit = True


def _signame(sig: int) -> str:
    import signal

    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


class DrainGate:
    """ASGI middleware of a :class:`Drain`: counts the requests in flight, answers new ones 503 while draining, and
    ends a cut event stream with an error event and ``[DONE]`` (no truncated chunked body, no traceback)."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def _refuse(self, send, status: int = 503) -> None:
        from pipeline.serving import protocol as P

        body = P.dumps(P.APIError(status, self.drain.message()).body())
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"%d" % RETRY_AFTER_S),
                                (b"connection", b"close"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        import asyncio

        if scope["type"] != "http":
            if scope["type"] == "lifespan" and self.drain.cut is None:
                self.drain.cut = asyncio.Event()
            return await self.app(scope, receive, send)
        if scope["path"] == "/metrics":  # scraped during the drain too: it shows the drain
            return await self.app(scope, receive, send)
        if self.drain.started:
            return await self._refuse(send)
        state = {"sse": False, "started": False, "ended": False}

        async def forward(msg):
            if state["ended"]:
                return  # after a cut: the app's late writes go nowhere
            if msg["type"] == "http.response.start":
                state["started"] = True
                state["sse"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                   for k, v in msg.get("headers", []))
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                state["ended"] = True
            await send(msg)

        self.drain.inflight += 1
        try:
            task = asyncio.ensure_future(self.app(scope, receive, forward))
            cut = asyncio.ensure_future(self.drain.cut.wait())
            await asyncio.wait({task, cut}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                cut.cancel()
                await asyncio.gather(cut, return_exceptions=True)
                return task.result()
            ended, state["ended"] = state["ended"], True
            observe.failed(503)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if ended:
                return
            if not state["started"]:
                await self._refuse(send)
            elif state["sse"]:
                from pipeline.serving import protocol as P

                error = P.dumps(P.APIError(503, self.drain.cut_message()).body())
                await send({"type": "http.response.body", "body": b"data: " + error + b"\n\ndata: [DONE]\n\n",
                            "more_body": False})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.drain.inflight -= 1
