"""``serve REPO_OR_BUNDLE``: stand a model repository or a published bundle up on Triton until interrupted."""
from __future__ import annotations

import argparse
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path

from pipeline.cli.common import add_overrides, stdout_gone, subcommand
from pipeline.errors import UserError


EXIT_TRITON_GONE = 1  # Triton died (serve.restart=no), or did once more than serve.restart_max allows
EXIT_DRAIN_CUT = 3  # SIGTERM/SIGINT: requests were still in flight when the drain ended (serve.drain_s ran out, or a
# second signal cut it short)


def register(sub) -> None:
    p = subcommand(sub, "serve", help="serve a model repository or published bundle on Triton and the OpenAI API "
                                      "until Ctrl-C",
                   usage="python -m pipeline serve [-h] REPO_OR_BUNDLE [OVERRIDE ...]",
                   description="Stand a model repository or a published bundle (its triton_repo/; a bundle base "
                               "with `latest` serves that version) up on Triton with serve.launcher (local, docker, "
                               "or external: a running server at serve.url), with the OpenAI-compatible API beside "
                               "it (serve.openai.*: host, port 9000, api_key_env, limits; enabled=false for Triton "
                               "alone). Prints the OpenAI base URL, the HTTP and gRPC addresses and the ready "
                               "models, and runs until SIGINT or SIGTERM.")
    add_overrides(p, metavar="ARG",
                  help="the repository or bundle directory, then Hydra overrides (e.g. serve.launcher=docker)")
    p.set_defaults(func=lambda a: cmd_serve(a.args))


def serve_target(where: str) -> Path:
    """The model repository of a repository directory or a published bundle (``triton_repo/``; a bundle base with
    ``latest`` resolves to that version)."""
    p = Path(where)
    if p.is_file() and p.name == "bundle.json":
        p = p.parent
    if not p.is_dir():
        raise UserError(f"{where}: no such directory; give a model repository or a published bundle (download a "
                        f"remote bundle first)")
    if (p / "latest").is_file() and not (p / "bundle.json").is_file():
        p = p / (p / "latest").read_text().strip()
    elif not (p / "bundle.json").is_file() and not any(p.glob("*/config.pbtxt")):
        versions = sorted(d.name for d in p.glob("*/bundle.json") for d in [d.parent])
        if versions:  # a bundle base whose versions never passed every gate: no `latest` to follow
            raise UserError(f"{where}: no `latest` here (no version passed every gate); serve a version: "
                            f"{', '.join(str(p / v) for v in versions)}")
    if (p / "bundle.json").is_file():
        p = p / "triton_repo"
    if not any(p.glob("*/config.pbtxt")):
        raise UserError(f"{where}: neither a model repository (*/config.pbtxt) nor a bundle (triton_repo/)")
    return p


