"""The records a format module declares (:class:`QuantFormat`, :class:`KVFormat`, :class:`ExportLayout`,
:class:`Tolerances`), built with keyword arguments, and the kernels several formats share (the e4m3 table,
``fake_fp8``, int4 unpacking and AWQ's group dequantization).

Self-contained: this package is copied into Triton model repositories next to the reference runtime, where
``pipeline`` is not importable. Nothing here imports ``pipeline``, and torch is imported inside the kernels only,
so that reading the registry at plan time (the CLI, ``pipeline.schema``) loads no torch.

Sources: ModelOpt 0.47 (``modelopt/torch/quantization/config.py`` presets; ``modelopt/torch/export/quant_utils.py``
``get_quant_config``, ``to_quantized_weight``), ModelOpt's ``examples/llm_ptq/hf_ptq.py`` (preset per ``--qformat``
and ``--kv_cache_qformat``) and TensorRT-LLM's support matrix (``docs/source/reference/support-matrix.md``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

ALL_GPUS = (80, 86, 89, 90, 100, 103, 120)
BLACKWELL = (100, 103, 120)
RUNTIMES = ("reference", "trtllm_engine", "trtllm_llmapi")
# The TensorRT-LLM lines this project records (pipeline/upstream RECORD_FILES): the 1.2.x releases and main
TRTLLM_LINES = ("1.2.1", "main")
ALL_RUNTIMES = frozenset(RUNTIMES)
FLOAT_DTYPES = ("BF16", "F16", "F32")
FP8_MAX = 448.0  # largest e4m3 magnitude: a static FP8 scale is amax / 448
SCALAR_F32 = (("F32",), "scalar")  # an export tensor holding one fp32 per-tensor scale

# AWQ (INT4_AWQ_CFG, W4A8_AWQ_BETA_CFG): ModelOpt's block_sizes {-1: 128}; int4 + one fp32 scale per group
AWQ_GROUP = 128
AWQ_WEIGHT_BYTES = 0.5 + 4 / AWQ_GROUP
# The plan's calibration-time estimate: awq_lite's search adds ~19× to the calibration forward passes (Qwen3-32B at
# 256 × 512: ~5.4 min on one H200, extrapolated from a few layers; docs/benchmarks.md as of commit 0bc39f2).
AWQ_CALIB_FACTOR = 19.0


class FormatError(ValueError):
    """A format module declares a record that cannot work (raised when the registry is read)."""


# --------------------------------------------------------------------------------------------------- the records
# Shapes of an export tensor, for a quantized linear layer [out, in] (``in`` / ``out`` before packing): the export
# proof compares each stored scale with the shape its layout names.
SHAPES: dict[str, Callable[[int, int, int], tuple[int, ...]]] = {
    "scalar": lambda out, inp, group: (),  # one per-tensor value (any shape holding one element)
    "out": lambda out, inp, group: (out,),  # one per output channel
    "in": lambda out, inp, group: (inp,),  # one per input channel (AWQ / SmoothQuant pre-quant scales)
    "groups": lambda out, inp, group: (out, inp // group if group else 0),  # one per group of inputs per row
}
PACKING = (None, "out", "in")  # two 4-bit values per byte: None (not packed), along the output or the input dim


@dataclass(frozen=True, kw_only=True)
class ExportLayout:
    """How ModelOpt's unified export stores one quantized linear layer ``[out, in]`` (read by the export proof)."""

    weight: str  # safetensors dtype of the stored weight
    pack: str | None = None  # None: [out, in]; "out": two int4 per byte along the output dim; "in": two e2m1 along in
    required: dict[str, tuple[tuple[str, ...], str]]  # tensor -> (dtypes, shape kind of SHAPES)
    optional: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)
    weight_bits: int = 8
    bf16_fraction_max: float = 0.55  # bytes per parameter of the quantized linears / bf16's 2 bytes, at most

    def __post_init__(self) -> None:
        if self.pack not in PACKING:
            raise FormatError(f"ExportLayout pack={self.pack!r}: use one of {', '.join(map(repr, PACKING))}")
        for part, (dtypes, kind) in {**self.required, **self.optional}.items():
            if kind not in SHAPES:
                raise FormatError(f"ExportLayout tensor {part!r}: unknown shape kind {kind!r}; use one of "
                                  f"{', '.join(SHAPES)}")
            if not dtypes or isinstance(dtypes, str):
                raise FormatError(f"ExportLayout tensor {part!r}: give its safetensors dtypes as a tuple, e.g. "
                                  f"('F32',)")

    def unpacked(self, out: int, inp: int) -> tuple[int, int]:
        """The layer's ``[out, in]`` from the stored weight's shape."""
        return (out * 2, inp) if self.pack == "out" else (out, inp * 2) if self.pack == "in" else (out, inp)

    @staticmethod
    def expected_shape(kind: str, out: int, inp: int, group: int) -> tuple[int, ...]:
        return SHAPES[kind](out, inp, group)


