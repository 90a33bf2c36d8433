"""Synthetic unified HF exports in ModelOpt's on-disk format, written from seeded random weights without ModelOpt, with
the proof's reference (``pipeline.quant.proof.Reference``) that the quantize stage would have recorded for them.

They stand in for a calibrated model so that the export proof's controls run in the fast tier: the layout written
here is the one the proof checks (ModelOpt 0.47 ``unified_export_hf.py``: FP8 per-tensor e4m3 weights with fp32
``weight_scale`` and ``input_scale``; W4A16 AWQ int4 weights packed two per byte along the output dimension with one
scale per ``group_size`` inputs; fp32 ``k_scale``/``v_scale`` per attention layer; ``hf_quant_config.json``), and the
fake-quant weight the reference sketches is the one the export stores, dequantized, as after the quantize stage's
``resketch``. The real exports' controls (ModelOpt calibration of tiny-qwen3) are in ``tests/e2e/test_export_proof.py``.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from pipeline.quant import proof

# tiny-qwen3's architecture (conf/model/tiny-qwen3.yaml), smaller vocabulary
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "vocab_size": 256, "max_position_embeddings": 256, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "torch_dtype": "bfloat16"}
FP8_MAX = 448.0
INT4_MAX = 7.0


def _linears() -> dict[str, tuple[int, int]]:
    h, i, n, kv, d = (CONFIG[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads", "head_dim"))
    out = {}
    for layer in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out.update({f"{p}.self_attn.q_proj": (n * d, h), f"{p}.self_attn.k_proj": (kv * d, h),
                    f"{p}.self_attn.v_proj": (kv * d, h), f"{p}.self_attn.o_proj": (h, n * d),
                    f"{p}.mlp.gate_proj": (i, h), f"{p}.mlp.up_proj": (i, h), f"{p}.mlp.down_proj": (h, i)})
    return out


def _others() -> dict[str, tuple[int, ...]]:
    h, d = CONFIG["hidden_size"], CONFIG["head_dim"]
    out = {"model.embed_tokens.weight": (CONFIG["vocab_size"], h), "model.norm.weight": (h,)}
    for layer in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out.update({f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                    f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,)})
    return out


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """int [out, in] in [-8, 7] -> uint8 [out/2, in]: row 2k in the low nibble, row 2k+1 in the high one (the
    inverse of ``pipeline.formats._base.unpack_int4_rows``)."""
    u = (q.to(torch.int16) & 0x0F).to(torch.uint8)
    return u[0::2] | (u[1::2] << 4)


def quantize_fp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = w.float().abs().max() / FP8_MAX
    return {"weight": (w.float() / scale).to(torch.float8_e4m3fn), "weight_scale": scale.reshape(())}


def quantize_int8_sq(w: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = (w.float().abs().amax(1) / 127.0).clamp_min(1e-8)
    return {"weight": torch.round(w.float() / scale[:, None]).clamp(-128, 127).to(torch.int8), "weight_scale": scale}


def quantize_int4_awq(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    out, inp = w.shape
    g = w.float().reshape(out, inp // group, group)
    scale = (g.abs().amax(-1) / INT4_MAX).clamp_min(1e-8)
    q = torch.round(g / scale[..., None]).clamp(-8, 7).reshape(out, inp)
    return {"weight": pack_int4_rows(q), "weight_scale": scale.to(torch.bfloat16)}


@dataclass
class Export:
    """A synthetic export on disk (``dir``), the weights it was quantized from and the proof's reference."""

    dir: Path
    fmt: str  # quant.format
    kv: str  # quant.kv_cache
    group: int | None
    original: dict[str, torch.Tensor]  # linear name -> bf16 weight
    ref: proof.Reference = field(default_factory=proof.Reference)

    @property
    def shard(self) -> Path:
        return self.dir / "model.safetensors"

    def tampered(self, dst: Path, edit: Callable[[dict[str, torch.Tensor], dict], None]) -> Path:
        """A copy whose tensors and ``hf_quant_config.json["quantization"]`` ``edit`` changes in place."""
        from safetensors.torch import load_file, save_file

        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(self.dir, dst)
        tensors = load_file(str(dst / "model.safetensors"))
        hq = json.loads((dst / "hf_quant_config.json").read_text())
        edit(tensors, hq["quantization"])
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        (dst / "hf_quant_config.json").write_text(json.dumps(hq))
        return dst