def cmd_serve(args: list[str]) -> int:
    """Serve until SIGINT/SIGTERM; everything started here is stopped on every exit path (the Triton server runs
    under a supervisor that also outlives nothing after a kill -9 of this process). The front end runs in this (main)
    thread for serve's whole life; Triton is started, watched and restarted by a thread of its own
    (:class:`_TritonKeeper`), so the OpenAI port answers (503 with the reason while Triton is down) until serve
    exits."""
    import signal
    import tempfile

    from pipeline.config import compose
    from pipeline.triton import layouts, server

    where = [a for a in args if "=" not in a or Path(a).exists()]
    overrides = [a for a in args if a not in where]
    if len(where) != 1:
        raise UserError("usage: python -m pipeline serve REPO_OR_BUNDLE [serve.launcher=local|docker|external] "
                        "[overrides]")
    repo = serve_target(where[0]).resolve()
    cfg = compose(overrides)
    restart = str(cfg.serve.restart)
    if restart not in ("no", "on-failure"):
        raise UserError(f"serve.restart={restart}: choose no or on-failure")
    preflight(repo, cfg)  # before Triton starts: a damaged or stray file or a config it cannot load, named
    layout = layouts.of_repository({d.name: d for d in repo.iterdir() if d.is_dir()})
    oa = cfg.serve.openai
    front = sock = None
    if oa.enabled:  # everything the front end needs is checked before Triton starts
        from pipeline.serving import run as front_run
        from pipeline.serving.frontend import FrontEnd

        front = FrontEnd.from_config(oa, repo, "")  # the gRPC address is set once the server is up
        sock = front_run.bind(str(oa.host), int(oa.port))
    for gone in remove_stale_work_dirs():
        print(f"removed {gone} (the work directory of a pipeline serve that is gone)")
    work = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}-"))
    keeper = _TritonKeeper(cfg, repo, work, layout, front, sock)

    def _stop(signum, frame):
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}  # SIGINT too: a
    # background job starts with it ignored
    drain = None
    try:
        keeper.thread.start()
        while not keeper.ready.wait(0.2):
            pass
        if keeper.error is not None:
            raise keeper.error
        if front is not None:
            from pipeline.serving.drain import Drain

            drain = Drain(cfg.serve.drain_s)
            front_run.serve_forever(front.app(drain), sock, stop=keeper.done, drain=drain)
        else:
            while not keeper.done.wait(0.5):
                pass
        return keeper.exit_code
    except KeyboardInterrupt:
        keeper.stop()
        try:
            if drain is not None and drain.started:
                print(f"stopped ({drain.outcome()}; Triton stopped after)", flush=True)
            else:
                print("stopped", flush=True)
        except BrokenPipeError:  # `serve | tee`: Ctrl-C stopped the reader too
            stdout_gone()
        return EXIT_DRAIN_CUT if drain is not None and drain.started and drain.completed is False else 0
    except server.ServerError as exc:
        log = _keep_log(exc.log_path, cfg)
        if exc.reason:  # the server's own reason, in one line, instead of its summary "failed to load all models"
            raise UserError(f"the server did not load {repo}: {exc.reason} (server log: {log})") from None
        raise UserError(f"the server did not start: {exc}") from None
    finally:
        keeper.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if sock is not None:
            sock.close()
        shutil.rmtree(work, ignore_errors=True)  # the backends copy and server logs: nothing left in /tmp


WORK_PREFIX = "pipeline-serve-"  # serve's work directory in the temp directory: pipeline-serve-<pid>-<random>


def remove_stale_work_dirs(tmp: Path | None = None) -> list[Path]:
    """Remove the work directories that serves which are gone left in the temp directory (a ``kill -9`` of serve
    leaves its own: nothing of it runs to remove it); returns them. Only ``pipeline-serve-<pid>-*`` directories of
    this user are judged: gone when no process has that pid, or the one that has it started after the directory was
    last written (the pid was reused). Any other directory is left alone."""
    import re

    import psutil

    base = Path(tmp or tempfile.gettempdir())
    out = []
    for d in sorted(base.glob(f"{WORK_PREFIX}*")):
        m = re.fullmatch(rf"{re.escape(WORK_PREFIX)}(\d+)-[A-Za-z0-9_]+", d.name)
        try:
            st = d.lstat()
        except OSError:
            continue
        if not m or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        try:
            alive = psutil.Process(int(m.group(1))).create_time() <= st.st_mtime + 1
        except psutil.NoSuchProcess:
            alive = False
        except psutil.Error:  # not ours to look at: left alone
            continue
        if not alive:
            shutil.rmtree(d, ignore_errors=True)
            out.append(d)
    return out


class _Stopped(Exception):
    """serve is stopping while a Triton server starts."""


