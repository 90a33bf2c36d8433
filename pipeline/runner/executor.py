"""The stage executor: cache decisions from the fingerprints, atomic locked outputs, manifests, the build's plan
(:func:`preflight` -> :class:`BuildPlan`) and its run (:func:`run` -> :class:`BuildReport`).

A stage is a plain module with one ``Stage`` record (``pipeline.runner.contract``; ``pipeline/stages/__init__.py``
holds the ordered registry). Its fingerprint hashes the config slice it reads, the fingerprints of its input stages,
the source of its code (``pipeline.runner.fingerprint``), and the versions of the libraries it calls. The output
directory's name carries the fingerprint, so a changed setting lands in a new directory and the old one is never
half-overwritten.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline import __version__, errors, planning, store
from pipeline.config import resolved_paths, slice_of, to_plain
from pipeline.errors import StageFailed, UserError
from pipeline.identity import ArtifactKey
from pipeline.runner.contract import Context, Shared, Stage, host_info, lib_versions, stage_config
from pipeline.runner.fingerprint import capacity_fields, stage_code_digest

log = logging.getLogger("pipeline")


@dataclass
class PlannedStage:
    stage: Stage
    fingerprint: str
    parts: dict[str, Any]
    out: Path
    cached: bool
    reason: str  # why it runs, or "cached"


def dump_result(result: Any) -> dict[str, Any]:
    """A stage's result as its manifest holds it: a pydantic model's JSON dump (``pipeline.results``); a plain
    dict (stages of tests) as it is."""
    if result is None:
        return {}
    return result.model_dump(mode="json") if hasattr(result, "model_dump") else result


def _out_dir(cfg: DictConfig, st: Stage, fp: str, paths: dict[str, Path]) -> Path:
    return paths[st.root] / f"{st.label(cfg)}-{st.name}-{fp[:12]}"


def plan(cfg: DictConfig, stages: list[Stage], capacity: planning.Capacity | None = None) -> list[PlannedStage]:
    """Fingerprint every stage and decide cached/run without doing any work. ``capacity`` is ``cfg``'s resolved
    capacity plan (resolved here when a stage needs it and none is given)."""
    paths = resolved_paths(cfg)
    force = set(cfg.force)
    planned: dict[str, PlannedStage] = {}
    for st in stages:
        parts: dict[str, Any] = {
            "stage": st.name,
            "config": slice_of(cfg, st.reads),
            "inputs": {n: planned[n].fingerprint for n in st.inputs},
            "code": stage_code_digest(st),
            "libs": lib_versions(st.libs),
        }
        if st.extra is not None:
            parts["extra"] = st.extra(cfg, paths["store"])
        fields = capacity_fields(cfg, st)
        if fields:
            if capacity is None:
                capacity = planning.resolve(cfg)
            parts["capacity"] = capacity.values(fields)
        fp = store.digest(parts)
        out = _out_dir(cfg, st, fp, paths)
        reason = _stale_reason(out, fp, st, planned)
        if st.name in force:
            reason = "forced"
        elif any(not planned[n].cached for n in st.inputs) and reason == "cached":
            reason = "input re-runs"
        planned[st.name] = PlannedStage(st, fp, parts, out, reason == "cached", reason)
    return list(planned.values())


def _stale_reason(out: Path, fp: str, st: Stage, planned: dict[str, PlannedStage]) -> str:
    manifest = store.read_manifest(out)
    if manifest is None:
        return "no output yet"
    if manifest.get("fingerprint") != fp:
        return "fingerprint changed"
    problem = store.quick_intact(out, manifest)
    if problem:
        return f"output damaged: {problem}"
    for name in st.inputs:
        up = store.read_manifest(planned[name].out)
        if up is None or manifest.get("input_digests", {}).get(name) != store.content_digest(up, planned[name].stage.volatile):
            return f"input {name} changed"
    return "cached"


class PeakRSS:
    """Peak resident memory of this process and its children while the block runs (sampled)."""

    def __init__(self, interval: float = 0.2):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def _once(self) -> None:
        import psutil

        try:
            me = psutil.Process()
            rss = me.memory_info().rss + sum(c.memory_info().rss for c in me.children(recursive=True))
            self.peak = max(self.peak, rss)
        except psutil.Error:  # a child exited between listing and reading it
            pass

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._once()

    def __enter__(self) -> "PeakRSS":
        self._once()  # a block shorter than one interval still gets a sample
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
        self._once()


def execute(cfg: DictConfig, ps: PlannedStage, planned: dict[str, PlannedStage], console: Any = None,
            shared: Shared | None = None) -> dict[str, Any]:
    """Run one stage into a temp dir under its lock, write its manifest, rename into place. Returns the manifest.
    ``shared``: the run's shared resources (:class:`Shared`), which the stage's context carries."""
    st = ps.stage
    paths = resolved_paths(cfg)

    def waiting(msg: str) -> None:
        (console.print if console else log.info)(f"[yellow]{st.name}: {msg}[/]" if console else f"{st.name}: {msg}")

    with store.locked(ps.out, on_wait=waiting, lock_dir=paths["store"] / "locks"):
        if ps.reason != "forced":
            reason = _stale_reason(ps.out, ps.fingerprint, st, planned)
            if reason == "cached":  # another run finished it while we waited
                ps.cached, ps.reason = True, "cached (built by a concurrent run)"
                return store.read_manifest(ps.out)  # type: ignore[return-value]
        store.clean_partials(ps.out)
        tmp = store.new_tmp_dir(ps.out)
        inputs = {n: planned[n].out for n in st.inputs}
        manifests = {n: store.read_manifest(planned[n].out) or {} for n in st.inputs}
        ctx = Context(cfg=stage_config(cfg, st), stage=st, out=tmp, final=ps.out, inputs=inputs, manifests=manifests,
                      paths=paths, console=console, fingerprint=ps.fingerprint, extra=ps.parts.get("extra") or {},
                      capacity=planning.CapacityView(ps.parts["capacity"]) if "capacity" in ps.parts else None,
                      shared=shared)
        started = _dt.datetime.now(_dt.timezone.utc)
        t0 = time.perf_counter()
        try:
            with PeakRSS() as mem:
                result = dump_result(st.run(ctx))
            files = store.list_files(tmp, ctx.known_hashes)
            manifest = {
                "stage": st.name,
                "fingerprint": ps.fingerprint,
                "fingerprint_parts": ps.parts,
                "label": st.label(cfg),
                "inputs": {n: str(p) for n, p in inputs.items()},
                "input_digests": {n: store.content_digest(m, planned[n].stage.volatile) for n, m in manifests.items()},
                "config": to_plain(cfg),
                "versions": {"pipeline": __version__, **lib_versions(st.libs)},
                "host": host_info(),
                "started": started.isoformat(timespec="seconds"),
                "wall_s": round(time.perf_counter() - t0, 3),
                "peak_rss_mb": round(mem.peak / 2**20, 1),
                "result": result,
                "files": files,
            }
            store.write_json_atomic(tmp / store.MANIFEST, manifest)
            if st.read_only:
                store.make_read_only(tmp)
            store.commit_dir(tmp, ps.out)
        except StageFailed as exc:  # a gate failed: keep what the stage wrote as a report, never as an output
            kept = paths["reports"] / "failed" / f"{ps.out.name}-{started.strftime('%Y%m%dT%H%M%S')}"
            kept.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(tmp, kept)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            raise StageFailed(f"{exc} (report: {kept})") from exc
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            code = disk_full(exc)
            if code:  # libraries word it their own way (safetensors: "os error 27"); name the output instead
                raise OSError(code, os.strerror(code), str(ps.out)) from exc
            raise
    return manifest


disk_full = errors.disk_full  # the one mapping, kept under its old name for callers of the runner


def upstream_missing(ps: PlannedStage, planned: dict[str, PlannedStage]) -> None:
    for n in ps.stage.inputs:
        if store.read_manifest(planned[n].out) is None:
            raise UserError(f"{ps.stage.name} needs the output of {n}, which is missing; run without until=")


# ---------------------------------------------------------------------------------------------------- orchestration
# The stage registry (``pipeline.stages.STAGES``) is passed in, never imported here: the stage modules import this
# one, and a stage's code digest follows its imports.
def select(cfg: DictConfig, registry: tuple[Stage, ...] | list[Stage]) -> list[Stage]:
    """The stages of ``registry`` a build of ``cfg`` runs: all of them, or up to ``until=STAGE``."""
    stages = list(registry)
    if cfg.until is not None:
        names = [s.name for s in stages]
        stages = stages[: names.index(cfg.until) + 1]
    return stages


def plan_checks(cfg: DictConfig, stages: list[Stage], *, environment: bool = True) -> list[str]:
    """Incompatibilities of the config (and, with ``environment``, of this machine) found before any work."""
    problems: list[str] = []
    for st in stages:
        if st.check is not None:
            problems.extend(st.check(cfg))
        if environment and st.env_check is not None:
            problems.extend(st.env_check(cfg))
    return problems


@dataclass
class BuildPlan:
    """The selected stages of one config, checked and fingerprinted, and its capacity plan, resolved once; nothing
    run, nothing written."""

    cfg: DictConfig
    stages: list[PlannedStage]
    capacity: planning.Capacity
    by_name: dict[str, PlannedStage] = field(init=False)

    def __post_init__(self) -> None:
        self.by_name = {p.stage.name: p for p in self.stages}


def writable_root(cfg: DictConfig) -> None:
    """``paths.root`` and the stage store can be created and written here; else one line naming the path. Nothing
    is created: the nearest existing directory of each path is probed with a temporary file that is removed."""
    import errno as _errno
    import tempfile

    paths = resolved_paths(cfg)
    for key in ("root", "store"):
        p = paths[key]
        probe = next((a for a in (p, *p.parents) if a.exists()), None)
        try:
            if probe is None or not probe.is_dir():
                raise NotADirectoryError(_errno.ENOTDIR, "not a directory", str(probe))
            tempfile.TemporaryFile(dir=probe).close()
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
            hint = "free some space" if exc.errno in (_errno.ENOSPC, _errno.EDQUOT) else "give a writable directory"
            raise UserError(f"paths.{key}={p}: cannot write there ({why}); {hint} (paths.root=DIR)") from None


def preflight(cfg: DictConfig, registry: tuple[Stage, ...] | list[Stage], *, environment: bool = True) -> BuildPlan:
    """Every plan-time check of the stages ``cfg`` selects from ``registry``, then their fingerprints. Config
    incompatibilities come first (and alone); then, with ``environment``, what this machine lacks to run the stages.
    Raises one :class:`UserError` naming every problem found. The capacity plan (TP, PP, KV pool) is resolved here,
    once, and handed to the stages that declare what they use of it."""
    stages = select(cfg, registry)
    problems = plan_checks(cfg, stages, environment=False)
    if problems:
        raise UserError(problems[0] if len(problems) == 1 else "; ".join(problems), problems=problems)
    capacity = planning.resolve(cfg)
    problems = [m for st in stages if st.capacity_check is not None for m in st.capacity_check(cfg, capacity)]
    if problems:
        raise UserError(problems[0] if len(problems) == 1 else "; ".join(problems), problems=problems)
    planned = BuildPlan(cfg, plan(cfg, stages, capacity), capacity)
    problems = env_problems(planned) if environment else []
    if problems:
        raise UserError(problems[0] if len(problems) == 1 else "; ".join(problems), problems=problems)
    return planned


def env_problems(p: "BuildPlan") -> list[str]:
    """What this machine lacks to run the planned stages that are not cached (a cached stage needs nothing here:
    a quantize done on a GPU host and copied into the store is not refused on a CPU machine)."""
    return [msg for ps in p.stages if not ps.cached and ps.stage.env_check is not None
            for msg in ps.stage.env_check(p.cfg)]


def served_later(plan: "BuildPlan", i: int) -> set[str]:
    """The outputs (their paths) that the stages after the ``i``-th of ``plan`` that will run serve
    (``Stage.serves``): what the run's shared resources must keep serving."""
    return {str(plan.by_name[n].out) for ps in plan.stages[i + 1:] if not ps.cached for n in ps.stage.serves
            if n in plan.by_name}


