"""``serve REPO_OR_BUNDLE``: stand a model repository or a published bundle up on Triton until interrupted."""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from pipeline.cli.common import add_overrides, stdout_gone, subcommand
from pipeline.errors import UserError


EXIT_DRAIN_CUT = 3  # SIGTERM/SIGINT: requests were still in flight when serve.drain_s ran out


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
    under a supervisor that also outlives nothing after a kill -9 of this process)."""
    import shutil
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
    preflight(repo, cfg)  # before Triton starts: a damaged file or a config it cannot load, named
    layout = layouts.of_repository({d.name: d for d in repo.iterdir() if d.is_dir()})
    oa = cfg.serve.openai
    front = None
    if oa.enabled:  # everything the front end needs is checked before Triton starts
        from pipeline.serving import run as front_run
        from pipeline.serving.frontend import FrontEnd

        front = FrontEnd.from_config(oa, repo, "")  # the gRPC address is set once the server is up
        sock = front_run.bind(str(oa.host), int(oa.port))
        port = sock.getsockname()[1]  # the one port=0 picked: a restart listens there again

    def _stop(signum, frame):
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}  # SIGINT too: a
    # background job starts with it ignored
    drain = None
    restart = str(cfg.serve.restart)
    if restart not in ("no", "on-failure"):
        raise UserError(f"serve.restart={restart}: choose no or on-failure")
    work = Path(tempfile.mkdtemp(prefix="pipeline-serve-"))
    deaths = 0
    try:
        while True:
            # served as it is: a repository Triton cannot load (a model without its version directory) fails with
            # the server's own reason rather than being patched here
            with server.launched(cfg.serve, repo, work) as s:
                ready = _ready_models(s)
                print(f"serving {repo} ({layout} layout; entry points: {', '.join(layouts.get(layout).entry_points)})")
                if front is not None:
                    if deaths:  # a fresh front end (its gRPC channel and streams were the dead server's)
                        front = FrontEnd.from_config(oa, repo, "")
                        if sock.fileno() == -1:  # uvicorn closed it on the way out: the same port again
                            sock = front_run.bind(str(oa.host), port)
                    front.driver.url = s.grpc_url
                    front.driver.why_down = lambda s=s: None if s.alive() else s.exit_reason()
                    print(f"OpenAI {front_run.url_of(sock)}  (model '{front.served.name}')")
                if s.proc is not None:
                    print(f"HTTP  {s.http_url}")
                print(f"gRPC  {s.grpc_url}")
                print(f"ready {', '.join(ready)}")
                print("stop with Ctrl-C (SIGINT) or SIGTERM", flush=True)

                def alive(s=s) -> bool:  # a dead server's reason reaches the front end's 503 bodies at once
                    if s.alive():
                        return True
                    if front is not None:
                        front.driver.down = s.exit_reason()
                    return False

                if front is not None:
                    drain = front_run.Drain(cfg.serve.drain_s)
                    front_run.serve_forever(front.app(), sock, alive=alive, drain=drain)
                else:
                    while s.alive():
                        time.sleep(0.5)
                reason = s.exit_reason()
                print(f"error: {reason} while serving; its log since it became ready "
                      f"({_keep_log(s.log_path, cfg)}):\n{s.runtime_log_tail()}", file=sys.stderr, flush=True)
            deaths += 1
            if restart == "no" or deaths > int(cfg.serve.restart_max):
                if restart != "no":
                    print(f"error: gave up after {deaths - 1} restarts (serve.restart_max={cfg.serve.restart_max})",
                          file=sys.stderr)
                return 1
            wait = float(cfg.serve.restart_backoff_s) * 2 ** (deaths - 1)
            print(f"restarting Triton in {wait:g} s (restart {deaths} of {cfg.serve.restart_max}, "
                  f"serve.restart=on-failure)", file=sys.stderr, flush=True)
            time.sleep(wait)
    except KeyboardInterrupt:
        cut = drain is not None and drain.started and drain.completed is False
        try:
            if drain is not None and drain.started:
                how = (f"drained: every request in flight finished" if not cut else
                       f"drain cut after serve.drain_s={drain.drain_s:g} s: the streams still running were ended "
                       f"with an error event")
                print(f"stopped ({how}; Triton stopped after)", flush=True)
            else:
                print("stopped", flush=True)
        except BrokenPipeError:  # `serve | tee`: Ctrl-C stopped the reader too
            stdout_gone()
        return EXIT_DRAIN_CUT if cut else 0
    except server.ServerError as exc:
        log = _keep_log(exc.log_path, cfg)
        if exc.reason:  # the server's own reason, in one line, instead of its summary "failed to load all models"
            raise UserError(f"the server did not load {repo}: {exc.reason} (server log: {log})") from None
        raise UserError(f"the server did not start: {exc}") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if front is not None:
            sock.close()
        shutil.rmtree(work, ignore_errors=True)  # the backends copy and server logs: nothing left in /tmp


FULL_HASH_BYTES = 256 << 20  # files up to this size are hashed at every start; larger ones once (memoised)


def preflight(repo: Path, cfg) -> None:
    """What `verify` would refuse and Triton would fail on late, checked before it starts; one UserError naming each
    file. A bundle's files (``bundle.json``): present, of the listed size, and of the listed sha256 (files over
    ``FULL_HASH_BYTES`` through the stage store's digest memo, keyed by path, size, mtime and inode, so a restart
    does not read them again); every ``config.pbtxt`` parsed and the repository consistent, by the rules `lint`
    and `verify` share (:func:`pipeline.triton.lint.repository_problems`)."""
    import json

    from pipeline import store
    from pipeline.config import resolved_paths
    from pipeline.triton import lint

    problems: list[str] = []
    doc_path = repo.parent / "bundle.json"
    if repo.name == "triton_repo" and doc_path.is_file():
        try:
            listed = json.loads(doc_path.read_text()).get("files") or []
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