def write(out: Path, fmt: str = "fp8", kv: str = "fp8", group: int = 64, seed: int = 0) -> Export:
    """Write a synthetic ``fmt`` export (``fp8``, ``int8_sq`` or ``int4_awq``) with KV scales when ``kv`` is
    ``fp8``. SmoothQuant layers carry a ``pre_quant_scale``; AWQ ones where ModelOpt keeps it (``o_proj``,
    ``down_proj``: no preceding norm to fold it into)."""
    from safetensors.torch import save_file

    from pipeline.formats import dequantize

    algo = proof.ALGO[fmt]
    gen = torch.Generator().manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    e = Export(out, fmt, kv, group if fmt == "int4_awq" else None, {})
    for name, shape in _others().items():
        tensors[name] = (torch.randn(shape, generator=gen) * (0.02 if "embed" in name else 0.1) + (
            1.0 if "norm" in name else 0.0)).to(torch.bfloat16)
    tensors["lm_head.weight"] = (torch.randn(CONFIG["vocab_size"], CONFIG["hidden_size"], generator=gen) * 0.05).to(
        torch.bfloat16)  # excluded from quantization, as ModelOpt's default configs do
    for name, shape in _linears().items():
        w = (torch.randn(shape, generator=gen) / shape[1] ** 0.5).to(torch.bfloat16)
        e.original[name] = w
        parts = {"fp8": quantize_fp8, "int8_sq": quantize_int8_sq}[fmt](w) if fmt != "int4_awq" else \
            quantize_int4_awq(w, group)
        pqs = None
        if fmt == "int8_sq" or (fmt == "int4_awq" and name.endswith(("o_proj", "down_proj"))):
            pqs = (torch.rand(shape[1], generator=gen) + 0.5).to(torch.bfloat16)
            parts["pre_quant_scale"] = pqs
        if fmt in ("fp8", "int8_sq"):
            in_scale = torch.tensor(float(torch.rand((), generator=gen)) * 0.01 + 0.001)
            parts["input_scale"] = in_scale.reshape(())
            e.ref.scales[name] = ("input", float(in_scale))
        for k, v in parts.items():
            tensors[f"{name}.{k}"] = v
        fq = dequantize(algo, parts, e.group).to(torch.bfloat16).float()
        err = fq - w.float()
        if pqs is not None:  # what the layer computes with: the weight times the input's pre-quant scale
            fq, err = fq * pqs.float().reshape(1, -1), err * pqs.float().reshape(1, -1)
        e.ref.layers[name] = proof.LayerRef(proof._sketch(fq), float(err.norm()), torch.bfloat16)
    if kv == "fp8":
        for layer in range(CONFIG["num_hidden_layers"]):
            attn = f"model.layers.{layer}.self_attn"
            for i, which in enumerate("kv"):
                value = 0.02 * (layer + 1) + 0.01 * i  # k and v differ: a swap changes both
                tensors[f"{attn}.{which}_proj.{which}_scale"] = torch.tensor(value, dtype=torch.float32).reshape(())
                e.ref.scales[f"{attn}.{which}"] = ("kv", value)
    save_file(tensors, str(e.shard), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(CONFIG))
    q = {"quant_algo": algo, "kv_cache_quant_algo": proof.KV_ALGO.get(kv), "exclude_modules": ["lm_head"]}
    if fmt == "int4_awq":
        q["group_size"] = group
    (out / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.47.0"},
                                                          "quantization": q}))
    return e
