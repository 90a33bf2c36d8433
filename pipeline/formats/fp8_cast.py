"""The FP8 KV cache with a constant amax: ModelOpt 0.47's ``fp8_cast`` KV preset, ``hf_ptq.py``'s default
``--kv_cache_qformat`` since ModelOpt 0.43 (NVIDIA/Model-Optimizer ``examples/hf_ptq/hf_ptq.py`` @ a2fbac7, lines
1414-1418; ``CHANGELOG.rst`` 0.43 "Backward Breaking Changes").

ModelOpt's preset (``modelopt_recipes/configs/ptq/units/kv_fp8_cast.yaml`` @ a2fbac7) sets ``use_constant_amax``
on the ``[kv]_bmm_quantizer``: the amax is the e4m3 range (448), no calibration statistics are collected, and no
``_amax`` buffer exists, so the unified HF export writes ``kv_cache_quant_algo`` ``FP8`` and no ``k_scale`` /
``v_scale`` (ModelOpt 0.47 ``export/quant_utils.py`` maps only ``k_bmm_quantizer._amax``). TensorRT-LLM then uses
its default scale of 1.0, the same value its LLM API uses for a calibrated FP8 KV cache (``fp8.served_kv_scales``).

Not for the engine path: ModelOpt 0.47's TRT-LLM checkpoint export finds no KV scale on such a quantizer and writes
``kv_cache_quant_algo: null`` (``export/layer_utils.py`` sets ``kv_cache_dtype`` only when
``get_kv_cache_scaling_factor`` returns a scale; seen on a Qwen3 model here), so ``trtllm-build`` would build a
16-bit KV cache: plan refuses it for ``runtime=trtllm_engine``.
"""
from __future__ import annotations

from ._base import ALL_GPUS, KVFormat, fake_fp8
from .fp8 import served_kv_scales

KV_FORMAT = KVFormat(
    name="fp8_cast", preset="fp8_cast", quant_algo="FP8", bytes=1.0, variant_of="fp8", constant_amax=True,
    sms=ALL_GPUS, sm_needs="an Ampere or newer GPU (sm80+)", runtimes=frozenset({"reference", "trtllm_llmapi"}),
    unserved_why="ModelOpt 0.47's TRT-LLM checkpoint export writes kv_cache_quant_algo null for a constant-amax KV "
                 "quantizer, so trtllm-build would build a 16-bit KV cache",
    llmapi_dtype="fp8", quantize_kv=fake_fp8, idempotent=True, served_scales=served_kv_scales,
)
