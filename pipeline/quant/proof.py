"""The export proof: the unified HF checkpoint on disk is the model ModelOpt calibrated, in ModelOpt's format.

Three checks, each able to fail on its own, all reading the exported safetensors one tensor at a time through
``safe_open`` (memory-mapped), so that the proof never holds a second copy of the model:

1. **Structure** (:func:`check_structure`), against ModelOpt's unified HF export (ModelOpt 0.47,
   ``modelopt/torch/export/unified_export_hf.py`` and ``quant_utils.py``: ``to_quantized_weight``,
   ``get_weight_scaling_factor``, ``get_quant_config``, ``get_kv_cache_scaling_factor``). Every linear layer of the
   architecture is either quantized in the format's layout (weight dtype and packing, scale tensors with their shapes
   and dtypes) or excluded by ``hf_quant_config.json``'s ``exclude_modules``; the recorded ``quant_algo``,
   ``kv_cache_quant_algo`` and ``group_size`` are the requested ones; every attention layer has positive fp32 KV
   scales exactly when the KV cache is quantized; the quantized linears take a fraction of bf16's bytes per
   parameter that fits the format.
2. **Layers** (:func:`check_layers`): each quantized linear, dequantized from the file as the reference runtime reads
   it (its format module's ``dequantize``), against ModelOpt's fake-quant weight recorded before the
   export (:func:`record`). The distance is measured as a fraction of the quantization error itself
   (``‖export − fake-quant‖ / ‖original − fake-quant‖``), through a fixed random projection of each weight (a
   sketch of 16 columns), so the recording is small even at 32B. Every calibrated activation and KV-cache scale
   must be the exported one.
3. **Numbers** (:func:`check_numbers`): the reloaded export's logits against the fake-quant model's on held-out
   rows: ``KL(fake-quant ‖ export) <= kl_abs + kl_frac × KL(unquantized ‖ fake-quant)`` with ``kl_frac`` well below
   1, so that the unquantized weights themselves fail (``benchmarks/export_proof_bounds.py`` records the margins).

The fake-quant reference is ModelOpt's calibrated model after the two steps its export applies anyway, which the
quantize stage runs right after calibration so that the fake-quant model and the export describe the same network:
the fusion of layers that share an input (``requantize_resmooth_fused_llm_layers``: shared input amax, shared NVFP4
global weight amax, averaged AWQ / SmoothQuant pre-quant scales), and, for FP8, the export's weight rounding
(``to_quantized_weight`` divides the bf16 weight by the scale in bf16 before the e4m3 cast, where the fake-quant
kernel works in fp32, so about 3% of the codes, those on a bf16 tie, land one e4m3 step apart). The quantization
error that the layer check divides by is measured before that rounding, from the original weights.
"""
from __future__ import annotations

import fnmatch
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from pipeline.formats import FLOAT_DTYPES, FORMATS, KV_FORMATS, ExportLayout as Layout

