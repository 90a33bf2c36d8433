"""The stage runner: fingerprints, cache decisions, atomic locked outputs, manifests.

A stage is a plain module with one :class:`Stage` record (see ``pipeline/stages/__init__.py`` for the ordered
registry). Its fingerprint hashes the config slice it reads, the fingerprints of its input stages, the source of its
code, and the versions of the libraries it calls. The output directory's name carries the fingerprint, so a changed
setting lands in a new directory and the old one is never half-overwritten.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import datetime as _dt
import functools
import hashlib
import importlib.metadata as md
import importlib.util
import logging
import os
import platform
import re
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from pipeline import __version__, errors, planning, store
from pipeline.config import resolved_paths, slice_of, to_plain
from pipeline.errors import StageFailed, UserError
from pipeline.identity import ArtifactKey

log = logging.getLogger("pipeline")


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline, and its lifecycle:

    1. ``check(cfg)``, at plan time, for every selected stage: incompatibilities of the config (quant x GPU, block
       sizes); no work, no download. Any problem refuses the whole build before anything is written.
    2. ``env_check(cfg)``, at plan time too, for the stages that will run on this machine: what this machine lacks
       (memory, a GPU, a server binary). ``plan`` lists these without failing.
    3. ``run(ctx)``, when the stage is not cached: writes into ``ctx.out`` (a temp directory renamed into place) and
       returns its typed result (``pipeline.results``), which the manifest records. It reads the config only through
       ``ctx.cfg`` (its declared ``reads``) and its inputs only through ``ctx.result(name)`` and ``ctx.inputs``.
    4. ``after(cfg, out)``, after every planned stage ran or was found cached: side effects that are no property of
       the output (publish: the upload to ``publish.dest``).
    """

    name: str
    run: Callable[["Context"], Any]  # returns the stage's result (a pipeline.results model)
    # config keys (dotted) whose values enter the fingerprint; the only keys ``run`` can read (Context.cfg)
    reads: tuple[str, ...]
    inputs: tuple[str, ...] = ()  # upstream stage names
    libs: tuple[str, ...] = ()  # distributions whose versions enter the fingerprint
    # keys ``run`` may read that say where things are, never what is made: readable, left out of the fingerprint
    unhashed_reads: tuple[str, ...] = ()
    root: str = "store"  # paths.<root> holds the output directory
    label: Callable[[DictConfig], str] = lambda cfg: cfg.model.name
    check: Callable[[DictConfig], list[str]] | None = None  # plan-time incompatibilities (no work, no download)
    env_check: Callable[[DictConfig], list[str]] | None = None  # plan-time problems of this machine (memory, GPU)
    extra: Callable[[DictConfig, Path], dict[str, Any]] | None = None  # cheap extra fingerprint inputs (file digests)
    volatile: tuple[str, ...] = ()  # report files with timings: listed in the manifest, left out of the content digest
    read_only: bool = False  # make every output file read-only (published bundles)
    # after every planned stage ran or was found cached: (full config, this stage's output dir) -> a value for the
    # build report (publish: the upload to publish.dest, which is no property of the bundle)
    after: Callable[[DictConfig, Path], Any] | None = None
    # the fields of the resolved capacity plan (planning.Capacity.FIELDS) ``run`` uses, or a function of the full
    # config choosing them: their values enter the fingerprint, and they are all ``run`` sees of the plan
    # (Context.capacity; None when no field is declared)
    capacity: tuple[str, ...] | Callable[[DictConfig], tuple[str, ...]] = ()
    # input stages whose output ``run`` serves through the run's shared resources (Context.shared: the bench and the
    # task evaluation serve the packaged repository on one Triton server): what the run keeps for the stages left
    serves: tuple[str, ...] = ()


