"""Reference runtime: load a ModelOpt *unified HF checkpoint* by dequantizing it into a transformers model.

Plain ``from_pretrained`` drops ModelOpt's scales (it reports them as unexpected keys), so it is no check of an
export. This loader reads every quantized tensor with its scales and reproduces what the quantized deployment
computes:

- FP8 weights: ``weight (float8_e4m3fn) * weight_scale``; activations are fake-quantized to e4m3 with the static
  per-tensor ``input_scale`` before each matmul (W8A8).
- FP8 KV cache: keys and values are fake-quantized with ``k_proj.k_scale`` / ``v_proj.v_scale`` right before
  attention (after RoPE), where the KV cache stores them.

It depends only on torch, safetensors and transformers, so Triton's python backend can import this file on its own
(the package stage copies it next to the served ``model.py``).
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

FP8_MAX = 448.0
ATTN_IMPL = "pipeline_kv_fp8"
_registered = threading.Lock()


def fake_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize to e4m3 with a per-tensor scale (= amax / 448), in fp32 like ModelOpt's eager kernel."""
    amax = scale.float() * FP8_MAX
    amax = torch.where(amax <= 1.0 / (1 << 24), torch.ones_like(amax), amax)
    q = FP8_MAX / amax
    y = (x.float() * q).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * (1.0 / q)
    return y.to(x.dtype)


class FP8Linear(nn.Module):
    """W8A8 FP8 linear: dequantized e4m3 weight, e4m3 fake-quantized input with a static scale."""

    def __init__(self, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
                 bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        w = (weight_fp8.float() * weight_scale.float()).to(dtype)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.weight = nn.Parameter(w, requires_grad=False)
        self.bias = nn.Parameter(bias.to(dtype), requires_grad=False) if bias is not None else None
        self.register_buffer("input_scale", input_scale.float() if input_scale is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = fake_fp8(x, self.input_scale)
        return F.linear(x, self.weight, self.bias)


def _kv_fp8_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    k_scale = getattr(module, "kv_k_scale", None)
    v_scale = getattr(module, "kv_v_scale", None)
    if k_scale is not None:
        key = fake_fp8(key, k_scale)
    if v_scale is not None:
        value = fake_fp8(value, v_scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface

    with _registered:
        AttentionInterface.register(ATTN_IMPL, _kv_fp8_attention)


def read_quant_config(ckpt: Path) -> dict[str, Any]:
    p = Path(ckpt) / "hf_quant_config.json"
    if not p.is_file():
        return {}
    return json.loads(p.read_text()).get("quantization", {})


SUPPORTED_ALGOS = {None, "FP8"}
SUPPORTED_KV = {None, "FP8"}


def load(ckpt: str | Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> nn.Module:
    """Build the model described by ``ckpt/config.json`` and fill it from the (quantized) safetensors."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = Path(ckpt)
    q = read_quant_config(ckpt)
    algo, kv_algo = q.get("quant_algo"), q.get("kv_cache_quant_algo")
    if algo not in SUPPORTED_ALGOS:
        raise ValueError(f"reference runtime cannot load quant_algo={algo!r} (supported: FP8, none)")
    if kv_algo not in SUPPORTED_KV:
        raise ValueError(f"reference runtime cannot load kv_cache_quant_algo={kv_algo!r} (supported: FP8, none)")

    config = AutoConfig.from_pretrained(ckpt)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for k in f.keys():
                tensors[k] = f.get_tensor(k)

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)

    kv_scaled = False
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and f"{name}.weight_scale" in tensors:
            w = tensors.pop(f"{name}.weight")
            if w.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{name}.weight has dtype {w.dtype}; this loader handles float8_e4m3fn weights")
            new = FP8Linear(w, tensors.pop(f"{name}.weight_scale"), tensors.pop(f"{name}.input_scale", None),
                            tensors.pop(f"{name}.bias", None), dtype)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
        for kind in ("k", "v"):
            key = f"{name}.{kind}_proj.{kind}_scale"
            if key in tensors:
                setattr(mod, f"kv_{kind}_scale", tensors.pop(key).float())
                kv_scaled = True

    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False) or getattr(config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
        missing = [m for m in missing if not m.startswith("lm_head.")]
    missing = [m for m in missing if not _is_quantized_param(model, m)]
    if unexpected:
        raise ValueError(f"unexpected tensors in {ckpt}: {', '.join(unexpected[:5])}")
    if missing:
        raise ValueError(f"tensors missing from {ckpt}: {', '.join(missing[:5])}")
    # Non-persistent buffers (rotary inverse frequencies) are not in the checkpoint: rebuild their modules for real.
    for mname, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)):
            if not hasattr(mod, "config"):
                raise ValueError(f"cannot materialise buffers of {mname} ({type(mod).__name__})")
            parent, _, child = mname.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, type(mod)(config=mod.config))
    if kv_scaled:
        _register_attention()
        model.set_attn_implementation(ATTN_IMPL)
    model.config.pipeline_quant = {"quant_algo": algo, "kv_cache_quant_algo": kv_algo}
    return model.to(device).eval()


def _is_quantized_param(model: nn.Module, name: str) -> bool:
    owner, _, attr = name.rpartition(".")
    try:
        return isinstance(model.get_submodule(owner), FP8Linear)  # filled from its quantized tensors already
    except AttributeError:
        return False


@torch.inference_mode()
def generate(model: nn.Module, input_ids: list[int], max_new_tokens: int, eos_ids: set[int] | None = None,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             generator: torch.Generator | None = None) -> Iterator[int]:
    """Yield new token ids one at a time (KV-cached decoding). Greedy when temperature == 0."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    for _ in range(max_new_tokens):
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        logits = out.logits[0, -1].float()
        if temperature <= 0:
            nxt = int(torch.argmax(logits))
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, -1)
            if top_p < 1.0:
                sp, si = torch.sort(probs, descending=True)
                drop = sp.cumsum(-1) - sp > top_p
                probs = probs.scatter(0, si, sp.masked_fill(drop, 0.0))
            nxt = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
        yield nxt
        if eos_ids and nxt in eos_ids:
            return
        ids = torch.tensor([[nxt]], dtype=torch.long, device=device)