@dataclass(frozen=True, kw_only=True)
class Tolerances:
    """The numbers a format is held to. The config's defaults read them (``quant.thresholds.*``, ``quant.eval.*``,
    ``eval.max_drop.<format>``, through the ``pipeline.format`` resolver of ``pipeline.schema``); an override wins."""

    # the quantize stage's accuracy gate: the deployed export vs the unquantized model on held-out text
    kl_max: float
    top1_min: float
    ppl_ratio_max: float
    # the task-eval gate: the largest drop of a task score allowed (absolute: 0.05 = 5 accuracy points)
    max_drop: float
    # Export proof bounds (benchmarks/export_proof_bounds.py): the reloaded export's KL from the fake-quant model
    # within 0.002 + 0.5 × the quantization's own KL, which the unquantized weights exceed; deep synthetic networks
    # amplify kernel-level differences (Qwen3-4B shape on an H200: 0.33 × for FP8), hence 0.5. Each quantized
    # layer's exported weight within export_weight_ratio × its quantization error of the fake-quant weight.
    export_kl_abs: float = 0.002
    export_kl_frac: float = 0.5
    export_weight_ratio: float = 0.4


Dequantize = Callable[[dict[str, Any], Optional[int]], Any]  # (exported tensors, group_size) -> fp32 weight
Quantize = Callable[[Any, Any], Any]  # (tensor, per-tensor scale) -> the tensor, quantized and dequantized
ModelHook = Callable[[Any], int]  # quantize time, on ModelOpt's calibrated model -> how many quantizers/layers changed


