"""NVFP4: e2m1 weights and activations, an e4m3 scale per 16 values and an fp32 global scale (ModelOpt
``NVFP4_DEFAULT_CFG``); and the NVFP4 KV cache (``NVFP4_KV_CFG``). Calibrates on CPU or any GPU; serves on Blackwell.

Export (``quant_algo`` ``NVFP4``): two e2m1 per uint8 (low nibble first along the input dim) × ``weight_scale``
(e4m3, one per 16) × ``weight_scale_2``; activations NVFP4 fake-quantized in blocks of 16 with the global
``input_scale`` (= amax / (6 × 448)). KV cache (``kv_cache_quant_algo`` ``NVFP4``): a per-tensor ``k_scale`` /
``v_scale`` of amax / 448, blocks scaled dynamically.

:func:`fake_nvfp4` is also the CPU fallback for ModelOpt's NVFP4 fake-quant kernel, which exists on CUDA only
(:func:`use_cpu_fallback`).
"""
from __future__ import annotations

import functools

from ._base import ALL_RUNTIMES, BLACKWELL, FP8_MAX, SCALAR_F32, ExportLayout, KVFormat, QuantFormat, Tolerances

NVFP4_BLOCK = 16  # values per e4m3 block scale (NVFP4_DEFAULT_CFG block_sizes {-1: 16})
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
CPU_BACKEND = "pipeline_nvfp4_cpu"  # the name of the ModelOpt quant backend use_cpu_fallback registers


@functools.lru_cache(maxsize=None)
def inv_range():
    """1 / (6 × 448) as ModelOpt's kernel computes it (fp32 division of fp32 tensors)."""
    import torch

    return torch.tensor(1.0, dtype=torch.float32) / torch.tensor(6.0 * FP8_MAX, dtype=torch.float32)


def _e2m1_round(a):
    """Round non-negative magnitudes to the nearest e2m1 value, ties as ModelOpt's kernels break them."""
    import torch

    return torch.where(a <= 0.25, 0.0, torch.where(a < 0.75, 0.5, torch.where(a <= 1.25, 1.0, torch.where(
        a < 1.75, 1.5, torch.where(a <= 2.5, 2.0, torch.where(a < 3.5, 3.0, torch.where(a <= 5.0, 4.0, 6.0)))))))


def fake_nvfp4(x, global_amax, block: int = NVFP4_BLOCK):
    """NVFP4 quantize-dequantize along the last dim: e2m1 values, one e4m3 scale per ``block``, a global fp32 scale.

    The same arithmetic as ModelOpt's CUDA/Triton ``fp4_fake_quant_block`` (checked bit for bit on a GPU by
    tests/gpu/test_gpu.py), in plain torch so that it also runs on CPU.
    """
    import torch

    shape, dtype = x.shape, x.dtype
    if shape[-1] % block:
        raise ValueError(f"last dim {shape[-1]} is not a multiple of the NVFP4 block {block}")
    xf = x.float().reshape(*shape[:-1], shape[-1] // block, block)
    # ModelOpt computes global_amax / 2688 on the GPU, where PyTorch divides by a scalar as a multiply by its fp32
    # reciprocal; doing the same keeps the two bit-identical.
    gscale = global_amax.float().reshape(()).to(xf.device) * inv_range()
    gscale = torch.where(gscale > 0, gscale, torch.full_like(gscale, 1e-12))
    bmax = xf.abs().amax(-1, keepdim=True)
    scale = torch.clamp(bmax / (6.0 * gscale), max=FP8_MAX).to(torch.float8_e4m3fn).float() * gscale
    scale = torch.where(scale >= 1e-5, scale, torch.ones_like(scale))
    q = _e2m1_round(xf.abs() * (1.0 / scale)) * scale
    return torch.where(xf >= 0, q, -q).reshape(shape).to(dtype)


def unpack_e2m1_cols(packed):
    """uint8 [out, in/2] -> float32 [out, in] e2m1 values: low nibble first along the input dim."""
    import torch

    idx = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.long, device=packed.device)
    idx[:, 0::2] = (packed & 0x0F).long()
    idx[:, 1::2] = (packed >> 4).long()
    return torch.tensor(E2M1_VALUES, device=packed.device)[idx]


