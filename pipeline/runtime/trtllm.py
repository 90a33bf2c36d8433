"""TensorRT-LLM runtime adapters: the only place that touches ``tensorrt_llm``.

Two deployment paths (TensorRT-LLM's quantization and Triton-backend docs):

- ``trtllm_engine`` (TRT-LLM <= 1.2.x): TRT-LLM checkpoint -> ``trtllm-build`` -> ``rank{N}.engine`` -> Triton's
  ``tensorrtllm`` backend. Built in a child process (``python -m pipeline.runtime.trtllm_child``) so that GPU memory
  is freed, with a timing cache kept per (SM, TensorRT version).
- ``trtllm_llmapi`` (TRT-LLM >= 1.2, PyTorch backend): the unified HF checkpoint + LLM-API options (``LLM(...)``
  keyword arguments, also the Triton ``llmapi`` model's ``model.yaml``), checked by loading and generating.

Argument names follow TRT-LLM 1.2: ``trtllm-build`` flags (tensorrt_llm/commands/build.py, plugin flags from
tensorrt_llm/plugin/plugin.py), ``BuildConfig``/``PluginConfig`` fields (tensorrt_llm/builder.py, plugin.py) and
``TorchLlmArgs``/``KvCacheConfig``/``CudaGraphConfig`` (tensorrt_llm/llmapi/llm_args.py). Nothing here imports
``tensorrt_llm`` at module level: detection reads package metadata and looks for the backends' module files in the
installed package (``pipeline/upstream/runtimes.yaml`` names them), and the real calls run in the child process.
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from pipeline.formats import BY_ALGO, KV_FORMATS



@dataclass(frozen=True)
class TrtllmInfo:
    version: str | None
    tensorrt: str | None
    has_engine_backend: bool
    trtllm_build: str | None  # path of the trtllm-build console script
    has_llm_api: bool | None = None  # the LLM API on the PyTorch backend as tensorrt_llm.LLM; None: not looked for
    location: str | None = None  # the package directory probed; None: decided by the recorded versions


def _dist_version(*names: str) -> str | None:
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return None


def _package_dir() -> Path | None:
    """The installed ``tensorrt_llm`` package's directory, found without importing it (None: not installed)."""
    try:
        spec = importlib.util.find_spec("tensorrt_llm")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def _file_version(pkg: Path) -> str | None:
    """``__version__`` as ``tensorrt_llm/version.py`` assigns it, read as text."""
    f = pkg / "version.py"
    m = re.search(r"""__version__\s*=\s*['"]([^'"]+)['"]""", f.read_text()) if f.is_file() else None
    return m.group(1) if m else None


def detect() -> TrtllmInfo:
    """What TRT-LLM this environment has, without importing it (importing needs CUDA): its version (package
    metadata, else ``version.py``) and which backends it carries, from the module files ``runtimes.yaml`` names for
    each (the LLM API's PyTorch backend only where ``tensorrt_llm.LLM`` is that backend, from the recorded line on).
    Where the package directory cannot be found, the recorded versions decide."""
    from pipeline import upstream

    pkg = _package_dir()
    version = _dist_version("tensorrt_llm", "tensorrt-llm") or (_file_version(pkg) if pkg else None)
    tensorrt, build = _dist_version("tensorrt", "tensorrt-cu13", "tensorrt-cu12"), shutil.which("trtllm-build")
    if pkg is None:
        if version is None:
            return TrtllmInfo(None, tensorrt, False, build)
        return TrtllmInfo(version, tensorrt, upstream.engine_backend_in(version), build,
                          has_llm_api=upstream.llm_api_default_in(version))
    record = upstream.runtime_support()

    def carries(backend: str) -> bool:
        return all((pkg.parent / m).is_file() for m in record[backend]["modules"])

    llm_api = carries("llm_api_pytorch") and (version is None or upstream.llm_api_default_in(version))
    return TrtllmInfo(version or "unknown", tensorrt, carries("tensorrt_engine"), build, has_llm_api=llm_api,
                      location=str(pkg))


