"""INT8 SmoothQuant: per-channel int8 weights, per-tensor int8 activations (ModelOpt ``INT8_SMOOTHQUANT_CFG``); served
on the TensorRT-LLM engine path.

Export (``quant_algo`` ``W8A8_SQ_PER_CHANNEL``): int8 ``weight`` × per-output-channel ``weight_scale``; the reference
runtime multiplies the input by ``pre_quant_scale``, then int8 per-tensor fake-quantizes it with ``input_scale``
(= amax / 127).
"""
from __future__ import annotations

from ._base import FLOAT_DTYPES, SCALAR_F32, ExportLayout, QuantFormat, Tolerances


def dequantize(t, group_size=None):
    """int8 × the per-output-channel ``weight_scale``."""
    return t["weight"].float() * t["weight_scale"].float()[:, None]


def fake_int8(x, scale):
    """Symmetric per-tensor int8 quantize-dequantize, narrow range [-127, 127], scale = amax / 127."""
    import torch

    s = scale.float()
    return (torch.clamp(torch.round(x.float() / s), -127, 127) * s).to(x.dtype)


FORMAT = QuantFormat(
    name="int8_sq", preset="INT8_SMOOTHQUANT_CFG", quant_algo="W8A8_SQ_PER_CHANNEL", weight_bytes=1.0,
    sms=(80, 86, 89, 90), sm_needs="Ampere, Ada or Hopper (sm80-sm90)",
    runtimes=frozenset({"reference", "trtllm_engine"}),
    layout=ExportLayout(weight="I8", required={"weight_scale": (FLOAT_DTYPES, "out"), "input_scale": SCALAR_F32,
                                               "pre_quant_scale": (FLOAT_DTYPES, "in")}),
    preference=4,
    trtllm_refusals=frozenset({"no_int_quant_on_sm100"}),
    precision="INT8 per-channel / INT8 per-tensor (SmoothQuant)",
    tolerances=Tolerances(kl_max=0.15, top1_min=0.8, ppl_ratio_max=1.1, max_drop=0.05),
    dequantize=dequantize, quantize_input=fake_int8,
)
