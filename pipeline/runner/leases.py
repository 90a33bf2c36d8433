"""A Triton server, and the OpenAI front end before it, taken by a stage for as long as it serves a repository, and
shared by the stages of one build run that serve the same one.

The bench and the task evaluation both serve the packaged repository. Within one build run (the runner's
``Context.shared``, :class:`pipeline.runner.contract.Shared`) the first of them to run starts the server (and the
front end, in a process of its own: ``python -m pipeline.serving``), the next one reuses them, and the runner stops them once no
stage left to run serves that repository, and on every exit path of the run. A stage called without a run's scope
starts and stops its own. What a stage measures and writes does not depend on it: it gets the same server and front
end either way, and only waits less.

Every start-up, reuse and stop is one line of the run log (logger ``pipeline.servers``), which :func:`startups`
counts: one build starts each server once.
"""
from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("pipeline.servers")  # not under pipeline.serving: the evaluation's front-end log is that one

# the serve.openai settings that shape what a front end answers (its port is always a free one)
FRONT_KEYS = ("host", "api_key_env", "model_name", "entry_point", "limits")
_EVENT = re.compile(r"(tritonserver|OpenAI front end) (started|reused|stopped) for (\S+)")


@dataclass
class Lease:
    """What one stage took: the server (or front end), whether this stage started it, how long it waited, and where
    its log stood when the stage took it (the stage keeps the part written while it served)."""

    value: Any  # the Server, or the front end's base URL (``http://HOST:PORT/v1``)
    log_path: Path | None
    started: bool
    wait_s: float
    log_from: int = 0
    by: list[str] = field(default_factory=list)  # the stages that took it, in order

    def copy_log(self, dest: Path) -> None:
        """The log as this stage saw it into ``dest``: the whole log when it started the server, else a line saying
        which stage started it and the part written since this stage took it."""
        if self.log_path is None or not Path(self.log_path).is_file():
            return  # nothing to copy (a front end in the stage's own process logs there)
        if self.started:
            shutil.copy2(self.log_path, dest)
            return
        with open(self.log_path, "rb") as f:
            f.seek(self.log_from)
            rest = f.read()
        head = (f"(shared: started by the {self.by[0]} stage of this build run; its log from when "
                f"{self.by[-1]} took it, at byte {self.log_from})\n").encode()
        dest.write_bytes(head + rest)


def _size(path: Path | None) -> int:
    try:
        return Path(path).stat().st_size if path is not None else 0
    except OSError:
        return 0


def server_key(serve, repo: Path) -> tuple:
    """What makes two stages' servers the same one: the repository and how and where it is launched."""
    return ("tritonserver", str(Path(repo).resolve()), serve.launcher.value, str(serve.host),
            serve.get("server_bin"), serve.get("image"), serve.get("url"), serve.get("repo_mount"))


def _usable(server) -> bool:
    return server.proc is None or (server.alive() and server.ready())


@contextlib.contextmanager
def _started(serve, repo: Path, work: Path, stage: str) -> Iterator[Any]:
    """The server ``serve.launcher`` asks for, started now, with its start-up and its stop in the run log."""
    from pipeline.triton import server as srv

    t0 = time.perf_counter()
    with srv.launched(serve, repo, work) as server:
        pid = server.proc.pid if server.proc is not None else None
        log.info("tritonserver started for %s (%s, gRPC %s, supervisor pid %s) by %s in %.1f s", repo,
                 serve.launcher.value, server.grpc_url, pid, stage, time.perf_counter() - t0)
        try:
            yield server
        finally:
            t1 = time.perf_counter()
            srv.stop(server)
            log.info("tritonserver stopped for %s in %.1f s", repo, time.perf_counter() - t1)


@contextlib.contextmanager
def triton(shared, serve, repo: Path, work: Path, stage: str) -> Iterator[Lease]:
    """A server serving ``repo`` with ``serve``'s launcher, for stage ``stage``: the run's (``shared``: the runner's
    :class:`~pipeline.runner.contract.Shared`, which keeps it for the stages after this one that serve ``repo``), or,
    without one, a server of this block's own, stopped when it ends."""
    t0 = time.perf_counter()
    if shared is None:
        with _started(serve, repo, work, stage) as server:
            yield Lease(server, server.log_path, True, round(time.perf_counter() - t0, 2), 0, [stage])
        return
    key = server_key(serve, repo)
    server, new = shared.get(key, str(repo), lambda: _started(serve, repo, work, stage), _usable)
    users = shared.notes(key).setdefault("stages", [])
    users.append(stage)
    if not new:
        log.info("tritonserver reused for %s (gRPC %s) by %s", repo, server.grpc_url, stage)
    yield Lease(server, server.log_path, new, round(time.perf_counter() - t0, 2),
                0 if new else _size(server.log_path), list(users))