@dataclass
class BuildReport:
    """What one build did: a row per stage (cached or ran, timings, size, output, result) and the publish outcome."""

    model: str
    quant: str
    kv_cache: str
    target: str
    runtime: str
    total_s: float
    stages: list[dict[str, Any]]
    log: str
    finished: str
    published: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report as ``reports/<label>.json`` holds it (and ``build --json`` prints it)."""
        return {"model": self.model, "quant": self.quant, "kv_cache": self.kv_cache, "published": self.published,
                "target": self.target, "runtime": self.runtime, "total_s": self.total_s, "stages": self.stages,
                "log": self.log, "finished": self.finished}


@contextlib.contextmanager
def _quiet(log_path: Path, stage: str | None = None):
    """While a stage runs: library prints (ModelOpt is chatty on stdout), Python warnings and the libraries' log
    records go to the run log; the console shows the stage's one progress display (see ``pipeline.ui``)."""
    from pipeline import ui

    logging.captureWarnings(True)
    ui.route_library_logs()
    with open(log_path, "a") as f, contextlib.redirect_stdout(f), ui.stage(stage or "working"):
        yield


def run(plan: BuildPlan, console: Any = None) -> BuildReport:
    """Run every planned stage that is not cached (in order, each under its lock), then each stage's ``after`` hook
    with the full config. Stage output and library logs go to the run log (the root logger's file; one is opened in
    ``<store>/logs`` when none is); ``console`` shows progress."""
    from pipeline import errors

    cfg = plan.cfg
    writable_root(cfg)
    log_path = errors.current_log()
    if log_path is None:
        log_path = errors.log_path(resolved_paths(cfg)["store"] / "logs")
        errors.setup_logging(log_path)
    paths = resolved_paths(cfg)
    for p in store.remove_orphans([paths[k] for k in ("store", "engines", "triton_repo", "bundles") if k in paths],
                                  paths["store"] / "locks"):
        log.info("removed %s, left by a build that was killed", p)
    rows = []
    t_all = time.perf_counter()
    shared = Shared()  # a server the bench and the evaluation both serve is started once per run
    try:
        for i, ps in enumerate(plan.stages):
            t0 = time.perf_counter()
            if ps.cached:
                manifest = store.read_manifest(ps.out) or {}
                status = "cached"
            else:
                if console is not None:
                    console.print(f"[bold cyan]▶ {ps.stage.name}[/] [dim]({ps.reason})[/]")
                upstream_missing(ps, plan.by_name)
                with _quiet(log_path, ps.stage.name):
                    manifest = execute(cfg, ps, plan.by_name, console, shared)
                    shared.keep_only(served_later(plan, i))  # what no stage left to run serves is stopped now
                status = "cached" if ps.cached else "ran"  # a concurrent run may have built it while we waited
            elapsed = time.perf_counter() - t0
            size = sum(f["size"] for f in manifest.get("files", []))
            rows.append({"stage": ps.stage.name, "status": status, "seconds": round(elapsed, 2),
                         "stage_wall_s": manifest.get("wall_s"), "peak_rss_mb": manifest.get("peak_rss_mb"),
                         "bytes": size, "output": str(ps.out), "fingerprint": ps.fingerprint, "result":
                         manifest.get("result", {})})
            if status == "ran" and console is not None:
                console.print(f"  [green]✓[/] {ps.stage.name} {elapsed:.1f}s → {ps.out}")
            log.info("stage %s: %s (%.2fs) %s", ps.stage.name, status, elapsed, ps.out)
    finally:
        shared.close()
    published = None
    for ps in plan.stages:
        if ps.stage.after is None:
            continue
        value = ps.stage.after(cfg, ps.out)
        if ps.stage.name == "publish":
            published = value
            log.info("published: %s", value)
    key = ArtifactKey.of(cfg)
    return BuildReport(model=key.model, quant=key.quant, kv_cache=key.kv, target=key.target, runtime=key.runtime,
                       total_s=round(time.perf_counter() - t_all, 2), stages=rows, log=str(log_path),
                       finished=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), published=published)
