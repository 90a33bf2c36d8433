"""FP8 (e4m3) weights with one scale per output channel and FP8 activations scaled per token at run time (ModelOpt
``FP8_PER_CHANNEL_PER_TOKEN_CFG``: ``*weight_quantizer`` axis 0, ``*input_quantizer`` dynamic, max calibration).

Export (``quant_algo`` ``FP8_PER_CHANNEL_PER_TOKEN``; ModelOpt 0.47 ``quant_utils.get_quantization_format`` returns
``fp8_pc_pt`` for an e4m3 weight quantizer with ``axis == 0``, ``process_layer_quant_config`` names it): ``weight``
float8_e4m3fn, ``weight_scale`` fp32 with one value per output channel (= the channel's amax / 448). No
``input_scale``: activations are quantized per token from their own amax, at run time. The reference runtime computes
``weight × weight_scale`` per row and leaves activations unquantized (it has no per-token activation hook), so its
accuracy gate sees the weight error only.

TensorRT-LLM: ``QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN`` maps to ``QuantMode`` FP8 rowwise
(``tensorrt_llm/quantization/mode.py`` ``from_quant_algo``), which the PyTorch backend serves with
``FP8RowwiseLinearMethod`` (``tensorrt_llm/_torch/modules/linear.py`` ``get_quant_method``), on the 1.2 line and on
main. The engine path builds FP8 rowwise from its own ``convert_checkpoint`` flow, not from a ModelOpt checkpoint; this
project does not offer it there.
"""
from __future__ import annotations

from ._base import BLACKWELL, ExportLayout, QuantFormat, Tolerances, e4m3_to_float


def dequantize(t, group_size=None):
    """``weight (float8_e4m3fn) × weight_scale`` (one per output row)."""
    w = e4m3_to_float(t["weight"])
    return w * t["weight_scale"].float().reshape(w.shape[0], 1)


FORMAT = QuantFormat(
    name="fp8_per_channel_per_token", preset="FP8_PER_CHANNEL_PER_TOKEN_CFG", quant_algo="FP8_PER_CHANNEL_PER_TOKEN",
    weight_bytes=1.0, sms=(89, 90, *BLACKWELL), sm_needs="Ada, Hopper or Blackwell (sm89+)",
    runtimes=frozenset({"reference", "trtllm_llmapi"}),
    layout=ExportLayout(weight="F8_E4M3", required={"weight_scale": (("F32",), "out")}),
    precision="FP8 per-channel / FP8 per-token (dynamic)",
    tolerances=Tolerances(kl_max=0.1, top1_min=0.85, ppl_ratio_max=1.05, max_drop=0.05,
                          export_kl_abs=0.002, export_kl_frac=0.7, export_weight_ratio=0.25),
    dequantize=dequantize,
)
