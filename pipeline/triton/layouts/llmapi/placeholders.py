"""The placeholder values of the ``llmapi`` templates and its ``1/model.yaml``. N instances
(``serve.llm_instance_count``) are one instance group with ``gpu_device_ids`` naming each instance's GPUs."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.triton.layouts import common
from pipeline.triton.layouts.record import ENGINE_REL

MAX_BATCH_SIZE = 0  # upstream model.yaml triton_config.max_batch_size: requests carry 1-D tensors
GUIDED_BACKEND = "xgrammar"  # model.yaml's guided_decoding_backend (an LLM argument: tensorrt_llm/llmapi/llm_args.py)


def gpu_device_ids(instances: int, world: int, gpus: int) -> str:
    """Upstream's llmapi multi-instance mapping: one comma-separated GPU list per instance, ``;`` between instances
    (instances share GPUs round-robin when there are fewer than ``instances * world``). Empty for one instance."""
    if instances <= 1:
        return ""
    pool = max(int(gpus or 0), world)
    return ";".join(",".join(str((i * world + r) % pool) for r in range(world)) for i in range(instances))


def values(cfg, engine_cfg: dict[str, Any], capacity) -> dict[str, dict[str, Any]]:
    """Every placeholder of every template (``capacity``: the resolved capacity plan; its ``world`` spreads the
    instances over the GPUs)."""
    sv = cfg.serve
    llmapi = {"llm_instance_count": sv.llm_instance_count,
              "gpu_device_ids": gpu_device_ids(sv.llm_instance_count, capacity.world, cfg.target.gpus_per_node)}
    return {"tensorrt_llm.llmapi": llmapi,
            "tensorrt_llm.llmapi_reference": {**llmapi, **common.reference_values(cfg, capacity)}}


def model_yaml(cfg, repo: Path, capacity) -> dict[str, Any]:
    """``1/model.yaml``: ``model`` (absolute under the container mount), the LLM-API options (the build's
    ``llmapi.json``; for the reference runtime, the options TensorRT-LLM would get), ``guided_decoding_backend`` and
    ``triton_config``."""
    from pipeline.runtime import trtllm

    options_file = repo / ENGINE_REL / "llmapi.json"
    if options_file.is_file():
        options = json.loads(options_file.read_text())
    else:
        options = trtllm.llmapi_options(common.build_values(cfg, capacity), cfg.quant.kv_cache.value,
                                        max(1, capacity.tp), capacity.pp,
                                        chunked_prefill=cfg.serve.enable_chunked_context)
    return {"model": common.engine_in_container(cfg), "backend": "pytorch", **options,
            # guided decoding (XGrammar) for the guides model.py builds GuidedDecodingParams from
            "guided_decoding_backend": GUIDED_BACKEND,
            "triton_config": {"max_batch_size": MAX_BATCH_SIZE, "decoupled": bool(cfg.serve.decoupled)}}


def files(cfg, repo: Path, capacity) -> dict[str, str]:
    """``tensorrt_llm/1/model.yaml``, written after the configs."""
    import yaml

    return {"tensorrt_llm/1/model.yaml": yaml.safe_dump(model_yaml(cfg, repo, capacity), sort_keys=False)}


def max_batch_size(cfg, capacity) -> int:
    return MAX_BATCH_SIZE
