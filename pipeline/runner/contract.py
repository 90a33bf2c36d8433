"""The stage contract: what a stage is (:class:`Stage`), what it is given when it runs (:class:`Context`, with the
config it declared as a read-only view, :func:`stage_config`), and what the stages of one build run share
(:class:`Shared`). Stage modules import this module, never the executor (``pipeline.runner.executor``) or the
fingerprinting (``pipeline.runner.fingerprint``); the run's server leases are in ``pipeline.runner.leases``.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.metadata as md
import os
import platform
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from pipeline import planning, results, store


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline, and its lifecycle:

    1. ``check(cfg)``, at plan time, for every selected stage: incompatibilities of the config (quant x GPU, block
       sizes); no work, no download. Any problem refuses the whole build before anything is written. Then
       ``capacity_check(cfg, plan)``, once the capacity plan is resolved: problems of what ``run`` will render from it.
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
    # at plan time, once the capacity plan is resolved (with the performance model where it runs): problems of what
    # ``run`` will render from it, (full config, the plan) -> one line each (the build: the upstream rules on the sizes
    # the service profile chose; ``check`` holds them for the KV rule's sizes, the ones validate and sweeps see)
    capacity_check: Callable[[DictConfig, Any], list[str]] | None = None


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


def lib_versions(names: tuple[str, ...] | list[str]) -> dict[str, str]:
    out = {}
    for n in names:
        try:
            out[n] = md.version(n)
        except md.PackageNotFoundError:
            out[n] = "absent"
    return out


def host_info() -> dict[str, Any]:
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count()}