@dataclass
class Context:
    cfg: DictConfig  # the runner passes stage_config(): read-only, the stage's declared keys only
    stage: Stage
    out: Path  # temp directory to write into; renamed into place on success
    final: Path  # where the output will live
    inputs: dict[str, Path]  # upstream stage name -> final output dir
    manifests: dict[str, dict[str, Any]]  # upstream stage name -> its manifest
    paths: dict[str, Path]
    console: Any = None
    fingerprint: str = ""
    known_hashes: dict[str, str] = field(default_factory=dict)  # rel path -> sha256 already known (hard links)
    extra: dict[str, Any] = field(default_factory=dict)  # the stage's ``extra`` fingerprint inputs, as fingerprinted
    capacity: planning.CapacityView | None = None  # the declared fields of the resolved capacity plan, as fingerprinted
    # what the stages of this build run share (a server serving an input's output): None outside a run (a stage
    # called on its own starts and stops what it serves itself)
    shared: "Shared | None" = None

    def result(self, name: str) -> Any:
        """The typed result (a ``pipeline.results`` model) of upstream stage ``name``, read from its manifest: how a
        stage reads what an input stage made, never by parsing that stage's report files."""
        from pipeline import results

        if name not in self.stage.inputs:
            raise KeyError(f"{self.stage.name} does not declare {name} among its inputs")
        return results.read(name, (self.manifests.get(name) or {}).get("result"))

    def link_input(self, name: str, src_rel: str = "", dst_rel: str = "", *, link: bool = True) -> Path:
        """Hard-link (copy where linking fails; ``link=False``: copy) the file or directory ``src_rel`` of upstream
        stage ``name``'s output to ``dst_rel`` in this stage's output, and record each linked file's sha256 from the
        upstream manifest in :attr:`known_hashes`, so it is not read again. The upstream ``manifest.json`` itself is
        never linked. Returns the destination."""
        root = self.inputs[name]
        src, dst = root / src_rel if src_rel else root, self.out / dst_rel if dst_rel else self.out
        upstream = {f["path"]: f["sha256"] for f in (self.manifests.get(name) or {}).get("files", [])}
        files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
        for p in files:
            if p == root / store.MANIFEST:
                continue
            target = dst if p == src else dst / p.relative_to(src)
            store.link_or_copy(p, target, link=link)
            sha = upstream.get(p.relative_to(root).as_posix())
            if sha is not None:
                self.known_hashes[target.relative_to(self.out).as_posix()] = sha
        return dst


class Shared:
    """Resources the stages of one build run share beyond their outputs: a Triton server (and the OpenAI front end
    before it) serving one stage's output, which the bench and the task evaluation both serve. The first stage that
    asks enters it; a later stage of the run asking with the same key gets the same one (when ``usable`` says it
    still is); it is closed once no stage left to run serves its ``tag`` (:meth:`keep_only`, called by :func:`run`
    after each stage), and on every exit path of the run (:meth:`close`), newest first. A stage's outputs never
    depend on whether it got a shared one: only how long it waited. Nothing here outlives the run."""

    def __init__(self) -> None:
        self._held: dict[Any, tuple[str, Any, contextlib.ExitStack]] = {}  # key -> (tag, value, its exit stack)
        self._notes: dict[Any, dict[str, Any]] = {}

    def notes(self, key: Any) -> dict[str, Any]:
        """What the users of the resource held under ``key`` note about it (which stages took it), kept as long
        as it is held."""
        return self._notes.setdefault(key, {})

    def get(self, key: Any, tag: str, factory: Callable[[], Any],
            usable: Callable[[Any], bool] = lambda value: True) -> tuple[Any, bool]:
        """(the resource held under ``key``, False) when there is a usable one; else (``factory()`` entered, True),
        closing an unusable one first, with every resource entered after it (they may depend on it)."""
        held = self._held.get(key)
        if held is not None:
            if usable(held[1]):
                return held[1], False
            self._close_from(key)
        stack = contextlib.ExitStack()
        try:
            value = stack.enter_context(factory())
        except BaseException:
            stack.close()
            raise
        self._held[key] = (tag, value, stack)
        return value, True

    def _close_from(self, key: Any) -> None:
        keys = list(self._held)
        for k in reversed(keys[keys.index(key):]):
            self._close(k)

    def _close(self, key: Any) -> None:
        _tag, _value, stack = self._held.pop(key)
        self._notes.pop(key, None)
        stack.close()

    def keep_only(self, tags: set[str]) -> None:
        """Close what no stage left to run serves (its tag not in ``tags``), newest first."""
        for k in reversed(list(self._held)):
            if self._held[k][0] not in tags:
                self._close(k)

    def close(self) -> None:
        """Close everything held, newest first; the first error is raised after all were closed."""
        first: BaseException | None = None
        for k in reversed(list(self._held)):
            try:
                self._close(k)
            except BaseException as exc:  # noqa: BLE001 - close the rest, then raise
                first = first or exc
        if first is not None:
            raise first

    def __len__(self) -> int:
        return len(self._held)