class _TritonKeeper:
    """Triton under ``pipeline serve``, in a thread of its own: started (``ready`` once it serves, or ``error``),
    watched, and when it dies restarted (``serve.restart=on-failure``, up to ``serve.restart_max`` times, waiting
    ``serve.restart_backoff_s`` doubled each time) or given up on (``exit_code`` 1). While it is down the front end
    answers 503 with the reason; after a restart it talks to the new server. ``done`` is set once Triton is gone for
    good and everything of it is cleaned up: the front end stops last."""

    def __init__(self, cfg, repo: Path, work: Path, layout: str, front, sock):
        self.cfg, self.repo, self.work, self.layout, self.front, self.sock = cfg, repo, work, layout, front, sock
        self.ready, self.done, self.stopping = threading.Event(), threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.exit_code = 0
        self.thread = threading.Thread(target=self._run, name="triton-keeper", daemon=True)

    def stop(self) -> None:
        """Stop Triton (a start in progress too) and wait for the thread."""
        self.stopping.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(120)

    def _check(self) -> None:  # between a starting server's readiness probes
        if self.stopping.is_set():
            raise _Stopped

    def _run(self) -> None:
        try:
            self._keep()
        except _Stopped:
            pass
        except BaseException as exc:  # the first start failed: the main thread raises it
            self.error = exc
        finally:
            self.ready.set()
            self.done.set()

    def _keep(self) -> None:
        from pipeline.triton import server

        serve, deaths = self.cfg.serve, 0
        front = self.front
        while True:
            try:
                with server.launched(serve, self.repo, self.work, on_wait=self._check, metrics=bool(serve.metrics)) \
                        as s:
                    self._attach(s, deaths)
                    self.ready.set()
                    while s.alive():
                        if self.stopping.wait(0.2):
                            return
                    reason = s.exit_reason()
                    if front is not None:  # at once: requests are answered 503 with it from now on
                        front.driver.down = reason
                    print(f"error: {reason} while serving; its log since it became ready "
                          f"({_keep_log(s.log_path, self.cfg)}):\n{s.runtime_log_tail()}", file=sys.stderr,
                          flush=True)
            except server.ServerError as exc:
                if not deaths or self.stopping.is_set():
                    raise
                reason = f"the restarted Triton did not start: {exc.reason or str(exc).splitlines()[0]}"
                print(f"error: {reason} (server log: {_keep_log(exc.log_path, self.cfg)})", file=sys.stderr,
                      flush=True)
            if self.stopping.is_set():
                return
            deaths += 1
            if serve.restart == "no" or deaths > int(serve.restart_max):
                if serve.restart != "no":
                    print(f"error: gave up after {deaths - 1} restarts (serve.restart_max={serve.restart_max})",
                          file=sys.stderr, flush=True)
                self.exit_code = EXIT_TRITON_GONE
                return
            wait = float(serve.restart_backoff_s) * 2 ** (deaths - 1)
            print(f"restarting Triton in {wait:g} s (restart {deaths} of {serve.restart_max}, "
                  f"serve.restart=on-failure)", file=sys.stderr, flush=True)
            if front is not None:
                front.driver.down = (f"{reason}; pipeline serve restarts it in {wait:g} s (restart {deaths} of "
                                     f"{serve.restart_max})")
                front.metrics.restarting.set(1)
                front.metrics.restarts.inc()
            if self.stopping.wait(wait):
                return

    def _attach(self, s, deaths: int) -> None:
        """A server is up: the front end talks to it (a restarted one: a new connection), and serve says where."""
        import asyncio

        from pipeline.triton import layouts

        front = self.front
        ready = _ready_models(s)
        print(f"serving {self.repo} ({self.layout} layout; entry points: "
              f"{', '.join(layouts.get(self.layout).entry_points)})")
        if front is not None:
            from pipeline.serving import run as front_run

            driver = front.driver
            driver.why_down = lambda s=s: None if s.alive() else s.exit_reason()
            driver.metrics_url = s.metrics_url
            if deaths and front.loop is not None:  # its gRPC channel and streams were the dead server's
                asyncio.run_coroutine_threadsafe(driver.reconnect(s.grpc_url), front.loop).result(60)
            else:
                driver.url = s.grpc_url
            driver.down = None
            front.metrics.restarting.set(0)
            base = front_run.url_of(self.sock)
            print(f"OpenAI {base}  (model '{front.served.name}')")
            print(f"metrics {base.removesuffix('/v1')}/metrics  (the front end's and Triton's)")
        elif s.metrics_url:
            print(f"metrics {s.metrics_url}  (Triton's)")
        if s.proc is not None:
            print(f"HTTP  {s.http_url}")
        print(f"gRPC  {s.grpc_url}")
        print(f"ready {', '.join(ready)}")
        print("stop with Ctrl-C (SIGINT) or SIGTERM", flush=True)


