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
from typing import Iterator

from pipeline.errors import UserError
from pipeline.serving.drain import Drain


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