@dataclass(frozen=True, kw_only=True)
class QuantFormat:
    """One weight/activation format (a ``quant.format`` value): its facts and its behaviour."""

    name: str
    preset: str | None  # ModelOpt config in modelopt.torch.quantization (None: nothing quantized)
    quant_algo: str | None  # hf_quant_config.json quantization.quant_algo of the export
    weight_bytes: float  # bytes per parameter of a quantized linear weight, scales included
    sms: tuple[int, ...]  # GPU architectures that serve it
    sm_needs: str  # the phrase a refusal uses for those architectures
    runtimes: frozenset[str]  # runtimes that load the export
    tolerances: Tolerances
    layout: ExportLayout | None = None  # export tensors (None: bf16 weights)
    awq: bool = False  # AWQ group quantization: quant.block_size applies, and must divide every linear input size
    group_size: int | None = None  # exported group_size: AWQ's default, or the fixed NVFP4 block
    fp8_context_fmha: bool = False  # TensorRT-LLM allows use_fp8_context_fmha with this algorithm
    trtllm_refusals: frozenset[str] = frozenset()  # pipeline/upstream/rules.yaml rules that refuse this format
    preference: int | None = None  # rank among the alternatives a refusal suggests (lower first)
    calibrates_from_sm: int | None = None  # fake-quant kernels run from this SM, below the SMs that serve it
    calib_factor: float = 1.0  # calibration time / the plain forward passes' (the plan's estimate)
    calib_factor_reason: str = ""  # what the factor pays for, as the plan says it
    # behaviour: the reference runtime's
    dequantize: Dequantize | None = None  # exported tensors of one linear -> its fp32 weight
    quantize_input: Quantize | None = None  # activation fake-quant with the layer's static input_scale
    # behaviour: the quantize stage's, on ModelOpt's calibrated model (import modelopt inside)
    cpu_fallback: ModelHook | None = None  # route fake-quant kernels that exist on CUDA only through torch on CPU
    round_as_exported: Callable[[Any], int] | None = None  # (quantized linears) -> layers rounded as the export rounds
    # TensorRT-LLM lines whose QuantAlgo and checkpoint loaders take this quant_algo (a format only main loads is
    # refused in plan for a 1.2.x runtime.trtllm_version); the citations are in the format's module docstring
    trtllm_lines: tuple[str, ...] = TRTLLM_LINES
    calibrates_on_cpu: bool = True  # False: ModelOpt's calibration itself runs a CUDA-only kernel (no CPU fallback)
    precision: str = ""  # weights / activations in a few words (the generated formats table, docs/formats.md)

    def __post_init__(self) -> None:
        if not ((self.quant_algo is None) == (self.layout is None) == (self.preset is None)):
            raise FormatError(f"format {self.name}: give preset, quant_algo and layout together (a quantized "
                              f"format) or none of them (unquantized)")
        if self.quant_algo is not None and self.dequantize is None:
            raise FormatError(f"format {self.name}: quant_algo {self.quant_algo} needs a dequantize function (the "
                              f"reference runtime serves every format from its export)")
        if not self.runtimes <= ALL_RUNTIMES:
            raise FormatError(f"format {self.name}: unknown runtimes {sorted(self.runtimes - ALL_RUNTIMES)}; use "
                              f"{', '.join(RUNTIMES)}")
        if not set(self.trtllm_lines) <= set(TRTLLM_LINES):
            raise FormatError(f"format {self.name}: unknown TensorRT-LLM lines "
                              f"{sorted(set(self.trtllm_lines) - set(TRTLLM_LINES))}; use {', '.join(TRTLLM_LINES)}")
        if self.awq and self.group_size is None:
            raise FormatError(f"format {self.name}: an AWQ format needs its default group_size")

    def export_group(self, block_size: int | None = None) -> int | None:
        """The ``group_size`` the export records for a ``quant.block_size`` (None: ModelOpt's preset)."""
        if self.awq:
            return block_size or self.group_size
        return self.group_size


