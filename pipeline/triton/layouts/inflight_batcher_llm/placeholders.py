"""The placeholder values of the ``inflight_batcher_llm`` templates, from the config, the build record and the
resolved capacity plan. Where one of TensorRT-LLM's rules changes a setting by itself (``pipeline/upstream/
rules.yaml``, action ``adjust``), the value upstream would use is rendered."""
from __future__ import annotations

from typing import Any

from pipeline.triton.layouts import common
from pipeline.triton.layouts.record import LLM_MODEL

GUIDED_BACKEND = "xgrammar"  # the one guided_decoding_backend the C++ backend takes (pipeline/upstream guided_decoding)
TOKENIZER_INFO = f"{LLM_MODEL}/1/xgrammar_tokenizer_info.json"  # repository-relative


def values(cfg, engine_cfg: dict[str, Any], capacity) -> dict[str, dict[str, Any]]:
    """Every placeholder of every template (``capacity``: the ``tp``, ``pp``, ``world``, ``kv_tokens`` and
    ``settings`` of a ``serving_plan.ServingPlan``)."""
    from pipeline.upstream import rules

    b, sv = cfg.build, cfg.serve
    built = common.build_values(cfg, capacity)  # the serving plan's sizes (pipeline/serving_plan.py)
    bs = common.batch_size(cfg, engine_cfg, capacity)
    kv_tokens = capacity.kv_tokens
    in_container = common.engine_in_container(cfg)
    base = {"triton_max_batch_size": bs}
    queue = {"max_queue_delay_microseconds": sv.max_queue_delay_microseconds, "max_queue_size": sv.max_queue_size}
    llm = {**base, **queue, "decoupled_mode": sv.decoupled, "max_beam_width": b.max_beam_width,
           "batching_strategy": "inflight_fused_batching", "engine_dir": in_container,
           "encoder_input_features_data_type": "TYPE_FP16", "logits_datatype": "TYPE_FP32",
           # 0 (no capacity plan) is refused by the backend's KvCacheConfig; empty leaves the pool to the fraction
           "max_tokens_in_paged_kv_cache": kv_tokens if kv_tokens > 0 else "",
           "batch_scheduler_policy": "guaranteed_no_evict",
           "kv_cache_free_gpu_mem_fraction": built["kv_cache_free_gpu_mem_fraction"],
           "exclude_input_in_output": True,
           "enable_kv_cache_reuse": rules.rendered_kv_cache_reuse(cfg.runtime.name.value, b.use_paged_context_fmha,
                                                                  sv.enable_kv_cache_reuse),
           "enable_chunked_context": sv.enable_chunked_context, "tokenizer_dir": in_container,
           # guided decoding (XGrammar), as tensorrtllm_backend docs/guided_decoding.md sets it up for the C++
           # backend: the backend and the tokenizer info file written by files() below
           "guided_decoding_backend": GUIDED_BACKEND,
           "xgrammar_tokenizer_info_path": f"{cfg.serve.repo_mount.rstrip('/')}/{TOKENIZER_INFO}"}
    return {
        "ensemble": {**base, "logits_datatype": "TYPE_FP32"},
        "preprocessing": {**base, **queue, "tokenizer_dir": in_container, "engine_dir": in_container,
                          "add_special_tokens": True,  # upstream renders none: its model defaults to true
                          "max_input_len": built["max_input_len"],
                          "preprocessing_instance_count": sv.preprocessing_instance_count},
        "postprocessing": {**base, "tokenizer_dir": in_container, "skip_special_tokens": True,
                           "postprocessing_instance_count": sv.postprocessing_instance_count},
        "tensorrt_llm_bls": {**base, "decoupled_mode": sv.decoupled, "accumulate_tokens": False,
                             "bls_instance_count": sv.bls_instance_count, "logits_datatype": "TYPE_FP32"},
        "tensorrt_llm.engine": {**llm, "triton_backend": "tensorrtllm"},
        "tensorrt_llm.reference": {**llm, "triton_backend": "python", **common.reference_values(cfg, capacity)},
    }


def files(cfg, repo, capacity) -> dict[str, str]:
    """``tensorrt_llm/1/xgrammar_tokenizer_info.json``: the tokenizer's vocabulary, as NVIDIA's
    ``examples/generate_xgrammar_tokenizer_info.py`` writes it for the C++ backend's ``xgrammar_tokenizer_info_path``
    (``pipeline.runtime.guided.tokenizer_info_doc``); the reference runtime reads it too. Made from the build
    output's tokenizer: a repository rendered before its build (``python -m pipeline render``) has none yet, and the
    package stage's lint refuses a repository without it."""
    import json

    from transformers import AutoTokenizer

    from pipeline.runtime import guided
    from pipeline.triton.layouts.record import ENGINE_REL

    if not (repo / ENGINE_REL).is_dir():
        return {}
    tokenizer = AutoTokenizer.from_pretrained(str(repo / ENGINE_REL))
    return {TOKENIZER_INFO: json.dumps(guided.tokenizer_info_doc(tokenizer))}


def max_batch_size(cfg, capacity) -> int:
    """The batch size the package result records: the ensemble's (the config's; the engine's own, known after the
    build, can only lower what is rendered)."""
    return values(cfg, {}, capacity)["ensemble"]["triton_max_batch_size"]