def require(runtime: str, expected_version: str | None, info: TrtllmInfo | None = None) -> TrtllmInfo:
    """Refuse clearly when the installed TRT-LLM cannot run ``runtime``."""
    info = info or detect()
    if info.version is None:
        raise UserError(f"runtime {runtime} needs TensorRT-LLM, which is not installed here (no wheels on PyPI); "
                        f"run in NVIDIA's TRT-LLM container (runtime.container) on a GPU of the target's SM, "
                        f"or use runtime=reference")
    if expected_version and info.version != expected_version:
        raise UserError(f"TensorRT-LLM {info.version} is installed but runtime.trtllm_version={expected_version} "
                        f"(the serving container's); engines only load in the exact version that built them")
    if runtime == "trtllm_engine" and not (info.has_engine_backend and info.trtllm_build):
        from pipeline import upstream

        last = upstream.runtime_support()["tensorrt_engine"]["last_line"]
        what = "no TensorRT-engine backend" if not info.has_engine_backend else "no trtllm-build on PATH"
        raise UserError(f"TensorRT-LLM {info.version} has {what} (the engine backend was removed after "
                        f"{last}.x); use runtime=trtllm_llmapi, or TRT-LLM {last}.x for engines")
    if runtime == "trtllm_llmapi" and info.has_llm_api is False:
        raise UserError(f"TensorRT-LLM {info.version} has no LLM API on the PyTorch backend as tensorrt_llm.LLM "
                        f"(pipeline/upstream/runtimes.yaml); use runtime=trtllm_engine, or a TensorRT-LLM with it")
    return info


def generation_problems(check: dict[str, Any], requested: int) -> list[str]:
    """The build's load-and-generate check, on its plain result (``completion``, ``tokens``): the runtime must
    generate exactly ``requested`` new tokens (the check asks for them with EOS ignored) and non-empty text."""
    problems = []
    tokens = check.get("tokens")
    if not isinstance(tokens, int) or tokens != requested:
        problems.append(f"generated {tokens} tokens, {requested} requested")
    text = check.get("completion")
    if not isinstance(text, str) or not text.strip():
        problems.append(f"generated no text (completion {text!r})")
    return problems


def _bool(v: bool) -> str:
    return "enable" if v else "disable"


def fp8_context_fmha(build: dict[str, Any], quant_algo: str | None, kv_algo: str | None) -> bool:
    """``use_fp8_context_fmha`` as trtllm-build ends up with it (``tensorrt_llm/builder.py`` ``build()``, "Logics to
    control paged_context_fmha and fp8_context_fmha"; ``pipeline/upstream/rules.yaml``): off outside the FP8, W4A8_AWQ
    and NVFP4 workflows; with paged context FMHA, on exactly when the KV cache is FP8; otherwise as asked."""
    if quant_algo not in BY_ALGO or not BY_ALGO[quant_algo].fp8_context_fmha:
        return False
    if build["use_paged_context_fmha"]:
        return kv_algo == "FP8"
    return bool(build["use_fp8_context_fmha"])


def plugin_config(build: dict[str, Any], quant_algo: str | None, kv_algo: str | None) -> dict[str, Any]:
    """``PluginConfig`` fields for the engine build (``kv_algo``: the checkpoint's ``kv_cache_quant_algo``)."""
    return {"gemm_plugin": build["gemm_plugin"],
            "use_paged_context_fmha": bool(build["use_paged_context_fmha"]),
            "use_fp8_context_fmha": fp8_context_fmha(build, quant_algo, kv_algo),
            "multiple_profiles": bool(build["multiple_profiles"])}


def build_config_kwargs(build: dict[str, Any], quant_algo: str | None, kv_algo: str | None,
                        timing_cache: str | None) -> dict[str, Any]:
    """``BuildConfig(...)`` keyword arguments (LLM-API engine path); ``plugin_config`` as a field dict."""
    kw = {"max_batch_size": build["max_batch_size"], "max_input_len": build["max_input_len"],
          "max_seq_len": build["max_seq_len"], "max_num_tokens": build["max_num_tokens"],
          "max_beam_width": build["max_beam_width"], "kv_cache_type": "paged",
          "use_strip_plan": bool(build["strip_plan"]), "plugin_config": plugin_config(build, quant_algo, kv_algo)}
    if timing_cache:
        kw["input_timing_cache"] = timing_cache
        kw["output_timing_cache"] = timing_cache
    return kw


def trtllm_build_args(build: dict[str, Any], quant_algo: str | None, kv_algo: str | None, checkpoint_dir: str,
                      output_dir: str, timing_cache: str | None) -> list[str]:
    """The ``trtllm-build`` command line for a TRT-LLM checkpoint."""
    plug = plugin_config(build, quant_algo, kv_algo)
    args = ["trtllm-build", "--checkpoint_dir", checkpoint_dir, "--output_dir", output_dir,
            "--max_batch_size", str(build["max_batch_size"]), "--max_input_len", str(build["max_input_len"]),
            "--max_seq_len", str(build["max_seq_len"]), "--max_num_tokens", str(build["max_num_tokens"]),
            "--max_beam_width", str(build["max_beam_width"]), "--kv_cache_type", "paged",
            "--gemm_plugin", plug["gemm_plugin"],
            "--use_paged_context_fmha", _bool(plug["use_paged_context_fmha"]),
            "--use_fp8_context_fmha", _bool(plug["use_fp8_context_fmha"]),
            "--multiple_profiles", _bool(plug["multiple_profiles"]),
            "--workers", str(build["workers"])]
    if timing_cache:
        args += ["--input_timing_cache", timing_cache, "--output_timing_cache", timing_cache]
    if build["strip_plan"]:
        args.append("--strip_plan")
    return args


