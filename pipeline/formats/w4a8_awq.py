"""INT4 weights (AWQ, group 128) with FP8 activations (ModelOpt ``W4A8_AWQ_BETA_CFG``).

Export (``quant_algo`` ``W4A8_AWQ``): INT4 AWQ weights (as ``int4_awq``), then a second, FP8 per-tensor weight
quantizer (``weight_scale_2``); FP8 activations with ``input_scale``, after ``pre_quant_scale``.
"""
from __future__ import annotations

from ._base import (ALL_RUNTIMES, AWQ_CALIB_FACTOR, AWQ_GROUP, AWQ_WEIGHT_BYTES, SCALAR_F32, QuantFormat, Tolerances,
                    awq_layout, dequantize_int4_groups, fake_fp8)


def dequantize(t, group_size=None):
    """The INT4 AWQ weight, then the second (FP8 per-tensor, ``weight_scale_2``) weight quantizer."""
    return fake_fp8(dequantize_int4_groups(t, group_size), t["weight_scale_2"]).float()


FORMAT = QuantFormat(
    name="w4a8_awq", preset="W4A8_AWQ_BETA_CFG", quant_algo="W4A8_AWQ", weight_bytes=AWQ_WEIGHT_BYTES,
    sms=(89, 90), sm_needs="Ada or Hopper (sm89/sm90)", runtimes=ALL_RUNTIMES,
    layout=awq_layout(weight_scale_2=SCALAR_F32, input_scale=SCALAR_F32),
    awq=True, group_size=AWQ_GROUP, fp8_context_fmha=True, preference=3,
    calib_factor=AWQ_CALIB_FACTOR, calib_factor_reason="the AWQ search",
    precision="INT4 AWQ, group 128 / FP8 per-tensor",
    tolerances=Tolerances(kl_max=0.5, top1_min=0.7, ppl_ratio_max=1.35, max_drop=0.08),
    dequantize=dequantize, quantize_input=fake_fp8,
)
