"""FP8 (e4m3) per-tensor weights and activations, max calibration (ModelOpt ``FP8_DEFAULT_CFG``); and the FP8 KV
cache (``FP8_KV_CFG``).

Export (``quant_algo`` ``FP8``): ``weight`` float8_e4m3fn, ``weight_scale`` and ``input_scale`` fp32 (= amax / 448).
The reference runtime computes ``weight × weight_scale`` and fake-quantizes activations to e4m3 with the static
``input_scale``. KV cache (``kv_cache_quant_algo`` ``FP8``): ``k_proj.k_scale`` / ``v_proj.v_scale`` (= amax / 448);
keys and values are fake-quantized right before attention (after RoPE), where the KV cache stores them, with the
scales TensorRT-LLM applies (:func:`served_kv_scales`: 1.0 on the LLM API, whatever was calibrated).
"""
from __future__ import annotations

from ._base import (ALL_GPUS, ALL_RUNTIMES, BLACKWELL, SCALAR_F32, ExportLayout, KVFormat, QuantFormat, Tolerances,
                    e4m3_to_float, fake_fp8)


def dequantize(t, group_size=None):
    """``weight (float8_e4m3fn) × weight_scale``."""
    return e4m3_to_float(t["weight"]) * t["weight_scale"].float()


def round_as_exported(linears) -> int:
    """Store each FP8 layer's weight the way ModelOpt's export will (``unified_export_hf._export_quantized_weight``:
    scale = amax / 448, then ``quant_utils.to_quantized_weight``, which divides in the weight's dtype before the e4m3
    cast), dequantized back to the weight's dtype. The fake-quant forward then reproduces those values exactly
    (they lie on its grid), so the fake-quant model evaluated is the exported one. ``linears``: ModelOpt's quantized
    linear layers as (name, module). Returns the layers rounded."""
    import torch
    from modelopt.torch.export.model_config import QUANTIZATION_FP8
    from modelopt.torch.export.quant_utils import get_quantization_format, to_quantized_weight

    n = 0
    for _, mod in linears:
        if get_quantization_format(mod) != QUANTIZATION_FP8:
            continue
        wq = mod.weight_quantizer
        amax = wq._amax.float()  # the export's arithmetic, to the bit
        scale = torch.tensor(amax.item() / wq.maxbound) if amax.dim() == 1 else (amax / wq.maxbound).clone()
        with torch.no_grad():
            codes = to_quantized_weight(mod.weight.data, scale.to(mod.weight.device), QUANTIZATION_FP8)
            mod.weight.data.copy_((codes.float() * scale.to(mod.weight.device)).to(mod.weight.dtype))
        n += 1
    return n


FORMAT = QuantFormat(
    name="fp8", preset="FP8_DEFAULT_CFG", quant_algo="FP8", weight_bytes=1.0,
    sms=(89, 90, *BLACKWELL), sm_needs="Ada, Hopper or Blackwell (sm89+)", runtimes=ALL_RUNTIMES,
    layout=ExportLayout(weight="F8_E4M3", required={"weight_scale": SCALAR_F32, "input_scale": SCALAR_F32}),
    fp8_context_fmha=True, preference=0,
    precision="FP8 per-tensor / FP8 per-tensor (static)",
    tolerances=Tolerances(
        kl_max=0.1, top1_min=0.85, ppl_ratio_max=1.05, max_drop=0.05,
        # Export proof bounds (benchmarks/export_proof_bounds.py): the reloaded export's KL from the fake-quant model
        # within 0.002 + 0.7 × the quantization's own KL, which the unquantized weights exceed. Measured: 0 on
        # tiny-qwen3 (CPU), 0.57 × on SmolLM2-135M (CPU; a few layers' exported weights still differ from the rounded
        # fake-quant ones, by up to 0.09 × their quantization error), 0.33 × on a synthetic Qwen3-4B shape (H200).
        export_kl_abs=0.002, export_kl_frac=0.7, export_weight_ratio=0.25),
    dequantize=dequantize, quantize_input=fake_fp8, round_as_exported=round_as_exported,
)


def served_kv_scales(k, v, runtime: str) -> tuple[float, float]:
    """The FP8 KV-cache scales TensorRT-LLM applies, from the exported ``k_scale`` / ``v_scale`` (None: absent).

    - LLM API (PyTorch backend, ``trtllm_llmapi``; also what the ``reference`` runtime serves with): 1.0 for both,
      whatever the checkpoint holds. ``TrtllmAttention`` keeps ``kv_cache_scaling_factor`` at ones
      (NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/attention_backend/trtllm.py`` @ 00bede1), and
      ``modules/attention.py`` hands the checkpoint's ``kv_scales`` to the kernel for an FP4 KV cache only
      (``has_fp4_kv_cache``); the fused-QKV loader reads ``k_scale`` / ``v_scale`` into ``kv_scales`` and nothing
      else (``tensorrt_llm/_torch/modules/linear.py`` @ 00bbf71).
    - Engine (``trtllm_engine``): ModelOpt's TRT-LLM checkpoint export writes one ``kv_cache_scaling_factor`` per
      layer, ``max(k, v)`` with each clamped to at least 1.0 (ModelOpt 0.47 ``export/quant_utils.py``
      ``get_kv_cache_scaling_factor(clamp_fp8_scales=True)``, ``export/model_config_utils.py``), used for K and V.

    The quantize stage's accuracy gate reloads the export with the reference runtime's rule (the LLM API's), which
    is never the more forgiving one: the two agree while every calibrated amax is within 448, and past it the LLM
    API saturates where an engine scales.
    """
    if runtime == "trtllm_engine":
        s = max(1.0, float(k) if k is not None else 1.0, float(v) if v is not None else 1.0)
        return s, s
    return 1.0, 1.0


KV_FORMAT = KVFormat(
    name="fp8", preset="FP8_KV_CFG", quant_algo="FP8", bytes=1.0,
    sms=ALL_GPUS, sm_needs="an Ampere or newer GPU (sm80+)", runtimes=ALL_RUNTIMES, llmapi_dtype="fp8",
    quantize_kv=fake_fp8, idempotent=True, served_scales=served_kv_scales,
)
