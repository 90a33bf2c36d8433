"""The stage runner: fingerprints, cache decisions, atomic locked outputs, manifests.

A stage is a plain module with one :class:`Stage` record (see ``pipeline/stages/__init__.py`` for the ordered
registry). Its fingerprint hashes the config slice it reads, the fingerprints of its input stages, the source of its
code, and the versions of the libraries it calls. The output directory's name carries the fingerprint, so a changed
setting lands in a new directory and the old one is never half-overwritten.
"""
from __future__ import annotations

import datetime as _dt
import importlib.metadata as md
import importlib.util
import logging
import os
import platform
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig

from pipeline import __version__, store
from pipeline.config import resolved_paths, slice_of, to_plain
from pipeline.errors import StageFailed, UserError

log = logging.getLogger("pipeline")


def artifact_label(cfg: DictConfig) -> str:
    """``<model>.<quant>-kv<kv>.<target>.<runtime>``: names the per-target outputs and the build report."""
    return (f"{cfg.model.name}.{cfg.quant.format.value}-kv{cfg.quant.kv_cache.value}"
            f".{cfg.target.name}.{cfg.runtime.name.value}")


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[["Context"], dict[str, Any]]
    reads: tuple[str, ...]  # config keys (dotted) whose values enter the fingerprint
    inputs: tuple[str, ...] = ()  # upstream stage names
    libs: tuple[str, ...] = ()  # distributions whose versions enter the fingerprint
    code: tuple[str, ...] = ()  # extra modules whose source enters the fingerprint (the stage module always does)
    root: str = "store"  # paths.<root> holds the output directory
    label: Callable[[DictConfig], str] = lambda cfg: cfg.model.name
    check: Callable[[DictConfig], list[str]] | None = None  # plan-time incompatibilities (no work, no download)
    env_check: Callable[[DictConfig], list[str]] | None = None  # plan-time problems of this machine (memory, GPU)
    extra: Callable[[DictConfig, Path], dict[str, Any]] | None = None  # cheap extra fingerprint inputs (file digests)
    volatile: tuple[str, ...] = ()  # report files with timings: listed in the manifest, left out of the content digest
    read_only: bool = False  # make every output file read-only (published bundles)


@dataclass
class Context:
    cfg: DictConfig
    stage: Stage
    out: Path  # temp directory to write into; renamed into place on success
    final: Path  # where the output will live
    inputs: dict[str, Path]  # upstream stage name -> final output dir
    manifests: dict[str, dict[str, Any]]  # upstream stage name -> its manifest
    paths: dict[str, Path]
    console: Any = None
    fingerprint: str = ""
    known_hashes: dict[str, str] = field(default_factory=dict)  # rel path -> sha256 already known (hard links)


@dataclass
class PlannedStage:
    stage: Stage
    fingerprint: str
    parts: dict[str, Any]
    out: Path
    cached: bool
    reason: str  # why it runs, or "cached"


def _code_digest(stage: Stage) -> str:
    mods = [stage.run.__module__, *stage.code]
    srcs = []
    for name in mods:  # hash source files without importing them (plan must stay cheap)
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            raise RuntimeError(f"stage {stage.name}: code module {name} not found")
        srcs.append((name, store.digest(Path(spec.origin).read_bytes().decode())))
    return store.digest(srcs)


def lib_versions(names: tuple[str, ...] | list[str]) -> dict[str, str]:
    out = {}
    for n in names:
        try:
            out[n] = md.version(n)
        except md.PackageNotFoundError:
            out[n] = "absent"
    return out


def _out_dir(cfg: DictConfig, st: Stage, fp: str, paths: dict[str, Path]) -> Path:
    return paths[st.root] / f"{st.label(cfg)}-{st.name}-{fp[:12]}"


def plan(cfg: DictConfig, stages: list[Stage]) -> list[PlannedStage]:
    """Fingerprint every stage and decide cached/run without doing any work."""
    paths = resolved_paths(cfg)
    force = set(cfg.force)
    planned: dict[str, PlannedStage] = {}
    for st in stages:
        parts: dict[str, Any] = {
            "stage": st.name,
            "config": slice_of(cfg, st.reads),
            "inputs": {n: planned[n].fingerprint for n in st.inputs},
            "code": _code_digest(st),
            "libs": lib_versions(st.libs),
        }
        if st.extra is not None:
            parts["extra"] = st.extra(cfg, paths["store"])
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


def host_info() -> dict[str, Any]:
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count()}


def execute(cfg: DictConfig, ps: PlannedStage, planned: dict[str, PlannedStage], console: Any = None) -> dict[str, Any]:
    """Run one stage into a temp dir under its lock, write its manifest, rename into place. Returns the manifest."""
    st = ps.stage
    paths = resolved_paths(cfg)

    def waiting(msg: str) -> None:
        (console.print if console else log.info)(f"[yellow]{st.name}: {msg}[/]" if console else f"{st.name}: {msg}")

    with store.locked(ps.out, on_wait=waiting):
        if ps.reason != "forced":
            reason = _stale_reason(ps.out, ps.fingerprint, st, planned)
            if reason == "cached":  # another run finished it while we waited
                ps.cached, ps.reason = True, "cached (built by a concurrent run)"
                return store.read_manifest(ps.out)  # type: ignore[return-value]
        store.clean_partials(ps.out)
        tmp = store.new_tmp_dir(ps.out)
        inputs = {n: planned[n].out for n in st.inputs}
        manifests = {n: store.read_manifest(planned[n].out) or {} for n in st.inputs}
        ctx = Context(cfg=cfg, stage=st, out=tmp, final=ps.out, inputs=inputs, manifests=manifests, paths=paths,
                      console=console, fingerprint=ps.fingerprint)
        started = _dt.datetime.now(_dt.timezone.utc)
        t0 = time.perf_counter()
        try:
            with PeakRSS() as mem:
                result = st.run(ctx) or {}
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


def disk_full(exc: BaseException) -> int | None:
    """errno of a full disk / file-size limit / quota anywhere in the exception chain, else None."""
    import errno

    codes = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in codes:
            return exc.errno
        text = str(exc)
        for code in codes:
            if f"os error {code})" in text or os.strerror(code) in text:
                return code
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def upstream_missing(ps: PlannedStage, planned: dict[str, PlannedStage]) -> None:
    for n in ps.stage.inputs:
        if store.read_manifest(planned[n].out) is None:
            raise UserError(f"{ps.stage.name} needs the output of {n}, which is missing; run without until=")
