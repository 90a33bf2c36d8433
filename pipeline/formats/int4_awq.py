"""INT4 weights with 16-bit activations (W4A16), AWQ-lite search, group size 128 (ModelOpt ``INT4_AWQ_CFG``).

Export (``quant_algo`` ``W4A16_AWQ``): two signed int4 per uint8 (low nibble = even output row), ``weight_scale`` per
block of ``group_size`` input channels, ``pre_quant_scale`` where it is not folded into the preceding norm. The
reference runtime multiplies the input by ``pre_quant_scale`` (AWQ smoothing); activations stay unquantized.
"""
from __future__ import annotations

from ._base import (ALL_RUNTIMES, AWQ_CALIB_FACTOR, AWQ_GROUP, AWQ_WEIGHT_BYTES, QuantFormat, Tolerances, awq_layout,
                    dequantize_int4_groups)

FORMAT = QuantFormat(
    name="int4_awq", preset="INT4_AWQ_CFG", quant_algo="W4A16_AWQ", weight_bytes=AWQ_WEIGHT_BYTES,
    sms=(80, 86, 89, 90), sm_needs="Ampere, Ada or Hopper (sm80-sm90; not in the support matrix for Blackwell)",
    runtimes=ALL_RUNTIMES,
    layout=awq_layout(),
    awq=True, group_size=AWQ_GROUP, preference=1,
    trtllm_refusals=frozenset({"no_int_quant_on_sm100"}),
    calib_factor=AWQ_CALIB_FACTOR, calib_factor_reason="the AWQ search",
    precision="INT4 AWQ, group 128 / bf16",
    tolerances=Tolerances(kl_max=0.5, top1_min=0.7, ppl_ratio_max=1.35, max_drop=0.08),
    dequantize=dequantize_int4_groups,
)
