"""Run the front end (:meth:`pipeline.serving.frontend.FrontEnd.from_config`) with uvicorn: on a socket bound here
first (a port in use is one clear error), in the main thread (``pipeline serve``: uvicorn handles SIGINT/SIGTERM), in
a background thread (the task evaluation, tests) or in a process of its own (the bench: :func:`child`, with the
build's own ``serve.openai`` settings)."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from pipeline.errors import UserError


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: any free port). Raises ``UserError`` when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"serve.openai.port={port}: {host}:{port} is already in use; pick another port "
                            f"(serve.openai.port=0 takes any free one)") from None
        raise UserError(f"serve.openai.host={host}: cannot listen there ({exc.strerror})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _config(app):
    import uvicorn

    return uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                          lifespan="on", timeout_keep_alive=30)


def _server(app, sock: socket.socket):
    import uvicorn

    return uvicorn.Server(_config(app))


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
        """A second signal during the drain (on the server's loop): end the remaining requests now."""
        if self.second is None and self.completed is None:
            self.second = sig
            self.cut.set()

    async def run(self, server) -> None:
        """Wait for the requests in flight (up to ``drain_s``, or until a second signal), cut the rest, then let
        uvicorn exit."""
        import asyncio

        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + self.drain_s
        while self.inflight and loop.time() < deadline and not self.cut.is_set():
            await asyncio.sleep(0.05)
        self.completed = self.inflight == 0
        if not self.completed:
            self.cut_inflight, self.cut_after_s = self.inflight, loop.time() - start
            self.cut.set()
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
        from pipeline.serving.app import RETRY_AFTER_S

        body = P.dumps(P.APIError(status, self.drain.message()).body())
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"%d" % RETRY_AFTER_S),
                                (b"connection", b"close"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        import asyncio

        from pipeline.serving import observe

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


def _draining_server(app, drain: Drain):
    """A uvicorn server whose first SIGTERM/SIGINT starts ``drain`` instead of uvicorn's own shutdown (which would
    cut streams after 5 s and cancel them with tracebacks); a second one during the drain cuts it at once (each
    remaining stream ends with the error event and ``[DONE]``). ``app`` is the front end's app behind the drain's
    gate (``FrontEnd.app(drain)``)."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            loop = getattr(self, "_drain_loop", None)
            if loop is None or self.should_exit:  # not serving yet, or on its way out: uvicorn's own handling
                return super().handle_exit(sig, frame)
            if drain.started:
                loop.call_soon_threadsafe(drain.interrupt, sig)
                return
            self._captured_signals.append(sig)
            drain.started, drain.signal = True, sig
            loop.call_soon_threadsafe(lambda: loop.create_task(drain.run(self)))

        async def serve(self, sockets=None) -> None:
            self._drain_loop = asyncio.get_running_loop()
            await super().serve(sockets=sockets)

    return Server(_config(app))


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}/v1"


def serve_forever(app, sock: socket.socket, stop: threading.Event | None = None, drain: Drain | None = None) -> None:
    """Serve in this (main) thread until SIGINT/SIGTERM (uvicorn re-raises the signal after its graceful
    shutdown; with ``drain``, after that drain) or until ``stop`` is set."""
    server = _server(app, sock) if drain is None else _draining_server(app, drain)
    if stop is not None:
        def watch():
            while not server.should_exit:
                if stop.wait(0.1):
                    server.should_exit = True
                    return

        threading.Thread(target=watch, daemon=True).start()
    server.run(sockets=[sock])


@contextlib.contextmanager
def running(repo: Path, grpc_url: str, openai_cfg, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """The front end ``openai_cfg`` (``serve.openai``) describes, on ``host:port``, in a background thread; yields its
    base URL (``http://HOST:PORT/v1``); stopped on exit."""
    from pipeline.serving.frontend import FrontEnd

    app = FrontEnd.from_config(openai_cfg, repo, grpc_url).app()
    sock = bind(host, port)
    server = _server(app, sock)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive():
            raise UserError("the OpenAI front end did not start (see the log above)")
        if time.monotonic() > deadline:
            raise UserError("the OpenAI front end did not start within 60 s")
        time.sleep(0.02)
    try:
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def write_settings(openai_cfg, path: Path, **changes) -> Path:
    """``serve.openai`` (``openai_cfg``, resolved), with ``changes``, as the JSON file ``python -m pipeline.serving
    --openai-config`` reads: how a build's own settings reach a front end in a process of its own."""
    from omegaconf import OmegaConf

    doc = OmegaConf.to_container(openai_cfg, resolve=True, enum_to_str=True)
    doc.update(changes)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def read_settings(path: Path):
    """A ``serve.openai`` config from a file :func:`write_settings` wrote (JSON or YAML), checked against the schema
    (an unknown key or a value of the wrong type is a :class:`UserError`)."""
    import yaml
    from omegaconf import OmegaConf

    from pipeline import schema

    try:
        doc = yaml.safe_load(Path(path).read_text())
        return OmegaConf.merge(OmegaConf.structured(schema.OpenAIConfig), doc or {})
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"--openai-config {path}: cannot read it ({exc})") from None
    except Exception as exc:  # omegaconf's validation errors
        raise UserError(f"--openai-config {path}: not a serve.openai config ({str(exc).splitlines()[0]})") from None


@contextlib.contextmanager
def child(repo: Path, grpc_url: str, settings_file: Path, log_path: Path, timeout_s: float = 120.0) -> Iterator[str]:
    """The front end in a process of its own (``python -m pipeline.serving REPO GRPC_URL --openai-config
    SETTINGS_FILE``, the settings :func:`write_settings` wrote), under the Triton server's supervisor
    (:func:`pipeline.triton.server.supervised`: nothing outlives this process, ``kill -9`` included); yields its
    base URL and stops it on exit."""
    import signal
    import subprocess
    import sys

    from pipeline.triton.server import supervised

    cmd = supervised([sys.executable, "-m", "pipeline.serving", str(repo), grpc_url, "--openai-config",
                      str(settings_file)])
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w+b")
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        url = None
        while url is None:
            log.seek(0)
            for line in log.read().decode(errors="replace").splitlines():
                if line.startswith("OpenAI "):
                    url = line.split()[1]
            if url is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-2000:]
                    raise UserError(f"the OpenAI front end did not start (log {log_path}):\n{tail}")
                time.sleep(0.1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        with contextlib.suppress(OSError):
            proc.stdin.close()
        log.close()