def llmapi_options(build: dict[str, Any], kv_format: str, tp: int, pp: int, *, chunked_prefill: bool) -> dict[str, Any]:
    """``tensorrt_llm.LLM(**options)`` for the PyTorch backend; also the ``llmapi`` model.yaml (plus ``model``,
    ``backend`` and ``triton_config``). KV dtype "auto" takes the checkpoint's KV quantization.
    ``enable_chunked_prefill`` (``serve.enable_chunked_context``) is always written: the LLM API's default is off, and
    without it a prompt longer than ``max_num_tokens`` is refused ("should not exceed max_num_tokens",
    ``tensorrt_llm/llmapi/llm.py`` ``_check_arguments``)."""
    return {"tensor_parallel_size": tp, "pipeline_parallel_size": pp,
            "max_batch_size": build["max_batch_size"], "max_num_tokens": build["max_num_tokens"],
            "max_seq_len": build["max_seq_len"], "enable_chunked_prefill": bool(chunked_prefill),
            "kv_cache_config": {"free_gpu_memory_fraction": float(build["kv_cache_free_gpu_mem_fraction"]),
                                "dtype": KV_FORMATS[kv_format].llmapi_dtype, "enable_block_reuse": True},
            "cuda_graph_config": {"batch_sizes": sorted(b for b in build["cuda_graph_batch_sizes"]
                                                        if b <= build["max_batch_size"]) or [1],
                                  "enable_padding": True}}


# HF model_type -> the decoder type ModelOpt's TRT-LLM checkpoint export takes (modelopt/torch/export/model_utils.py
# MODEL_NAME_TO_TYPE, matched on the model class: Qwen3Moe* -> "qwen3moe", Qwen2*/Qwen3* -> "qwen", Mixtral/Mistral
# -> "llama")
DECODER_TYPES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen", "qwen3": "qwen",
                 "qwen3_moe": "qwen3moe"}
# Decoder types ModelOpt maps but its TRT-LLM checkpoint export refuses: build_moe_config (layer_utils.py) asserts
# decoder_type in ["llama", "dbrx", "phi3", "deepseek", "qwen"] for every MoE layer (a bare AssertionError), and
# hf_ptq.py exports such models as the unified HF checkpoint only (Model-Optimizer a2fbac7, 0.47.0dev).
NO_ENGINE_EXPORT = {"qwen3moe": "ModelOpt's TRT-LLM checkpoint export asserts that a MoE layer's decoder type is "
                                "llama, dbrx, phi3, deepseek or qwen (modelopt/torch/export/layer_utils.py "
                                "build_moe_config), and maps Qwen3-MoE to qwen3moe"}


def engine_export_problem(model_type: str | None) -> str | None:
    """Why ``runtime=trtllm_engine`` cannot be built for an HF ``model_type`` (its TRT-LLM checkpoint cannot be
    exported); None when it can, or when the type is not known yet (``None``/empty: read at fetch)."""
    if not model_type:
        return None
    decoder = DECODER_TYPES.get(model_type)
    if decoder is None:
        return (f"runtime trtllm_engine: no TRT-LLM checkpoint export for model_type={model_type!r} (supported: "
                f"{', '.join(sorted(k for k, v in DECODER_TYPES.items() if v not in NO_ENGINE_EXPORT))}); use "
                f"runtime=trtllm_llmapi (the unified HF checkpoint)")
    if decoder in NO_ENGINE_EXPORT:
        return (f"runtime trtllm_engine cannot serve model_type={model_type!r}: {NO_ENGINE_EXPORT[decoder]}; use "
                f"runtime=trtllm_llmapi (the unified HF checkpoint, as ModelOpt's hf_ptq.py exports it)")
    return None


def decoder_type(model_type: str) -> str:
    """ModelOpt ``export_tensorrt_llm_checkpoint`` decoder type for an HF ``model_type``; a :class:`UserError` for
    one whose checkpoint ModelOpt cannot export (:func:`engine_export_problem`)."""
    problem = engine_export_problem(model_type) if model_type else "runtime trtllm_engine: the model has no model_type"
    if problem:
        raise UserError(problem)
    return DECODER_TYPES[model_type]
