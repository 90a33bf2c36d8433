"""The front end's transport, on both sides:

- toward Triton: requests to a decoupled model share long-lived bidirectional gRPC streams (``ModelStreamInfer``;
  :class:`Mux`, one stream each, responses routed by request id to each request's :class:`Inbox`, an empty final
  response asked for), as upstream's clients keep one stream open; opening a stream per request cost a millisecond
  or more of time to first token here. :class:`StreamPool` hands each request a stream with no write in flight (more
  are opened, up to ``streams``, while every one is writing): the task that makes a request writes it at once, where
  handing it to a writer task held each request of a burst until the whole burst had been parsed. One watchdog task
  fails a request whose stream stays silent for the request timeout, so waiting for a response arms no timer;
- toward the HTTP client: :class:`EventStream`, the server-sent-event response (a client that disconnects cancels
  its generations at once), and :func:`until_done_or_gone` for a non-streamed answer.
"""
from __future__ import annotations

import asyncio
import collections
from typing import Any, AsyncIterator, Callable

from starlette.responses import Response as _Response

from pipeline.serving import observe
from pipeline.serving.protocol import APIError


# ------------------------------------------------------------------------------------------------- toward Triton
class Inbox:
    """One request's responses as the stream's reader routes them: a deque and at most one waiting consumer (what
    an ``asyncio.Queue`` does, without its bookkeeping per item); ``last`` is when something last arrived."""

    __slots__ = ("items", "waiter", "last", "timed_out", "loop")

    def __init__(self, loop):
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.loop = loop
        self.last = loop.time()
        self.timed_out = False

    def put(self, item) -> None:
        self.items.append(item)
        self.last = self.loop.time()
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self):
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


class Mux:
    """One long-lived gRPC stream (``ModelStreamInfer``) that carries many requests: responses are routed by
    request id to each request's inbox. A request is written by the task that submits it, at once, unless a write
    is in flight on this stream (gRPC allows one at a time): it then waits in ``backlog`` and the writing task
    writes it next. A broken stream fails its requests and is reopened by the next one."""

    def __init__(self, stub_factory):
        self.stub_factory = stub_factory
        self.routes: dict[str, Inbox] = {}
        self.call = None
        self.reader: asyncio.Task | None = None
        self.writing = False
        self.backlog: collections.deque = collections.deque()  # (request, after_send) waiting for the write
        self.later: collections.OrderedDict[str, Any] = collections.OrderedDict()  # see on_first_answer

    def on_first_answer(self, request_id: str, then) -> None:
        """Call ``then(final)`` when the first response for an abandoned request arrives (at most 1024 kept)."""
        self.later[request_id] = then
        while len(self.later) > 1024:
            self.later.popitem(last=False)

    async def submit(self, request, after_send=None) -> Inbox:
        """Route the request's responses to a new inbox and write the request (or leave it to the write in flight).
        Its ``after_send`` runs once it is written: work that can wait for the response is done while Triton works,
        and the next request is not held up by it."""
        if self.reader is None or self.reader.done():
            self.call = self.stub_factory().ModelStreamInfer()  # no request iterator: written with call.write
            self.reader = asyncio.ensure_future(self._read(self.call))
            self.backlog.clear()  # a broken stream's reader has failed their requests
        inbox = Inbox(asyncio.get_running_loop())
        self.routes[request.id] = inbox
        if self.writing:
            self.backlog.append((request, after_send))
            return inbox
        self.writing = True
        call, item = self.call, (request, after_send)
        try:
            while item is not None:
                msg, then = item
                try:
                    await call.write(msg)
                except Exception as exc:  # noqa: BLE001 - the stream broke: this request and those waiting fail
                    for m, _ in [item, *self.backlog]:
                        if m.id in self.routes:
                            self.routes[m.id].put(exc)
                    self.backlog.clear()
                    break
                if then is not None:
                    self._after_send(msg.id, then)
                item = self.backlog.popleft() if self.backlog else None
        finally:
            self.writing = False
        return inbox

    def abandon(self, request_id: str) -> None:
        self.routes.pop(request_id, None)

    def _after_send(self, request_id: str, after_send) -> None:
        """Run a request's ``after_send``; an error it returns (or raises) goes to the request's inbox."""
        try:
            problem = after_send()
        except Exception as exc:  # noqa: BLE001 - the request fails with it, not the shared stream
            problem = exc
        inbox = self.routes.get(request_id)
        if problem is not None and inbox is not None:
            inbox.put(problem)

    async def _read(self, call) -> None:
        problem: BaseException | None = None
        try:
            async for resp in call:
                rid = resp.infer_response.id
                inbox = self.routes.get(rid)
                if inbox is not None:
                    inbox.put(resp)
                elif self.later:
                    then = self.later.pop(rid, None)
                    if then is not None:
                        final = resp.infer_response.parameters.get("triton_final_response")
                        then(final is not None and final.bool_param)
        except asyncio.CancelledError:
            call.cancel()
            raise
        except BaseException as exc:  # the stream broke (server gone): every request on it fails
            problem = exc
        problem = problem or ConnectionError("the gRPC stream to Triton closed")
        for inbox in self.routes.values():
            inbox.put(problem)
        self.routes.clear()

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()  # cancels the call
            await asyncio.gather(self.reader, return_exceptions=True)