@dataclass(frozen=True, kw_only=True)
class KVFormat:
    """One KV-cache format (a ``quant.kv_cache`` value): its facts and its behaviour."""

    name: str
    preset: str | None  # ModelOpt KV config merged with update_quant_cfg_with_kv_cache_quant
    quant_algo: str | None  # hf_quant_config.json quantization.kv_cache_quant_algo
    bytes: float  # bytes per cached K or V value
    sms: tuple[int, ...]
    sm_needs: str
    runtimes: frozenset[str]
    awq_calibrates_on_cpu: bool = True  # ModelOpt's AWQ search with this KV format has a CPU kernel
    llmapi_dtype: str = "auto"  # the LLM API's KvCacheConfig.dtype ("auto": the checkpoint's KV quantization)
    # behaviour: the reference runtime's attention hook fake-quantizes keys and values with k_scale / v_scale
    quantize_kv: Quantize | None = None
    idempotent: bool = False  # a fixed per-tensor scale: quantizing twice is quantizing once, so the runtime
    #                           quantizes only the new positions of its cache, in place
    cpu_fallback: ModelHook | None = None  # as QuantFormat.cpu_fallback
    # ModelOpt KV presets that export the same kv_cache_quant_algo (fp8 and fp8_cast: calibrated or constant amax)
    # differ in how the scale is found, not in the export's algo: a variant names the format whose algo it shares,
    # and the registry's one-format-per-algo rule (KV_BY_ALGO, read by the reference runtime) keeps that one.
    variant_of: str | None = None
    constant_amax: bool = False  # ModelOpt's use_constant_amax: no calibration, and no k_scale/v_scale exported
    unserved_why: str = ""  # why a runtime missing from ``runtimes`` cannot serve it (plan's refusal says it)
    # The per-tensor K and V scales a deployment applies, from the exported ones (None where the export has none)
    # and the runtime serving it -> (k, v) as floats; None: the exported scales, 1.0 where absent.
    served_scales: Callable[[Optional[float], Optional[float], str], tuple[float, float]] | None = None

    def __post_init__(self) -> None:
        if (self.quant_algo is None) != (self.preset is None):
            raise FormatError(f"KV format {self.name}: give preset and quant_algo together, or neither")
        if self.quant_algo is not None and self.quantize_kv is None:
            raise FormatError(f"KV format {self.name}: kv_cache_quant_algo {self.quant_algo} needs a quantize_kv "
                              f"function (the reference runtime's attention hook)")
        if not self.runtimes <= ALL_RUNTIMES:
            raise FormatError(f"KV format {self.name}: unknown runtimes {sorted(self.runtimes - ALL_RUNTIMES)}")


# ------------------------------------------------------------------------------------------------ shared kernels
@functools.lru_cache(maxsize=None)
def _e4m3_values():
    """Every e4m3 value by its bit pattern, as float32: on CPU, PyTorch widens float8 one element at a time, several
    times slower than a table lookup of the same values."""
    import torch

    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def e4m3_to_float(y):
    """float8_e4m3fn -> float32 (a table lookup on CPU)."""
    import torch

    if y.device.type != "cpu":
        return y.float()
    codes = y.view(torch.uint8).reshape(-1).int()
    return _e4m3_values().index_select(0, codes).view(y.shape)


def fake_fp8(x, scale):
    """Quantize-dequantize to e4m3 with a per-tensor scale (= amax / 448), in fp32 like ModelOpt's eager kernel."""
    import torch

    amax = scale.float() * FP8_MAX
    amax = torch.where(amax <= 1.0 / (1 << 24), torch.ones_like(amax), amax)
    q = FP8_MAX / amax
    y = e4m3_to_float((x.float() * q).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)) * (1.0 / q)
    return y.to(x.dtype)


def unpack_int4_rows(packed):
    """uint8 [out/2, in] -> int8 [out, in]: low nibble is output row 2k, high nibble row 2k+1 (signed)."""
    import torch

    lo = (packed & 0x0F).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    out = torch.empty(packed.shape[0] * 2, packed.shape[1], dtype=torch.int8, device=packed.device)
    out[0::2] = torch.where(lo > 7, lo - 16, lo)
    out[1::2] = torch.where(hi > 7, hi - 16, hi)
    return out


def dequantize_int4_groups(t, group_size):
    """AWQ's int4 weights: two signed int4 per uint8 (``unpack_int4_rows``) × ``weight_scale``, one per
    ``group_size`` input channels."""
    q = unpack_int4_rows(t["weight"]).float()
    scale = t["weight_scale"].float().repeat_interleave(group_size or AWQ_GROUP, dim=1)[:, : q.shape[1]]
    return q * scale


def awq_layout(**required) -> ExportLayout:
    """AWQ's export: int4 packed two per byte along the output dim, a scale per group (plus ``required``); the
    pre-quant scale is folded into the preceding norm where layers share an input, kept otherwise."""
    return ExportLayout(weight="U8", pack="out", required={"weight_scale": (FLOAT_DTYPES, "groups"), **required},
                        optional={"pre_quant_scale": (FLOAT_DTYPES, "in")}, weight_bits=4, bf16_fraction_max=0.4)
