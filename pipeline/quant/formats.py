"""The quant-format registry: every per-format fact in one record, for weights (:data:`FORMATS`) and the KV cache
(:data:`KV_FORMATS`).

Everything that differs by format is read from here: ModelOpt's preset (``modelopt``), the ``quant_algo`` its
unified HF export writes and the tensors it stores (the export proof), bytes per parameter (the capacity planner),
the GPU architectures and runtimes that serve it (``compat``), AWQ and NVFP4 block sizes, and the TensorRT-LLM
build flags that depend on the algorithm. Adding a format is one record here, one ``conf/quant/<name>.yaml`` and a
member of ``schema.QuantFormat``; ``tests/unit/test_formats.py`` checks that the three agree with each other and
with what the self-contained reference runtime (``pipeline/runtime/reference.py``, which is copied into model
repositories and so cannot import this module) can load.

Sources: ModelOpt 0.47 (``modelopt/torch/quantization/config.py`` presets; ``modelopt/torch/export/quant_utils.py``
``get_quant_config``, ``to_quantized_weight``), ModelOpt's ``examples/llm_ptq/hf_ptq.py`` (preset per ``--qformat``
and ``--kv_cache_qformat``) and TensorRT-LLM's support matrix (``docs/source/reference/support-matrix.md``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

ALL_GPUS = (80, 86, 89, 90, 100, 103, 120)
BLACKWELL = (100, 103, 120)
RUNTIMES = ("reference", "trtllm_engine", "trtllm_llmapi")
FLOAT_DTYPES = ("BF16", "F16", "F32")
NVFP4_BLOCK = 16  # values per e4m3 block scale (NVFP4_DEFAULT_CFG block_sizes {-1: 16})
AWQ_GROUP = 128  # ModelOpt's INT4_AWQ_CFG / W4A8_AWQ_BETA_CFG block_sizes {-1: 128}


@dataclass(frozen=True)
class ExportLayout:
    """How ModelOpt's unified export stores one quantized linear layer ``[out, in]`` (read by the export proof)."""

    weight: str  # safetensors dtype of the stored weight
    pack: str | None  # None: [out, in]; "out": two int4 per byte along the output dim; "in": two e2m1 along input
    required: dict[str, tuple[tuple[str, ...], str]]  # tensor -> (dtypes, shape: scalar | out | in | groups)
    optional: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)
    weight_bits: int = 8
    bf16_fraction_max: float = 0.55  # bytes per parameter of the quantized linears / bf16's 2 bytes, at most


@dataclass(frozen=True)
class QuantFormat:
    """One weight/activation format (a ``quant.format`` value)."""

    name: str
    preset: str | None  # ModelOpt config in modelopt.torch.quantization (None: nothing quantized)
    quant_algo: str | None  # hf_quant_config.json quantization.quant_algo of the export
    weight_bytes: float  # bytes per parameter of a quantized linear weight, scales included
    sms: tuple[int, ...]  # GPU architectures that serve it
    sm_needs: str  # the phrase a refusal uses for those architectures
    runtimes: frozenset[str]  # runtimes that load the export
    layout: ExportLayout | None = None  # export tensors (None: bf16 weights)
    awq: bool = False  # AWQ group quantization: quant.block_size applies, and must divide every linear input size
    group_size: int | None = None  # exported group_size: AWQ's default, or the fixed NVFP4 block
    fp8_context_fmha: bool = False  # TensorRT-LLM allows use_fp8_context_fmha with this algorithm
    preference: int | None = None  # rank among the alternatives a refusal suggests (lower first)
    calibrates_from_sm: int | None = None  # fake-quant kernels run from this SM, below the SMs that serve it

    def export_group(self, block_size: int | None = None) -> int | None:
        """The ``group_size`` the export records for a ``quant.block_size`` (None: ModelOpt's preset)."""
        if self.awq:
            return block_size or self.group_size
        return self.group_size


@dataclass(frozen=True)
class KVFormat:
    """One KV-cache format (a ``quant.kv_cache`` value)."""

    name: str
    preset: str | None  # ModelOpt KV config merged with update_quant_cfg_with_kv_cache_quant
    quant_algo: str | None  # hf_quant_config.json quantization.kv_cache_quant_algo
    bytes: float  # bytes per cached K or V value
    sms: tuple[int, ...]
    sm_needs: str
    runtimes: frozenset[str]
    awq_calibrates_on_cpu: bool = True  # ModelOpt's AWQ search with this KV format has a CPU kernel