FULL_HASH_BYTES = 256 << 20  # files up to this size are hashed at every start; larger ones once (memoised)


def preflight(repo: Path, cfg) -> None:
    """What `verify` would refuse and Triton would fail on late, checked before it starts; one UserError naming each
    file. A bundle's files (``bundle.json``): present, of the listed size, and of the listed sha256 (files over
    ``FULL_HASH_BYTES`` through the stage store's digest memo, keyed by path, size, mtime and inode, so a restart
    does not read them again); its tree exactly as listed, by `verify`'s rule
    (:func:`pipeline.bundle.verifying.tree_check`: a stray, missing or renamed file or directory is named); every
    ``config.pbtxt`` parsed and the repository consistent, by the rules `lint` and `verify` share
    (:func:`pipeline.triton.lint.repository_problems`)."""
    import json

    from pipeline import store
    from pipeline.bundle import verifying
    from pipeline.config import resolved_paths
    from pipeline.triton import lint

    problems: list[str] = []
    doc_path = repo.parent / "bundle.json"
    if repo.name == "triton_repo" and doc_path.is_file():
        try:
            doc = json.loads(doc_path.read_text())
            listed = doc.get("files") or []
        except (OSError, ValueError) as exc:
            raise UserError(f"{doc_path}: unreadable ({exc}); verify the bundle or fetch it again") from None
        memo = resolved_paths(cfg)["store"]
        for f in listed:
            p = repo.parent / f["path"]
            try:
                size = p.stat().st_size
            except OSError:
                problems.append(f"{p}: missing (bundle.json lists it)")
                continue
            if not p.is_file():
                problems.append(f"{p}: not a file (bundle.json lists a file)")
            elif size != f["size"]:
                problems.append(f"{p}: {size} bytes, bundle.json lists {f['size']} (truncated or replaced)")
            elif (store.sha256_file(p) if size <= FULL_HASH_BYTES else store.file_digest_cached(p, memo)) != f["sha256"]:
                problems.append(f"{p}: sha256 differs from bundle.json's (damaged or replaced)")
        files, dirs = lint.tree_of(repo.parent)
        _, exact, detail = verifying.tree_check(doc, files, dirs, local=True)
        if not exact:
            problems.append(f"{repo.parent}: {detail}")
    files, dirs = lint.tree_of(repo)
    problems += [f"{repo}/{f}" for f in lint.repository_problems(
        files, dirs, lambda rel: (repo / rel).read_text(errors="replace"))]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UserError(f"not serving {repo}: {'; '.join(problems[:5])}{more}; `python -m pipeline verify` checks a "
                        f"bundle, `lint` a repository", problems=problems)


def _ready_models(s) -> list[str]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(s.grpc_url)
    try:
        index = client.get_model_repository_index(as_json=True).get("models", [])
    finally:
        client.close()
    return sorted(m["name"] for m in index if m.get("state") == "READY")


def _keep_log(log_path, cfg) -> Path | None:
    """A copy of a failed server's log under ``<store>/logs`` (the work directory it was in is removed)."""
    from pipeline.config import resolved_paths

    if log_path is None or not Path(log_path).is_file():
        return None
    dest = resolved_paths(cfg)["store"] / "logs" / f"serve-{time.strftime('%Y%m%d-%H%M%S')}-{Path(log_path).parent.name}.log"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log_path, dest)
    except OSError:
        return None
    return dest