# quant format (config) -> quant_algo ModelOpt writes into hf_quant_config.json, and its tensors (the format modules')
ALGO = {n: f.quant_algo for n, f in FORMATS.items() if f.quant_algo}
KV_ALGO = {n: k.quant_algo for n, k in KV_FORMATS.items() if k.quant_algo}
LAYOUTS: dict[str, Layout] = {f.quant_algo: f.layout for f in FORMATS.values() if f.quant_algo and f.layout}
SKETCH_COLS = 16
PARTS = ("weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "bias")


@dataclass
class Proof:
    """What the proof found: ``problems`` (empty when the export passes) and the measurements behind them."""

    problems: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


# ------------------------------------------------------------------------------------------------- the checkpoint
def _stored_sizes(shard: Path) -> dict[str, int]:
    """Tensor name -> its size in bytes, from a safetensors file's header (an 8-byte little-endian length, then the
    JSON header whose ``data_offsets`` are each tensor's [begin, end) in the data that follows)."""
    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


class Checkpoint:
    """Tensors of a safetensors checkpoint by name, read one at a time from memory-mapped shards."""

    def __init__(self, ckpt: Path):
        from safetensors import safe_open

        self.dir = Path(ckpt)
        self._handles = []
        self._where: dict[str, Any] = {}
        self._nbytes: dict[str, int] = {}
        for shard in sorted(self.dir.glob("*.safetensors")):
            h = safe_open(str(shard), framework="pt", device="cpu")
            self._handles.append(h)
            for k in h.keys():
                self._where[k] = h
            self._nbytes.update(_stored_sizes(shard))

    def keys(self) -> set[str]:
        return set(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def dtype(self, key: str) -> str:
        return self._where[key].get_slice(key).get_dtype()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._where[key].get_slice(key).get_shape())

    def nbytes(self, key: str) -> int:
        """The bytes the tensor takes in its shard, as the safetensors header's ``data_offsets`` give them."""
        return self._nbytes[key]

    def get(self, key: str) -> torch.Tensor:
        return self._where[key].get_tensor(key)

    def parts(self, name: str) -> dict[str, torch.Tensor]:
        return {p: self.get(f"{name}.{p}") for p in PARTS if f"{name}.{p}" in self._where}


def quant_config(ckpt: Path) -> dict[str, Any] | None:
    p = Path(ckpt) / "hf_quant_config.json"
    if not p.is_file():
        return None
    return json.loads(p.read_text()).get("quantization", {})


def architecture(ckpt: Path) -> tuple[list[str], list[str], bool]:
    """The linear layers and the attention layers (those with ``k_proj`` and ``v_proj``) of the model that
    ``config.json`` describes, built on the meta device (no memory); and whether the embeddings are tied."""
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    attention = [n for n, m in model.named_modules()
                 if isinstance(getattr(m, "k_proj", None), nn.Linear) and isinstance(getattr(m, "v_proj", None), nn.Linear)]
    tied = bool(getattr(config, "tie_word_embeddings", False)
                or getattr(config.get_text_config(), "tie_word_embeddings", False))
    return linears, attention, tied


# ---------------------------------------------------------------------------------------------------- 1. structure
def check_structure(ckpt: Path, fmt: str, kv: str, block_size: int | None = None) -> Proof:
    """Check the export's layout against ModelOpt's unified HF format for ``fmt`` (a ``quant.format``) and ``kv``."""
    proof = Proof()
    bad = proof.problems
    q = quant_config(ckpt)
    want_algo, want_kv = ALGO.get(fmt), KV_ALGO.get(kv)
    if q is None:  # ModelOpt writes hf_quant_config.json only for a model with something quantized
        return Proof([f"nothing was quantized: the export has no hf_quant_config.json, so it is not a ModelOpt "
                      f"quantized checkpoint ({want_algo or 'no weight quantization'}, KV {want_kv} requested)"])
    algo, kv_algo = q.get("quant_algo"), q.get("kv_cache_quant_algo")
    if algo != want_algo:
        bad.append(f"hf_quant_config.json: quant_algo {algo!r}, but quant.format={fmt} exports {want_algo!r}")
    if kv_algo != want_kv:
        bad.append(f"hf_quant_config.json: kv_cache_quant_algo {kv_algo!r}, but quant.kv_cache={kv} exports "
                   f"{want_kv!r}")
    layout = LAYOUTS.get(want_algo) if want_algo else None
    spec = FORMATS[fmt]
    group = spec.export_group(block_size)
    if group is not None and q.get("group_size") != group:
        bad.append(f"hf_quant_config.json: group_size {q.get('group_size')}, but {fmt} with "
                   f"{'quant.block_size=' + str(group) if spec.awq else f'{spec.quant_algo} blocks of {group}'} "
                   f"needs {group} (wrong block size)")
    excluded = list(q.get("exclude_modules") or [])

    t = Checkpoint(ckpt)
    linears, attention, tied = architecture(ckpt)
    n_quant = n_excl = 0
    q_bytes = q_params = 0
    for name in linears:
        wkey = f"{name}.weight"
        if wkey not in t:
            if tied and name == "lm_head":
                continue
            bad.append(f"{name}: no weight in the export")
            continue
        is_excluded = any(fnmatch.fnmatchcase(name, pat) for pat in excluded)
        scaled = f"{name}.weight_scale" in t
        wdtype = t.dtype(wkey)
        if is_excluded or layout is None:
            n_excl += 1
            if scaled:
                bad.append(f"{name}: carries weight_scale, but hf_quant_config.json excludes it from quantization")
            elif wdtype not in FLOAT_DTYPES:
                bad.append(f"{name}: excluded layer stored as {wdtype}, not a float dtype")
            continue
        if not scaled:
            bad.append(f"{name}: unquantized weights ({wdtype}, no weight_scale), yet hf_quant_config.json does not "
                       f"exclude it; {want_algo} stores {layout.weight}")
            continue
        n_quant += 1
        shape = t.shape(wkey)
        if wdtype != layout.weight:
            bad.append(f"{name}: weight is {wdtype}, {want_algo} stores {layout.weight}")
            continue
        if len(shape) != 2:
            bad.append(f"{name}: weight has shape {list(shape)}, not 2-D")
            continue
        out, inp = layout.unpacked(*shape)
        for part, (dtypes, kind) in {**layout.required, **layout.optional}.items():
            key = f"{name}.{part}"
            if key not in t:
                if part in layout.required:
                    bad.append(f"{name}: {part} missing ({want_algo} stores {', '.join(layout.required)}; dropped "
                               f"scale)")
                continue
            if t.dtype(key) not in dtypes:
                bad.append(f"{name}: {part} is {t.dtype(key)}, {want_algo} stores {'/'.join(dtypes)}")
            got = t.shape(key)
            if kind == "scalar":
                if math.prod(got) != 1:
                    bad.append(f"{name}: {part} has shape {list(got)}, {want_algo} stores one per-tensor value")
                else:
                    v = float(t.get(key).float().reshape(()))
                    if not (math.isfinite(v) and v > 0):
                        bad.append(f"{name}: {part} is {v}, not a positive finite scale")
            else:
                want = layout.expected_shape(kind, out, inp, group or 0)
                if kind == "groups" and group and inp % group:
                    bad.append(f"{name}: input size {inp} is not a multiple of group_size {group} (wrong block size)")
                elif got != want:
                    what = f" for group_size {group} (wrong block size)" if kind == "groups" else ""
                    bad.append(f"{name}: {part} has shape {list(got)}, expected {list(want)}{what}")
        unexpected = [p for p in PARTS if f"{name}.{p}" in t and p not in layout.required and p not in layout.optional
                      and p not in ("weight", "bias")]
        for p in unexpected:
            bad.append(f"{name}: {p} is not part of the {want_algo} layout")
        q_params += out * inp
        q_bytes += sum(t.nbytes(f"{name}.{p}") for p in PARTS if f"{name}.{p}" in t and p != "bias")
    if want_algo and n_quant == 0:
        bad.append(f"nothing was quantized: the export carries no {want_algo} weights (every linear layer is "
                   f"excluded or unquantized)")

    n_kv = 0
    # ModelOpt's _cast KV presets (use_constant_amax) export the KV algo and no scales: TensorRT-LLM applies 1.0
    constant = kv in KV_FORMATS and KV_FORMATS[kv].constant_amax
    for attn in attention:
        for which in ("k", "v"):
            key = f"{attn}.{which}_proj.{which}_scale"
            if constant:
                if key in t:
                    bad.append(f"{attn}: {which}_proj.{which}_scale present, but quant.kv_cache={kv} pins the KV "
                               f"amax (ModelOpt's use_constant_amax exports no KV scale)")
                continue
            if key not in t:
                if want_kv:
                    bad.append(f"{attn}: {which}_proj.{which}_scale missing, but the KV cache is quantized "
                               f"({want_kv}) (dropped scale)")
                continue
            n_kv += 1
            if not want_kv:
                bad.append(f"{attn}: {which}_proj.{which}_scale present, but quant.kv_cache=none")
            if t.dtype(key) != "F32" or math.prod(t.shape(key)) != 1:
                bad.append(f"{attn}: {which}_scale is {t.dtype(key)} {list(t.shape(key))}, ModelOpt stores one fp32 "
                           f"value")
            else:
                v = float(t.get(key).reshape(()))
                if not (math.isfinite(v) and v > 0):
                    bad.append(f"{attn}: {which}_scale is {v}, not a positive finite scale")
    if want_kv and attention and n_kv == 0 and not constant:
        bad.append(f"nothing was quantized in the KV cache: no k_scale/v_scale in the export ({want_kv} requested)")

    fraction = (q_bytes / q_params) / 2.0 if q_params else None
    if layout is not None and fraction is not None and fraction > layout.bf16_fraction_max:
        bad.append(f"quantized linears take {q_bytes / q_params:.3f} bytes per parameter, {fraction:.2f}× bf16; "
                   f"{want_algo} must stay under {layout.bf16_fraction_max:g}× bf16")
    proof.details = {"quant_algo": algo, "kv_cache_quant_algo": kv_algo, "group_size": q.get("group_size"),
                     "exclude_modules": excluded, "quantized_linears": n_quant, "excluded_linears": n_excl,
                     "kv_scales": n_kv, "quantized_bytes_per_param": round(q_bytes / q_params, 4) if q_params else None,
                     "fraction_of_bf16": round(fraction, 4) if fraction is not None else None}
    return proof


# ------------------------------------------------------------------------------------------ 2. layers, and scales
@dataclass
class LayerRef:
    sketch: torch.Tensor  # (fake-quant weight × pre-quant scale) @ R, [out, SKETCH_COLS], fp32, CPU
    quant_error: float  # ‖(fake-quant − original) × pre-quant scale‖_F
    dtype: torch.dtype = torch.bfloat16  # the model's weight dtype: the deployed weight is rounded to it too


@dataclass
class Reference:
    """ModelOpt's calibrated fake-quant model, reduced to what the proof compares the export with."""

    layers: dict[str, LayerRef] = field(default_factory=dict)
    scales: dict[str, tuple[str, float]] = field(default_factory=dict)  # see calibrated_scales

    def to_json(self) -> dict[str, Any]:
        return {"layers": {k: {"quant_error": v.quant_error} for k, v in self.layers.items()},
                "scales": {k: {"kind": kind, "value": v} for k, (kind, v) in self.scales.items()}}


_R_CACHE: dict[tuple[int, str], torch.Tensor] = {}


def sketch_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A fixed Gaussian projection [n, SKETCH_COLS] (seeded by n), scaled so that E‖A R‖² = ‖A‖²."""
    key = (n, str(device))
    if key not in _R_CACHE:
        g = torch.Generator().manual_seed(n)
        _R_CACHE[key] = (torch.randn(n, SKETCH_COLS, generator=g) / math.sqrt(SKETCH_COLS)).to(device)
    return _R_CACHE[key]


def _sketch(w: torch.Tensor) -> torch.Tensor:
    return (w.float() @ sketch_matrix(w.shape[1], w.device)).cpu()


# Largest representable magnitude of each activation / KV format: a static scale is amax / bound.
_SCALE_BOUND = {8: 127.0, (4, 3): 448.0, (2, 1): 6.0 * 448.0}


def calibrated_scales(model) -> dict[str, tuple[str, float]]:
    """Every static activation and KV-cache quantizer ModelOpt calibrated: module path -> (kind, amax / bound).

    ``kind`` is ``input`` (a linear layer's input) or ``kv`` (``<attention>.k`` / ``<attention>.v``). NVFP4 KV keeps a
    per-tensor scale of amax / 448 (its blocks are scaled dynamically), like FP8."""
    out: dict[str, tuple[str, float]] = {}
    for name, mod in model.named_modules():
        quantizers = [("input", name, getattr(mod, "input_quantizer", None))]
        quantizers += [("kv", f"{name}.{k}", getattr(mod, f"{k}_bmm_quantizer", None)) for k in ("k", "v")]
        for kind, path, qz in quantizers:
            amax = getattr(qz, "amax", None) if qz is not None and qz.is_enabled else None
            if amax is None:
                continue
            bound = 448.0 if kind == "kv" else _SCALE_BOUND.get(qz.num_bits)
            if bound is not None:
                out[path] = (kind, float(amax.float().max()) / bound)
    return out


def quantized_linears(model) -> Iterator[tuple[str, Any]]:
    """ModelOpt-quantized linear layers whose weight quantizer is enabled."""
    for name, mod in model.named_modules():
        wq = getattr(mod, "weight_quantizer", None)
        if wq is not None and getattr(wq, "is_enabled", False) and isinstance(getattr(mod, "weight", None),
                                                                               torch.Tensor):
            yield name, mod


def _pre_quant_scale(mod) -> torch.Tensor | None:
    iq = getattr(mod, "input_quantizer", None)
    return getattr(iq, "_pre_quant_scale", None) if iq is not None else None


@torch.inference_mode()
def record(model) -> Reference:
    """Sketch every quantized linear's fake-quant weight (ModelOpt's own ``weight_quantizer(weight)``, as the
    fake-quant forward computes it) and collect the calibrated scales. One layer at a time; kept on the CPU."""
    ref = Reference(scales=calibrated_scales(model))
    for name, mod in quantized_linears(model):
        w = mod.weight
        fq = mod.weight_quantizer(w).to(w.dtype).float()
        pqs = _pre_quant_scale(mod)
        err = fq - w.float()
        if pqs is not None:
            fq = fq * pqs.float().reshape(1, -1)
            err = err * pqs.float().reshape(1, -1)
        ref.layers[name] = LayerRef(_sketch(fq), float(err.norm()), w.dtype)
        del fq, err
    return ref


@torch.inference_mode()
def resketch(model, ref: Reference) -> None:
    """Sketch the fake-quant weights again (after the weights were rounded as the export rounds them), keeping the
    quantization errors measured from the original weights."""
    for name, mod in quantized_linears(model):
        if name in ref.layers:
            fq = mod.weight_quantizer(mod.weight).to(mod.weight.dtype).float()
            pqs = _pre_quant_scale(mod)
            if pqs is not None:
                fq = fq * pqs.float().reshape(1, -1)
            ref.layers[name].sketch = _sketch(fq)


def check_layers(ckpt: Path, ref: Reference, max_ratio: float, device: str = "cpu") -> Proof:
    """Each quantized linear of the export, dequantized, against the recorded fake-quant weight; and every
    calibrated activation / KV scale against the exported one."""
    from pipeline.formats import dequantize

    proof = Proof()
    bad = proof.problems
    q = quant_config(ckpt) or {}
    algo, group = q.get("quant_algo"), q.get("group_size")
    t = Checkpoint(ckpt)
    ratios: dict[str, float] = {}
    for name, layer in ref.layers.items():
        parts = {k: v.to(device) for k, v in t.parts(name).items()}
        if "weight" not in parts:
            bad.append(f"{name}: quantized in the calibrated model, missing from the export")
            continue
        try:
            deq = dequantize(algo, parts, group) if "weight_scale" in parts and algo else parts["weight"]
            deq = deq.to(layer.dtype).float()  # what the deployed model computes with, like the fake-quant model
        except Exception as exc:  # a layout the dequantizer cannot read (shape mismatch, unknown algo)
            bad.append(f"{name}: cannot dequantize the exported weight ({type(exc).__name__}: {exc})")
            continue
        pqs = parts.get("pre_quant_scale")
        if pqs is not None:
            deq = deq * pqs.float().reshape(1, -1)
        if tuple(deq.shape) != (layer.sketch.shape[0], deq.shape[1]) or deq.shape[1] == 0:
            bad.append(f"{name}: exported weight has shape {list(deq.shape)}, calibrated {layer.sketch.shape[0]} rows")
            continue
        s = _sketch(deq)
        del deq, parts
        ratio = float((s - layer.sketch).norm()) / max(layer.quant_error, 1e-12)
        ratios[name] = ratio
        if ratio > max_ratio:
            denom = float((layer.sketch * layer.sketch).sum())
            alpha = float((s * layer.sketch).sum()) / denom if denom > 0 else float("nan")
            hint = (f"; it is {alpha:.3g}× the fake-quant weight (a wrong weight scale)"
                    if math.isfinite(alpha) and abs(alpha - 1) > 0.05 else "")
            bad.append(f"{name}: the exported weight differs from the fake-quant weight by {ratio:.3g}× the "
                       f"quantization error (max {max_ratio:g}){hint}")
    in_export = {k[: -len(".weight_scale")] for k in t.keys() if k.endswith(".weight_scale")}
    for name in sorted(in_export - set(ref.layers)):
        bad.append(f"{name}: quantized in the export, not in the calibrated model")
    bad.extend(scale_problems(t, ref.scales))
    worst = max(ratios.items(), key=lambda kv: kv[1]) if ratios else (None, None)
    proof.details = {"layers": len(ratios), "max_ratio": max_ratio,
                     "worst_layer": worst[0], "worst_ratio": round(worst[1], 5) if worst[1] is not None else None,
                     "mean_ratio": round(sum(ratios.values()) / len(ratios), 5) if ratios else None,
                     "activation_scales": sum(k == "input" for k, _ in ref.scales.values()),
                     "kv_scales": sum(k == "kv" for k, _ in ref.scales.values())}
    return proof


def scale_problems(t: Checkpoint, scales: dict[str, tuple[str, float]], rtol: float = 1e-3) -> list[str]:
    """Every calibrated static scale must be in the export with the calibrated value."""
    bad = []
    for path, (kind, want) in scales.items():
        if kind == "input":
            key, what = f"{path}.input_scale", "activation scale"
        else:
            owner, _, which = path.rpartition(".")
            key, what = f"{owner}.{which}_proj.{which}_scale", "KV-cache scale"
        if key not in t:
            bad.append(f"{key}: missing; the calibrated model has this {what} ({want:.6g})")
            continue
        got = float(t.get(key).float().max())
        if not abs(got - want) <= rtol * abs(want):
            bad.append(f"{key}: {got:.6g} in the export, calibrated {want:.6g} (a wrong or swapped {what})")
    return bad


# ------------------------------------------------------------------------------------------------------ 3. numbers
def check_numbers(vs_base: dict[str, float], export_vs_fq: dict[str, float], kl_abs: float, kl_frac: float) -> Proof:
    """``KL(fake-quant ‖ export) <= kl_abs + kl_frac × KL(unquantized ‖ fake-quant)`` (``pipeline.quality.compare``
    results for (unquantized, fake-quant) and (fake-quant, export))."""
    limit = kl_abs + kl_frac * vs_base["kl_mean"]
    got = export_vs_fq["kl_mean"]
    proof = Proof(details={"kl": got, "kl_max": limit, "kl_abs": kl_abs, "kl_frac": kl_frac,
                           "kl_quantization": vs_base["kl_mean"]})
    if not got <= limit:
        proof.problems.append(f"the reloaded export does not reproduce the fake-quant model: KL(fake-quant ‖ export) "
                              f"{got:.5f} > {limit:.5f} (= {kl_abs:g} + {kl_frac:g} × KL(unquantized ‖ fake-quant) "
                              f"{vs_base['kl_mean']:.5f})")
    return proof
