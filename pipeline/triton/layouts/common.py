"""Placeholder values that more than one layout renders: the batch size, the engine's path in the serving container
and the parameters of the reference runtime's python models (``pipeline/runtime/reference.py`` is shared by every
layout that serves the ``reference`` runtime)."""
from __future__ import annotations

from typing import Any

from pipeline.triton.layouts.record import ENGINE_REL


def build_values(cfg, capacity=None) -> dict[str, Any]:
    """The ``build`` settings every template renders: the config's, with the serving plan's derived sizes in place of
    its 0s (``capacity.settings``; resolved from ``cfg`` where the capacity carries none)."""
    from pipeline import serving_plan
    from pipeline.config import to_plain

    try:
        settings = capacity.settings if capacity is not None else None
    except AttributeError:
        settings = None
    if settings is None:
        settings = serving_plan.resolve(cfg).settings
    return serving_plan.build_settings(to_plain(cfg.build), settings)


def batch_size(cfg, engine_cfg: dict[str, Any], capacity=None) -> int:
    """The serving plan's ``max_batch_size``, lowered to the engine's own where the build record has one."""
    bs = int(build_values(cfg, capacity)["max_batch_size"])
    engine_bs = (engine_cfg.get("build_config") or {}).get("max_batch_size")
    return min(bs, int(engine_bs)) if engine_bs else bs


def engine_in_container(cfg) -> str:
    """The engine (or checkpoint) directory, absolute under ``serve.repo_mount``, where the serving container mounts
    the repository."""
    return f"{cfg.serve.repo_mount.rstrip('/')}/{ENGINE_REL}"


def reference_values(cfg, capacity=None) -> dict[str, Any]:
    """The reference runtime's python-model parameters: its checkpoint (relative to the repository root), dtype,
    device, torch threads and sequence length."""
    device = "cuda" if cfg.target.device.value == "cuda" else "cpu"
    return {"checkpoint_dir": ENGINE_REL, "dtype": cfg.runtime.dtype.value, "device": device,
            "torch_threads": cfg.serve.torch_threads, "max_seq_len": build_values(cfg, capacity)["max_seq_len"]}
