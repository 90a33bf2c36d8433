"""NVFP4 weights (e2m1, an e4m3 scale per 16 values, an fp32 global scale) with 16-bit activations (ModelOpt
``W4A16_NVFP4_CFG``, max calibration).

Export (``quant_algo`` ``W4A16_NVFP4``; ModelOpt 0.47 ``get_quantization_format`` returns ``w4a16_nvfp4`` for an
NVFP4 weight quantizer whose input quantizer is disabled): NVFP4's ``weight`` / ``weight_scale`` /
``weight_scale_2``, no ``input_scale``. The reference runtime dequantizes as ``nvfp4`` does and leaves activations
unquantized.

TensorRT-LLM: ``QuantAlgo.W4A16_NVFP4`` and ``W4A16NVFP4LinearMethod`` exist on main only; the 1.2 line's
``QuantAlgo`` has no such member, so its LLM-API loader (``QuantAlgo(quant_algo)``) refuses the checkpoint.
"""
from __future__ import annotations

from . import nvfp4
from ._base import BLACKWELL, SCALAR_F32, ExportLayout, QuantFormat, Tolerances

FORMAT = QuantFormat(
    name="w4a16_nvfp4", preset="W4A16_NVFP4_CFG", quant_algo="W4A16_NVFP4",
    weight_bytes=0.5 + 1 / nvfp4.NVFP4_BLOCK, sms=BLACKWELL, sm_needs="Blackwell (sm100/sm120)",
    runtimes=frozenset({"reference", "trtllm_llmapi"}), trtllm_lines=("main",),
    layout=ExportLayout(weight="U8", pack="in", required={"weight_scale": (("F8_E4M3",), "groups"),
                                                          "weight_scale_2": SCALAR_F32},
                        weight_bits=4, bf16_fraction_max=0.4),
    group_size=nvfp4.NVFP4_BLOCK, calibrates_from_sm=89,
    precision="NVFP4 (block 16) / bf16",
    tolerances=Tolerances(kl_max=0.5, top1_min=0.7, ppl_ratio_max=1.35, max_drop=0.08,
                          export_kl_abs=0.002, export_kl_frac=0.7, export_weight_ratio=0.4),
    dequantize=nvfp4.dequantize, cpu_fallback=nvfp4.use_cpu_fallback,
)
