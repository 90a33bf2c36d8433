"""Run the front end with uvicorn: on a socket bound here first (a port in use is one clear error), in the main
thread (``pipeline serve``: uvicorn handles SIGINT/SIGTERM) or in a background thread (the bench, tests)."""
from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

from pipeline.errors import UserError


def settings(openai_cfg):
    """``serve.openai`` -> the app's settings; the API key is read from the environment variable it names."""
    from pipeline.serving.app import Settings

    key = None
    env = openai_cfg.api_key_env
    if env:
        key = os.environ.get(str(env), "")
        if not key:
            raise UserError(f"serve.openai.api_key_env={env}: that environment variable is unset or empty; export "
                            f"the key in it, or set serve.openai.api_key_env=null to serve without a key")
    lim = openai_cfg.limits
    return Settings(api_key=key, max_body_bytes=int(lim.max_body_bytes), max_tokens=int(lim.max_tokens),
                    request_timeout_s=float(lim.request_timeout_s),
                    stream_status_wait_s=float(lim.stream_status_wait_ms) / 1000)


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


def build_app(repo: Path, grpc_url: str, openai_cfg):
    """(app, served model) for ``repo`` served by Triton at ``grpc_url``."""
    from pipeline.serving import model as served_model
    from pipeline.serving.app import create_app
    from pipeline.serving.driver import Driver

    cfg_settings = settings(openai_cfg)
    served = served_model.load(repo, name=openai_cfg.model_name)
    entry = getattr(openai_cfg.entry_point, "value", openai_cfg.entry_point)
    if entry == "auto":
        entry = None
    elif served.layout == "llmapi" and entry != "tensorrt_llm":
        raise UserError(f"serve.openai.entry_point={entry}: the llmapi layout's entry point is tensorrt_llm")
    elif served.layout == "inflight_batcher_llm" and entry == "tensorrt_llm":
        raise UserError("serve.openai.entry_point=tensorrt_llm: the inflight_batcher_llm layout's text entry points "
                        "are ensemble and tensorrt_llm_bls (tensorrt_llm takes token ids; the front end uses it for "
                        "token-level requests on its own)")
    driver = Driver(grpc_url, served, entry=entry, timeout_s=cfg_settings.request_timeout_s)
    return create_app(served, driver, cfg_settings), served


def _server(app, sock: socket.socket):
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                            lifespan="on", timeout_keep_alive=30)
    return uvicorn.Server(config)


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}/v1"


def serve_forever(app, sock: socket.socket, alive=None) -> None:
    """Serve in this (main) thread until SIGINT/SIGTERM (uvicorn re-raises the signal after its graceful
    shutdown) or until ``alive()`` turns false."""
    server = _server(app, sock)
    if alive is not None:
        def watch():
            while not server.should_exit:
                if not alive():
                    server.should_exit = True
                    return
                time.sleep(0.5)

        threading.Thread(target=watch, daemon=True).start()
    server.run(sockets=[sock])


@contextlib.contextmanager
def running(repo: Path, grpc_url: str, openai_cfg, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """The front end in a background thread; yields its base URL (``http://HOST:PORT/v1``); stopped on exit."""
    app, _ = build_app(repo, grpc_url, openai_cfg)
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


@contextlib.contextmanager
def child(repo: Path, grpc_url: str, overrides: list[str], log_path: Path, timeout_s: float = 120.0) -> Iterator[str]:
    """The front end in a process of its own (``python -m pipeline.serving``), under the Triton server's supervisor
    (:func:`pipeline.triton.server.supervised`: nothing outlives this process, ``kill -9`` included); yields its
    base URL and stops it on exit."""
    import signal
    import subprocess
    import sys

    from pipeline.triton.server import supervised

    cmd = supervised([sys.executable, "-m", "pipeline.serving", str(repo), grpc_url, "serve.openai.port=0",
                      *overrides])
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