def dequantize(t, group_size=None):
    """e2m1 values × ``weight_scale`` (e4m3, one per block) × ``weight_scale_2``."""
    vals = unpack_e2m1_cols(t["weight"])
    scale = t["weight_scale"].float().repeat_interleave(group_size or NVFP4_BLOCK, dim=1)
    return vals * scale * t["weight_scale_2"].float()


def quantize_input(x, input_scale):
    """NVFP4 activations: blocks of 16 under the global ``input_scale`` (= amax / (6 × 448))."""
    return fake_nvfp4(x, input_scale * (6.0 * FP8_MAX))


def quantize_kv(t, scale):
    """NVFP4 keys or values: blocks scaled from the data, under the per-tensor scale (= amax / 448)."""
    return fake_nvfp4(t, scale * FP8_MAX)


def use_cpu_fallback(model) -> int:
    """Route ModelOpt's NVFP4 fake-quant (CUDA/Triton only) through the pure-torch ``fake_nvfp4`` on CPU.

    Uses ModelOpt's public quant-backend hook. Returns how many quantizers were switched.
    """
    import torch
    from modelopt.torch.quantization.nn import TensorQuantizer
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import (is_registered_quant_backend,
                                                                          register_quant_backend)

    def entry(inputs, quantizer):
        if getattr(quantizer, "_use_constant_amax", False):  # the _cast KV presets: the FP8 range, as ModelOpt's
            amax = torch.tensor(FP8_MAX)                          # TensorQuantizer._get_amax pins it
        else:
            amax = quantizer.amax if quantizer.amax is not None else inputs.abs().amax()
        return fake_nvfp4(inputs, amax.float().amax(), quantizer.block_sizes.get(-1) or 16)

    if not is_registered_quant_backend(CPU_BACKEND):
        register_quant_backend(CPU_BACKEND, entry)
    n = 0
    for mod in model.modules():
        if isinstance(mod, TensorQuantizer) and mod.is_enabled and mod.block_sizes \
                and mod.block_sizes.get("type") == "dynamic" and tuple(mod.num_bits) == (2, 1):
            mod.backend = CPU_BACKEND
            n += 1
    return n


FORMAT = QuantFormat(
    name="nvfp4", preset="NVFP4_DEFAULT_CFG", quant_algo="NVFP4", weight_bytes=0.5 + 1 / NVFP4_BLOCK,
    sms=BLACKWELL, sm_needs="Blackwell (sm100/sm120)", runtimes=ALL_RUNTIMES,
    layout=ExportLayout(weight="U8", pack="in", required={"weight_scale": (("F8_E4M3",), "groups"),
                                                          "weight_scale_2": SCALAR_F32, "input_scale": SCALAR_F32},
                        weight_bits=4, bf16_fraction_max=0.4),
    group_size=NVFP4_BLOCK, fp8_context_fmha=True, preference=2, calibrates_from_sm=89,
    precision="NVFP4 (e2m1, block 16) / NVFP4",
    tolerances=Tolerances(
        kl_max=0.5, top1_min=0.7, ppl_ratio_max=1.35, max_drop=0.08,
        # Export proof bounds (benchmarks/export_proof_bounds.py): the reloaded export's KL from the fake-quant model
        # within 0.002 + 0.7 × the quantization's own KL, which the unquantized weights exceed. Measured on CPU:
        # 0.17 × on tiny-qwen3 (unquantized weights 0.99 ×), 0.64 × on SmolLM2-135M (unquantized weights 1.16 ×):
        # with 4-bit activations a one-step rounding difference between ModelOpt's fake-quant and the served
        # dequantizer moves logits more than at 8 bits, and 30 layers compound it; the per-layer check
        # (export_weight_ratio) stays tight.
        export_kl_abs=0.002, export_kl_frac=0.7, export_weight_ratio=0.4),
    dequantize=dequantize, quantize_input=quantize_input, cpu_fallback=use_cpu_fallback,
)

KV_FORMAT = KVFormat(
    name="nvfp4", preset="NVFP4_KV_CFG", quant_algo="NVFP4", bytes=0.5 + 1 / NVFP4_BLOCK,
    sms=BLACKWELL, sm_needs="Blackwell (sm100/sm120)", runtimes=ALL_RUNTIMES,
    awq_calibrates_on_cpu=False,
    quantize_kv=quantize_kv, cpu_fallback=use_cpu_fallback,
)
