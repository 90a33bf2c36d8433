"""The toy's one template: the reference runtime's parameters and the transaction policy."""
from __future__ import annotations

from typing import Any

from pipeline.triton.layouts import common


def values(cfg, engine_cfg: dict[str, Any], capacity) -> dict[str, dict[str, Any]]:
    return {"tensorrt_llm.toy": {**common.reference_values(cfg), "decoupled": cfg.serve.decoupled}}


def max_batch_size(cfg, capacity) -> int:
    return 0  # requests carry 1-D tensors
