"""NVFP4 weights and activations with AWQ-lite smoothing (ModelOpt ``NVFP4_AWQ_LITE_CFG``: NVFP4 W4A4 with
``algorithm: awq_lite``). ``NVFP4_AWQ_CLIP_CFG`` and ``NVFP4_AWQ_FULL_CFG`` quantize the same tensors with another
search and export the same ``quant_algo``; this format runs the lite search, as hf_ptq.py's ``nvfp4_awq`` does.

Export (``quant_algo`` ``NVFP4_AWQ``; ModelOpt 0.47 ``get_quantization_format`` returns ``nvfp4_awq`` for an NVFP4
layer whose input quantizer holds a ``_pre_quant_scale``): NVFP4's tensors plus ``pre_quant_scale`` where ModelOpt's
export could not fold it into the preceding layer (``fuse_prequant_to_linear``). The reference runtime multiplies the
input by ``pre_quant_scale``, then fake-quantizes it as NVFP4 with ``input_scale``.

Calibrates on a CUDA GPU only: the AWQ search runs ModelOpt's NVFP4 fake-quant kernel inside calibration ("amax must
be a CUDA tensor for dynamic block quantization" on CPU), before the CPU fallback can be installed
(tests/gpu/test_gpu_formats.py runs it).

TensorRT-LLM: ``QuantAlgo.NVFP4_AWQ`` exists on main only (served by the NVFP4 kernels, the AWQ scale applied to the
input); the 1.2 line's ``QuantAlgo`` has no such member, so its LLM-API loader refuses the checkpoint.
"""
from __future__ import annotations

from . import nvfp4
from ._base import AWQ_CALIB_FACTOR, BLACKWELL, FLOAT_DTYPES, SCALAR_F32, ExportLayout, QuantFormat, Tolerances

FORMAT = QuantFormat(
    name="nvfp4_awq", preset="NVFP4_AWQ_LITE_CFG", quant_algo="NVFP4_AWQ",
    weight_bytes=0.5 + 1 / nvfp4.NVFP4_BLOCK, sms=BLACKWELL, sm_needs="Blackwell (sm100/sm120)",
    runtimes=frozenset({"reference", "trtllm_llmapi"}), trtllm_lines=("main",),
    layout=ExportLayout(weight="U8", pack="in", required={"weight_scale": (("F8_E4M3",), "groups"),
                                                          "weight_scale_2": SCALAR_F32, "input_scale": SCALAR_F32},
                        optional={"pre_quant_scale": (FLOAT_DTYPES, "in")}, weight_bits=4, bf16_fraction_max=0.4),
    group_size=nvfp4.NVFP4_BLOCK, calibrates_from_sm=89, calibrates_on_cpu=False,
    calib_factor=AWQ_CALIB_FACTOR, calib_factor_reason="the AWQ search",
    precision="NVFP4 (block 16), AWQ-lite / NVFP4",
    tolerances=Tolerances(kl_max=0.5, top1_min=0.7, ppl_ratio_max=1.35, max_drop=0.08,
                          export_kl_abs=0.002, export_kl_frac=0.7, export_weight_ratio=0.4),
    dequantize=nvfp4.dequantize, quantize_input=nvfp4.quantize_input, cpu_fallback=nvfp4.use_cpu_fallback,
)