_ALL = frozenset(RUNTIMES)
_SCALAR_F32 = (("F32",), "scalar")
_AWQ_WEIGHT_BYTES = 0.5 + 4 / AWQ_GROUP  # int4 + one fp32 scale per group

FORMATS: dict[str, QuantFormat] = {f.name: f for f in (
    QuantFormat("none", None, None, 2.0, ALL_GPUS, "an Ampere or newer GPU (sm80+)", _ALL),
    QuantFormat("fp8", "FP8_DEFAULT_CFG", "FP8", 1.0, (89, 90, *BLACKWELL), "Ada, Hopper or Blackwell (sm89+)", _ALL,
                ExportLayout("F8_E4M3", None, {"weight_scale": _SCALAR_F32, "input_scale": _SCALAR_F32}),
                fp8_context_fmha=True, preference=0),
    QuantFormat("int4_awq", "INT4_AWQ_CFG", "W4A16_AWQ", _AWQ_WEIGHT_BYTES, (80, 86, 89, 90),
                "Ampere, Ada or Hopper (sm80-sm90; not in the support matrix for Blackwell)", _ALL,
                # AWQ's pre-quant scale is folded into the preceding norm where layers share an input, kept otherwise
                ExportLayout("U8", "out", {"weight_scale": (FLOAT_DTYPES, "groups")},
                             {"pre_quant_scale": (FLOAT_DTYPES, "in")}, 4, 0.4),
                awq=True, group_size=AWQ_GROUP, preference=1),
    QuantFormat("nvfp4", "NVFP4_DEFAULT_CFG", "NVFP4", 0.5 + 1 / NVFP4_BLOCK, BLACKWELL, "Blackwell (sm100/sm120)",
                _ALL,
                ExportLayout("U8", "in", {"weight_scale": (("F8_E4M3",), "groups"), "weight_scale_2": _SCALAR_F32,
                                          "input_scale": _SCALAR_F32}, weight_bits=4, bf16_fraction_max=0.4),
                group_size=NVFP4_BLOCK, fp8_context_fmha=True, preference=2, calibrates_from_sm=89),
    QuantFormat("w4a8_awq", "W4A8_AWQ_BETA_CFG", "W4A8_AWQ", _AWQ_WEIGHT_BYTES, (89, 90),
                "Ada or Hopper (sm89/sm90)", _ALL,
                ExportLayout("U8", "out", {"weight_scale": (FLOAT_DTYPES, "groups"), "weight_scale_2": _SCALAR_F32,
                                           "input_scale": _SCALAR_F32},
                             {"pre_quant_scale": (FLOAT_DTYPES, "in")}, 4, 0.4),
                awq=True, group_size=AWQ_GROUP, fp8_context_fmha=True, preference=3),
    QuantFormat("int8_sq", "INT8_SMOOTHQUANT_CFG", "W8A8_SQ_PER_CHANNEL", 1.0, (80, 86, 89, 90),
                "Ampere, Ada or Hopper (sm80-sm90)", frozenset({"reference", "trtllm_engine"}),
                ExportLayout("I8", None, {"weight_scale": (FLOAT_DTYPES, "out"), "input_scale": _SCALAR_F32,
                                          "pre_quant_scale": (FLOAT_DTYPES, "in")}),
                preference=4),
)}

KV_FORMATS: dict[str, KVFormat] = {k.name: k for k in (
    KVFormat("none", None, None, 2.0, ALL_GPUS, "any supported GPU", _ALL),
    KVFormat("fp8", "FP8_KV_CFG", "FP8", 1.0, ALL_GPUS, "an Ampere or newer GPU (sm80+)", _ALL),
    KVFormat("nvfp4", "NVFP4_KV_CFG", "NVFP4", 0.5 + 1 / NVFP4_BLOCK, BLACKWELL, "Blackwell (sm100/sm120)", _ALL,
             awq_calibrates_on_cpu=False),
)}

# Derived views, for the modules that look a format up by one fact.
AWQ_FORMATS = tuple(n for n, f in FORMATS.items() if f.awq)
BY_ALGO: dict[str, QuantFormat] = {f.quant_algo: f for f in FORMATS.values() if f.quant_algo}
PREFERENCE = tuple(sorted((n for n, f in FORMATS.items() if f.preference is not None),
                          key=lambda n: FORMATS[n].preference))


def get(name: str) -> QuantFormat:
    return FORMATS[name]


def kv(name: str) -> KVFormat:
    return KV_FORMATS[name]
