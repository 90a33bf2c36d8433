"""Placeholder values that more than one layout renders: the batch size, the engine's path in the serving container
and the parameters of the reference runtime's python models (``pipeline/runtime/reference.py`` is shared by every
layout that serves the ``reference`` runtime)."""
from __future__ import annotations

from typing import Any

from pipeline.triton.layouts.record import ENGINE_REL


def batch_size(cfg, engine_cfg: dict[str, Any]) -> int:
    """``build.max_batch_size``, lowered to the engine's own where the build record has one."""
    engine_bs = (engine_cfg.get("build_config") or {}).get("max_batch_size")
    return min(int(cfg.build.max_batch_size), int(engine_bs)) if engine_bs else int(cfg.build.max_batch_size)


def engine_in_container(cfg) -> str:
    """The engine (or checkpoint) directory, absolute under ``serve.repo_mount``, where the serving container mounts
    the repository."""
    return f"{cfg.serve.repo_mount.rstrip('/')}/{ENGINE_REL}"


def reference_values(cfg) -> dict[str, Any]:
    """The reference runtime's python-model parameters: its checkpoint (relative to the repository root), dtype,
    device, torch threads and sequence length."""
    device = "cuda" if cfg.target.device.value == "cuda" else "cpu"
    return {"checkpoint_dir": ENGINE_REL, "dtype": cfg.runtime.dtype.value, "device": device,
            "torch_threads": cfg.serve.torch_threads, "max_seq_len": cfg.build.max_seq_len}