class StreamPool:
    """The shared streams of one driver (``stub_factory()``: the gRPC stub) and the watchdog over their requests:
    a request silent for ``timeout_s`` gets an ``asyncio.TimeoutError`` in its inbox."""

    def __init__(self, stub_factory, timeout_s: float, streams: int = 16):
        self.stub_factory, self.timeout_s = stub_factory, timeout_s
        self.streams = streams  # the most shared gRPC streams (one more is opened while every one is writing)
        self.muxes: list[Mux] = []
        self._next = 0
        self._watchdog: asyncio.Task | None = None

    def mux(self) -> Mux:
        """A shared stream with no write in flight (taken in turn); a new one while every stream is writing, up to
        ``streams``; else the one with the fewest requests waiting to be written."""
        n = len(self.muxes)
        for k in range(n):
            m = self.muxes[(self._next + k) % n]
            if not m.writing:
                self._next = (self._next + k + 1) % n
                return m
        if n < self.streams:
            self.muxes.append(Mux(self.stub_factory))
            return self.muxes[-1]
        return min(self.muxes, key=lambda m: len(m.backlog))

    def watch(self) -> None:
        """Start the watchdog that fails a request whose stream has been silent for ``timeout_s`` (one task for all
        requests, instead of a timer armed and cancelled around every wait for a response)."""
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.ensure_future(self._watchdog_loop())

    async def _watchdog_loop(self) -> None:
        loop = asyncio.get_running_loop()
        period = max(0.01, min(1.0, self.timeout_s / 10))
        while any(m.routes for m in self.muxes):
            await asyncio.sleep(period)
            now = loop.time()
            for m in self.muxes:
                for inbox in list(m.routes.values()):
                    if now - inbox.last > self.timeout_s and not inbox.timed_out:
                        inbox.timed_out = True
                        inbox.put(asyncio.TimeoutError())

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        for m in self.muxes:
            await m.close()


async def once(msg):
    """A request iterator of one message (a stop request on a stream of its own)."""
    yield msg


# --------------------------------------------------------------------------------------------- toward the client
class Final(bytes):
    """A job's finish chunk (its ``finish_reason``)."""


class Last(bytes):
    """The stream's closing events: the response body ends with them."""


class EventStream(_Response):
    """A server-sent-event response (an ASGI app): the events as they come; a client that disconnects cancels
    the stream at once (its generations with it), also while it waits for a token. Starlette's StreamingResponse
    does the same with an anyio task group per response; this costs one watcher task."""

    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Any]):
        """A Response (Starlette calls it as is) with no body; ``on_close()`` is awaited last, whatever happened
        (it closes every generation, also one whose events were never asked for)."""
        self.events, self.on_close = events, on_close
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.current_task()
        state = {"open": True, "gone": False}  # open: this task is inside the try below

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            state["gone"] = True
            observe.failed(499)  # the client closed the request
            if state["open"]:
                streaming.cancel()  # delivered at the stream's current await, inside the try

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            last = False
            async for event in self.events:
                last = type(event) is Last  # the closing events end the body in the same write
                await send({"type": "http.response.body", "body": event, "more_body": not last})
                if last:
                    break
            if not last:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:
                raise  # cancelled from outside (shutdown): not ours to swallow
        finally:
            state["open"] = False
            watcher.cancel()
            await self.events.aclose()  # a generation still running stops here
            await self.on_close()


async def until_done_or_gone(request, coros) -> None:
    """Run the generations; when the client disconnects first, cancel them (and so their Triton requests)."""
    work = asyncio.ensure_future(asyncio.gather(*coros))

    async def gone():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise APIError(499, "client closed the request")
    work.result()