_ABSENT = object()


def stage_config(cfg: DictConfig, stage: Stage) -> DictConfig:
    """What a stage's ``run`` sees of the config: the keys it declares (``reads``, ``unhashed_reads``), resolved,
    typed as in ``cfg`` (enum values keep ``.value``), read-only. Reading any other key raises OmegaConf's
    ``ConfigAttributeError``/``ConfigKeyError``: an undeclared read would leave the fingerprint blind to it."""
    full = copy.deepcopy(cfg)
    OmegaConf.resolve(full)
    view = OmegaConf.create({})
    for key in sorted({*stage.reads, *stage.unhashed_reads}, key=lambda k: k.count(".")):
        *parents, leaf = key.split(".")
        node = view
        for part in parents:
            if part not in node:
                node[part] = {}
            node = node[part]
        value = OmegaConf.select(full, key, throw_on_missing=True, default=_ABSENT)
        if value is _ABSENT:
            raise KeyError(f"stage {stage.name} declares config key {key!r}, which the config does not have")
        node[leaf] = value
    OmegaConf.set_struct(view, True)
    OmegaConf.set_readonly(view, True)
    return view


@dataclass
class PlannedStage:
    stage: Stage
    fingerprint: str
    parts: dict[str, Any]
    out: Path
    cached: bool
    reason: str  # why it runs, or "cached"


