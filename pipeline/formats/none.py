"""No weight/activation quantization (``quant.format=none``: bf16 linears) and the unquantized KV cache
(``quant.kv_cache=none``)."""
from __future__ import annotations

from ._base import ALL_GPUS, ALL_RUNTIMES, KVFormat, QuantFormat, Tolerances

FORMAT = QuantFormat(
    name="none", preset=None, quant_algo=None, weight_bytes=2.0,
    sms=ALL_GPUS, sm_needs="an Ampere or newer GPU (sm80+)", runtimes=ALL_RUNTIMES,
    precision="bf16 / bf16",
    tolerances=Tolerances(kl_max=0.05, top1_min=0.9, ppl_ratio_max=1.03, max_drop=0.02,
                          export_weight_ratio=0.05),  # Layers: exact for FP8.
)

KV_FORMAT = KVFormat(
    name="none", preset=None, quant_algo=None, bytes=2.0,
    sms=ALL_GPUS, sm_needs="any supported GPU", runtimes=ALL_RUNTIMES,
)
