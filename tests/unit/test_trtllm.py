"""The TRT-LLM adapters' version checks and generated arguments, against the upstream names."""
from __future__ import annotations

import pytest

from pipeline import config, hardware
from pipeline.errors import UserError
from pipeline import upstream
from pipeline.runtime import trtllm


def test_trtllm_version_and_engine_backend_checks():
    new = trtllm.TrtllmInfo("1.3.0", "10.13", has_engine_backend=False, trtllm_build=None)
    with pytest.raises(UserError, match="has no TensorRT-engine backend"):
        trtllm.require("trtllm_engine", None, new)
    assert trtllm.require("trtllm_llmapi", None, new) is new
    with pytest.raises(UserError, match="runtime.trtllm_version=1.2.1"):
        trtllm.require("trtllm_llmapi", "1.2.1", new)
    assert trtllm.detect().version is None  # not installable here; the adapters say so


# Upstream names (TensorRT-LLM 1.2: tensorrt_llm/commands/build.py + plugin/plugin.py for trtllm-build flags;
# builder.py BuildConfig and plugin.py PluginConfig fields; llmapi/llm_args.py for the LLM API).
TRTLLM_BUILD_FLAGS = {"--checkpoint_dir", "--output_dir", "--max_batch_size", "--max_input_len", "--max_seq_len",
                      "--max_num_tokens", "--max_beam_width", "--kv_cache_type", "--gemm_plugin",
                      "--use_paged_context_fmha", "--use_fp8_context_fmha", "--multiple_profiles", "--workers",
                      "--input_timing_cache", "--output_timing_cache", "--strip_plan"}
BUILD_CONFIG_FIELDS = {"max_input_len", "max_seq_len", "max_batch_size", "max_beam_width", "max_num_tokens",
                       "opt_num_tokens", "kv_cache_type", "input_timing_cache", "output_timing_cache",
                       "plugin_config", "use_strip_plan"}
PLUGIN_FIELDS = {"gemm_plugin", "use_fp8_context_fmha", "use_paged_context_fmha", "multiple_profiles"}
# the LLM API's arguments as recorded per TensorRT-LLM line (pipeline/upstream/trtllm-*.yaml build.llm_args, which
# `python -m pipeline.upstream.refresh` holds to TorchLlmArgs where TensorRT-LLM is installed)
LLM_ARGS = set.intersection(*(set(upstream.record(line)["build"]["llm_args"]) for line in upstream.lines()))
KV_CACHE_CONFIG = {"free_gpu_memory_fraction", "dtype", "enable_block_reuse", "max_tokens"}
CUDA_GRAPH_CONFIG = {"batch_sizes", "max_batch_size", "enable_padding"}


def _build(*extra):
    """The build settings the renderers get: the config's, with the serving plan's derived sizes."""
    from pipeline import serving_plan

    cfg = hardware.compose(["model=qwen32b", "target=h100", "runtime=trtllm_engine", *extra])
    return serving_plan.build_settings(config.to_plain(cfg.build), serving_plan.resolve(cfg).settings)


def test_trtllm_build_args_use_upstream_flags():
    args = trtllm.trtllm_build_args(_build(), "FP8", "FP8", "/ckpt", "/out", "/cache/sm90.cache")
    flags = {a for a in args if a.startswith("--")}
    assert flags <= TRTLLM_BUILD_FLAGS
    assert args[args.index("--use_fp8_context_fmha") + 1] == "enable"
    assert args[args.index("--input_timing_cache") + 1] == "/cache/sm90.cache"
    awq = trtllm.trtllm_build_args(_build(), "W4A16_AWQ", "FP8", "/c", "/o", None)
    assert awq[awq.index("--use_fp8_context_fmha") + 1] == "disable"  # FP8 context FMHA: FP8/W4A8/NVFP4 only
    assert "--input_timing_cache" not in awq
    bc = trtllm.build_config_kwargs(_build(), "NVFP4", "FP8", "/t.cache")
    assert set(bc) <= BUILD_CONFIG_FIELDS and set(bc["plugin_config"]) <= PLUGIN_FIELDS
    # sized for the H100 by the serving plan, not the CPU smoke's 8
    assert bc["max_batch_size"] == _build()["max_batch_size"] > 8 and bc["kv_cache_type"] == "paged"


def test_llmapi_options_use_upstream_names():
    opts = trtllm.llmapi_options(_build("build.max_batch_size=16"), "fp8", tp=2, pp=1, chunked_prefill=True)
    assert set(opts) <= LLM_ARGS and opts["enable_chunked_prefill"] is True
    assert set(opts["kv_cache_config"]) <= KV_CACHE_CONFIG and set(opts["cuda_graph_config"]) <= CUDA_GRAPH_CONFIG
    assert opts["kv_cache_config"]["dtype"] == "fp8" and opts["tensor_parallel_size"] == 2
    assert max(opts["cuda_graph_config"]["batch_sizes"]) <= 16


# tensorrt_llm/builder.py build(), "Logics to control paged_context_fmha and fp8_context_fmha" (commit 008b2b8), on
# sm89+ with context FMHA on: (quant_algo, kv algo, use_paged_context_fmha, use_fp8_context_fmha asked) -> what the
# builder leaves in use_fp8_context_fmha
BUILDER_FP8_CONTEXT_FMHA = [
    ("FP8", "FP8", True, True, True), ("FP8", "FP8", True, False, True),  # "enabled to support FP8 Paged ..."
    ("FP8", None, True, True, False),  # "must be used together with fp8 KV Cache"
    ("NVFP4", None, True, True, False), ("W4A8_AWQ", None, True, True, False), ("NVFP4", "NVFP4", True, True, False),
    ("FP8", None, False, True, True), ("FP8", None, False, False, False),  # no paged context FMHA: as asked
    ("W4A16_AWQ", "FP8", True, True, False), ("W8A8_SQ_PER_CHANNEL", None, False, True, False), (None, None, True, True,
                                                                                               False),
]


@pytest.mark.parametrize("algo, kv, paged, asked, expected", BUILDER_FP8_CONTEXT_FMHA)
def test_fp8_context_fmha_is_rendered_as_the_builder_leaves_it(algo, kv, paged, asked, expected):
    build = {**_build(), "use_paged_context_fmha": paged, "use_fp8_context_fmha": asked}
    assert trtllm.fp8_context_fmha(build, algo, kv) is expected
    args = trtllm.trtllm_build_args(build, algo, kv, "/c", "/o", None)
    assert args[args.index("--use_fp8_context_fmha") + 1] == ("enable" if expected else "disable")


def test_the_kv_cache_decides_fp8_context_fmha_where_the_builder_says_so():
    """Negative control: the rendering that ignored the KV cache (the workflow alone decided) disagrees with the
    builder's table on FP8 weights without an FP8 KV cache."""
    def workflow_only(build, algo, kv):
        return bool(build["use_fp8_context_fmha"]) and algo in ("FP8", "W4A8_AWQ", "NVFP4")

    assert any(workflow_only({"use_paged_context_fmha": p, "use_fp8_context_fmha": a}, algo, kv) is not want
               for algo, kv, p, a, want in BUILDER_FP8_CONTEXT_FMHA)
