"""MXFP8: e4m3 weights and activations with a power-of-two (E8M0) scale per block of 32 values, computed from the data
(ModelOpt ``MXFP8_DEFAULT_CFG``: dynamic ``mxfp8`` weight and input quantizers, no calibration algorithm).

Export (``quant_algo`` ``MXFP8``, ``group_size`` 32; ModelOpt 0.47 ``get_quantization_format`` returns ``mxfp8`` for a
dynamic e4m3 block quantizer with ``scale_bits`` (8, 0)): ``weight`` float8_e4m3fn, ``weight_scale`` uint8 holding
the biased exponent (bias 127) of each block of 32 inputs (``MXFP8QTensor.get_weights_scaling_factor``); no
``input_scale``, as activations are scaled per block at run time. The reference runtime computes
``weight × 2^(weight_scale - 127)`` and leaves activations unquantized (it has no dynamic block-activation hook).

:func:`use_cpu_fallback` routes ModelOpt's MXFP8 fake quant, a CUDA extension (``modelopt_cuda_ext_mx``), through
ModelOpt's own pure-torch ``MXFP8QTensor`` on CPU; tests/gpu/test_gpu.py checks the CUDA kernel's export.

TensorRT-LLM: ``QuantAlgo.MXFP8`` exists on main only (``tensorrt_llm/_torch/model_config.py`` @ 1a0dc5f7 builds it
for MXFP8 checkpoints); the 1.2 line's ``QuantAlgo`` has no such member. The serving GPUs are the Blackwell ones with
block-scaled MX tensor cores (not read from a kernel check here).
"""
from __future__ import annotations

from ._base import BLACKWELL, ExportLayout, QuantFormat, Tolerances, e4m3_to_float

BLOCK = 32  # MXFP8QTensor.BLOCK_SIZE
CPU_BACKEND = "pipeline_mxfp8_cpu"


def dequantize(t, group_size=None):
    """``weight (float8_e4m3fn) × 2^(weight_scale - 127)``, one exponent per ``group_size`` inputs."""
    import torch

    w = e4m3_to_float(t["weight"])
    scale = torch.exp2(t["weight_scale"].float() - 127.0).repeat_interleave(group_size or BLOCK, dim=1)
    return w * scale[:, : w.shape[1]]


def fake_mxfp8(x):
    """MXFP8 quantize-dequantize along the last dim with ModelOpt's ``MXFP8QTensor`` (pure torch)."""
    from modelopt.torch.quantization.qtensor.mxfp8_tensor import MXFP8QTensor

    q, scale = MXFP8QTensor.quantize(x)
    return q.dequantize(dtype=x.dtype, scale=scale)


def use_cpu_fallback(model) -> int:
    """Route ModelOpt's MXFP8 fake-quant kernel (CUDA only) through :func:`fake_mxfp8` on CPU. Returns how many
    quantizers were switched."""
    from modelopt.torch.quantization.nn import TensorQuantizer
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import (is_registered_quant_backend,
                                                                          register_quant_backend)

    if not is_registered_quant_backend(CPU_BACKEND):
        register_quant_backend(CPU_BACKEND, lambda inputs, quantizer: fake_mxfp8(inputs))
    n = 0
    for mod in model.modules():
        if isinstance(mod, TensorQuantizer) and mod.is_enabled and mod.block_sizes \
                and mod.block_sizes.get("type") == "dynamic" and tuple(mod.num_bits) == (4, 3) \
                and tuple(mod.block_sizes.get("scale_bits") or ()) == (8, 0):
            mod.backend = CPU_BACKEND
            n += 1
    return n


FORMAT = QuantFormat(
    name="mxfp8", preset="MXFP8_DEFAULT_CFG", quant_algo="MXFP8", weight_bytes=1.0 + 1 / BLOCK,
    sms=BLACKWELL, sm_needs="Blackwell (sm100/sm120)",
    runtimes=frozenset({"reference", "trtllm_llmapi"}), trtllm_lines=("main",),
    layout=ExportLayout(weight="F8_E4M3", required={"weight_scale": (("U8",), "groups")}),
    group_size=BLOCK,
    precision="MXFP8 (e4m3, E8M0 scale per 32) / MXFP8 (dynamic)",
    tolerances=Tolerances(kl_max=0.1, top1_min=0.85, ppl_ratio_max=1.05, max_drop=0.05,
                          export_kl_abs=0.002, export_kl_frac=0.7, export_weight_ratio=0.25),
    dequantize=dequantize, cpu_fallback=use_cpu_fallback,
)