def front_settings(openai_cfg, repo: Path) -> dict[str, Any]:
    """The front end's settings (:data:`FRONT_KEYS` of ``serve.openai``, merged onto the schema's defaults) with the
    served model's name resolved and any free port: what a front end is keyed by, and what its process reads."""
    from omegaconf import OmegaConf

    from pipeline import schema
    from pipeline.serving import model as served_model

    given = {k: openai_cfg[k] for k in FRONT_KEYS if k in openai_cfg}
    merged = OmegaConf.merge(OmegaConf.structured(schema.OpenAIConfig), OmegaConf.create(
        OmegaConf.to_container(OmegaConf.create(given), resolve=True, enum_to_str=True)))
    doc = OmegaConf.to_container(merged, resolve=True, enum_to_str=True)
    doc["model_name"] = served_model.load(repo, name=doc.get("model_name"), load_tokenizer=False).name
    doc["port"] = 0
    return doc


@contextlib.contextmanager
def _front_started(repo: Path, server, settings: dict[str, Any], work: Path, stage: str) -> Iterator[tuple[str, Path]]:
    import tempfile

    from pipeline.serving import run

    work.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="openai-", dir=work))
    path, log_path = d / "openai-front-end.json", d / "openai-front-end.log"
    path.write_text(json.dumps(settings, indent=1) + "\n")
    t0 = time.perf_counter()
    with run.child(repo, server.grpc_url, path, log_path) as url:
        log.info("OpenAI front end started for %s (%s, before gRPC %s) by %s in %.1f s", repo, url, server.grpc_url,
                 stage, time.perf_counter() - t0)
        try:
            yield url, log_path
        finally:
            log.info("OpenAI front end stopped for %s", repo)


@contextlib.contextmanager
def front_end(shared, lease: Lease, settings: dict[str, Any], repo: Path, work: Path, stage: str) -> Iterator[Lease]:
    """The OpenAI front end with ``settings`` (:func:`front_settings` of ``serve.openai``) before the server of
    ``lease``, in a process of its own; shared like the server (keyed by the server and the settings)."""
    server = lease.value
    t0 = time.perf_counter()
    if shared is None:
        with _front_started(repo, server, settings, work, stage) as (url, log_path):
            yield Lease(url, log_path, True, round(time.perf_counter() - t0, 2), 0, [stage])
        return
    key = ("openai", server.grpc_url, json.dumps(settings, sort_keys=True))
    (url, log_path), new = shared.get(key, str(repo), lambda: _front_started(repo, server, settings, work, stage))
    users = shared.notes(key).setdefault("stages", [])
    users.append(stage)
    if not new:
        log.info("OpenAI front end reused for %s (%s) by %s", repo, url, stage)
    yield Lease(url, log_path, new, round(time.perf_counter() - t0, 2), 0 if new else _size(log_path), list(users))


def startups(log_text: str) -> dict[tuple[str, str], Counter]:
    """{(what, repository): Counter of started / reused / stopped} from a run log's ``pipeline.servers`` lines:
    ``what`` is ``tritonserver`` or ``OpenAI front end``."""
    out: dict[tuple[str, str], Counter] = {}
    for line in log_text.splitlines():
        if " pipeline.servers: " not in line:
            continue
        m = _EVENT.search(line)
        if m:
            out.setdefault((m.group(1), m.group(3)), Counter())[m.group(2)] += 1
    return out


def startup_problems(log_text: str) -> list[str]:
    """What in a run log says a server or front end was started more than once for one repository, or not stopped
    as often as it was started."""
    problems = []
    for (what, repo), n in sorted(startups(log_text).items()):
        if n["started"] > 1:
            problems.append(f"{what} started {n['started']} times for {repo}")
        if n["stopped"] != n["started"]:
            problems.append(f"{what} for {repo}: started {n['started']}, stopped {n['stopped']}")
    return problems
