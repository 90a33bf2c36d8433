"""The NVFP4 KV cache with a constant amax: ModelOpt 0.47's ``nvfp4_cast`` KV preset
(NVIDIA/Model-Optimizer ``modelopt_recipes/configs/ptq/units/kv_nvfp4_cast.yaml`` @ a2fbac7: ``use_constant_amax``
on NVFP4 ``[kv]_bmm_quantizer``s; the deployment kernel upcasts NVFP4 KV values to FP8 before attention, so the
per-tensor amax is pinned to the FP8 range, 448).

Exported as ``kv_cache_quant_algo`` ``NVFP4`` without ``k_scale`` / ``v_scale`` (no ``_amax`` buffer to export), so
TensorRT-LLM keeps its ``kv_scales`` of 1.0 (``tensorrt_llm/_torch/modules/linear.py`` @ 00bbf71 creates them as
ones and overwrites them only from a checkpoint's ``k_scale`` / ``v_scale``). The blocks are scaled from the data
under that per-tensor scale (``nvfp4.quantize_kv``). Served on Blackwell; the engine path is refused as for
``fp8_cast`` (the TRT-LLM checkpoint export records no KV algo for a constant-amax quantizer).
"""
from __future__ import annotations

from ._base import BLACKWELL, KVFormat
from .nvfp4 import NVFP4_BLOCK, quantize_kv, use_cpu_fallback

KV_FORMAT = KVFormat(
    name="nvfp4_cast", preset="nvfp4_cast", quant_algo="NVFP4", bytes=0.5 + 1 / NVFP4_BLOCK, variant_of="nvfp4",
    constant_amax=True, sms=BLACKWELL, sm_needs="Blackwell (sm100/sm120)",
    runtimes=frozenset({"reference", "trtllm_llmapi"}),
    unserved_why="ModelOpt 0.47's TRT-LLM checkpoint export writes kv_cache_quant_algo null for a constant-amax KV "
                 "quantizer, so trtllm-build would build a 16-bit KV cache",
    awq_calibrates_on_cpu=False, quantize_kv=quantize_kv, cpu_fallback=use_cpu_fallback,
)