# Modules that cannot change what a stage writes (presentation, errors, orchestration of the stage loop): their
# source stays out of every code digest, and the import walk does not pass through them.
CODE_EXCLUDED = ("pipeline.ui", "pipeline.errors", "pipeline.report", "pipeline.cli", "pipeline.runner")
PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # the directory holding the ``pipeline`` package
_MODULE_NAME = re.compile(r"pipeline(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _module_file(name: str, root: Path) -> Path | None:
    """The source file of module ``name`` of the ``pipeline`` package under ``root``, found without importing."""
    parts = name.split(".")
    if parts[0] != "pipeline":
        return None
    base = root.joinpath(*parts)
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _excluded(name: str) -> bool:
    return any(name == e or name.startswith(e + ".") for e in CODE_EXCLUDED)


_Import = tuple[int, str, tuple[str, ...]]  # (relative level, module, names imported from it)


@functools.lru_cache(maxsize=1024)
def _scan(path: Path, mtime_ns: int, size: int) -> tuple[str, tuple[_Import, ...], tuple[str, ...], bool]:
    """(sha256 of the source, its imports as (level, module, names), its string constants that look like module
    names, whether it discovers the modules of its package: it calls ``pkgutil.iter_modules`` and reads
    ``__path__``); cached by file identity."""
    text = path.read_bytes()
    tree = ast.parse(text, filename=str(path))
    imports: list[_Import] = []
    strings: list[str] = []
    lists = reads_path = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imports.extend((0, a.name, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imports.append((node.level, node.module or "", tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_NAME.fullmatch(node.value):
            strings.append(node.value)
        elif isinstance(node, ast.Call) and "iter_modules" in (getattr(node.func, "attr", None),
                                                               getattr(node.func, "id", None)):
            lists = True
        elif isinstance(node, ast.Name) and node.id == "__path__":
            reads_path = True
    return hashlib.sha256(text).hexdigest(), tuple(imports), tuple(strings), lists and reads_path


def _imports_of(name: str, path: Path, root: Path) -> set[str]:
    """The ``pipeline`` modules module ``name`` (at ``path``) names: its imports, at any level of the file (function
    bodies included), module names written as strings (``python -m pipeline.x`` children, ``find_spec``
    lookups of files it copies), and, for a package that discovers its modules at import (``pkgutil.iter_modules``
    over its ``__path__``: the format registry), every module of its directory."""
    st = path.stat()
    _, imports, strings, discovers = _scan(path, st.st_mtime_ns, st.st_size)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set(strings)
    if discovers and path.name == "__init__.py":
        found.update(f"{name}.{p.stem}" for p in path.parent.glob("*.py") if p.name != "__init__.py")
        found.update(f"{name}.{p.parent.name}" for p in path.parent.glob("*/__init__.py"))
    for level, module, names in imports:
        if level:  # relative: from .x import y / from .. import y
            base = ".".join(package.split(".")[: len(package.split(".")) - level + 1])
            module = f"{base}.{module}" if module else base
        if not names:
            found.add(module)
            continue
        for n in names:  # ``from pkg import mod`` names the module; ``from mod import attr`` the module itself
            found.add(f"{module}.{n}" if _module_file(f"{module}.{n}", root) else module)
    return {m for m in found if not _excluded(m) and _module_file(m, root) is not None}


def code_modules(module: str, path: Path, root: Path = PACKAGE_ROOT) -> dict[str, Path]:
    """``module`` (source at ``path``) and every ``pipeline`` module it imports, transitively, parsed with ``ast``
    (nothing is imported), without :data:`CODE_EXCLUDED`."""
    seen = {module: path}
    todo = [module]
    while todo:
        name = todo.pop()
        for dep in _imports_of(name, seen[name], root):
            if dep not in seen:
                seen[dep] = _module_file(dep, root)  # type: ignore[assignment]
                todo.append(dep)
    return seen


def code_digest(module: str, path: Path, root: Path = PACKAGE_ROOT) -> str:
    """The digest of the source of ``module`` and of every package module it imports (:func:`code_modules`)."""
    mods = code_modules(module, path, root)
    srcs = []
    for name in sorted(mods):
        st = mods[name].stat()
        srcs.append((name, _scan(mods[name], st.st_mtime_ns, st.st_size)[0]))
    return store.digest(srcs)


def _code_digest(stage: Stage) -> str:
    """A stage's code: its module and the package modules it imports, transitively (plan must stay cheap: the source
    is hashed, never imported)."""
    name = stage.run.__module__
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        raise RuntimeError(f"stage {stage.name}: module {name} not found")
    return code_digest(name, Path(spec.origin))


def dump_result(result: Any) -> dict[str, Any]:
    """A stage's result as its manifest holds it: a pydantic model's JSON dump (``pipeline.results``); a plain
    dict (stages of tests) as it is."""
    if result is None:
        return {}
    return result.model_dump(mode="json") if hasattr(result, "model_dump") else result


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


def capacity_fields(cfg: DictConfig, st: Stage) -> tuple[str, ...]:
    """The fields of the resolved capacity plan stage ``st`` declares for ``cfg``."""
    return tuple(st.capacity(cfg) if callable(st.capacity) else st.capacity)


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
            "code": _code_digest(st),
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


def host_info() -> dict[str, Any]:
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count()}


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
    """``paths.root`` and the stage store can be created and written here; else one line naming the path."""
    import errno as _errno
    import tempfile

    paths = resolved_paths(cfg)
    for key in ("root", "store"):
        p = paths[key]
        try:
            p.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=p).close()
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
