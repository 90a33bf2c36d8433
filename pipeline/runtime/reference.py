"""Reference runtime: load a ModelOpt *unified HF checkpoint* by dequantizing it into a transformers model.

Plain ``from_pretrained`` drops ModelOpt's scales (it reports them as unexpected keys), so it is no check of an
export. This loader reads every quantized tensor with its scales and reproduces what the quantized deployment
computes:

- FP8 (``FP8``): ``weight (float8_e4m3fn) * weight_scale``; activations fake-quantized to e4m3 with the static
  per-tensor ``input_scale`` (= amax / 448).
- INT4 AWQ (``W4A16_AWQ``): two signed int4 per uint8 (low nibble = even output row), ``weight_scale`` per block of
  ``group_size`` input channels; the input is multiplied by ``pre_quant_scale`` (AWQ smoothing).
- W4A8 AWQ (``W4A8_AWQ``): INT4 AWQ weights, then the second (FP8, ``weight_scale_2``) weight quantizer; FP8
  activations with ``input_scale``, after ``pre_quant_scale``.
- NVFP4 (``NVFP4``): two e2m1 per uint8 (low nibble first along the input dim) × ``weight_scale`` (e4m3, one per 16)
  × ``weight_scale_2``; activations NVFP4 fake-quantized in blocks of 16 with the global ``input_scale``
  (= amax / (6 × 448)).
- INT8 SmoothQuant (``W8A8_SQ_PER_CHANNEL``): int8 × per-output-channel ``weight_scale``; input × ``pre_quant_scale``,
  then int8 per-tensor fake quant with ``input_scale`` (= amax / 127).
- KV cache (``FP8`` or ``NVFP4``): keys and values are fake-quantized with ``k_proj.k_scale`` / ``v_proj.v_scale``
  (= amax / 448) right before attention (after RoPE), where the KV cache stores them.

``fake_nvfp4`` is also the CPU fallback for ModelOpt's NVFP4 fake-quant kernel, which exists on CUDA only.

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
ATTN_IMPL = "pipeline_kv_quant"
_registered = threading.Lock()


# Every e4m3 value by its bit pattern, as float32: on CPU, PyTorch widens float8 one element at a time, several
# times slower than a table lookup of the same values.
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _e4m3_to_float(y: torch.Tensor) -> torch.Tensor:
    if y.device.type != "cpu":
        return y.float()
    codes = y.view(torch.uint8).reshape(-1).int()
    return _E4M3_VALUES.index_select(0, codes).view(y.shape)


def fake_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize to e4m3 with a per-tensor scale (= amax / 448), in fp32 like ModelOpt's eager kernel."""
    amax = scale.float() * FP8_MAX
    amax = torch.where(amax <= 1.0 / (1 << 24), torch.ones_like(amax), amax)
    q = FP8_MAX / amax
    y = _e4m3_to_float((x.float() * q).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)) * (1.0 / q)
    return y.to(x.dtype)


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NVFP4_BLOCK = 16
_INV_NVFP4_RANGE = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(6.0 * FP8_MAX, dtype=torch.float32)


def _e2m1_round(a: torch.Tensor) -> torch.Tensor:
    """Round non-negative magnitudes to the nearest e2m1 value, ties as ModelOpt's kernels break them."""
    return torch.where(a <= 0.25, 0.0, torch.where(a < 0.75, 0.5, torch.where(a <= 1.25, 1.0, torch.where(
        a < 1.75, 1.5, torch.where(a <= 2.5, 2.0, torch.where(a < 3.5, 3.0, torch.where(a <= 5.0, 4.0, 6.0)))))))


def fake_nvfp4(x: torch.Tensor, global_amax: torch.Tensor, block: int = NVFP4_BLOCK) -> torch.Tensor:
    """NVFP4 quantize-dequantize along the last dim: e2m1 values, one e4m3 scale per ``block``, a global fp32 scale.

    The same arithmetic as ModelOpt's CUDA/Triton ``fp4_fake_quant_block`` (checked bit for bit on a GPU by
    tests/gpu/test_gpu.py), in plain torch so that it also runs on CPU.
    """
    shape, dtype = x.shape, x.dtype
    if shape[-1] % block:
        raise ValueError(f"last dim {shape[-1]} is not a multiple of the NVFP4 block {block}")
    xf = x.float().reshape(*shape[:-1], shape[-1] // block, block)
    # ModelOpt computes global_amax / 2688 on the GPU, where PyTorch divides by a scalar as a multiply by its fp32
    # reciprocal; doing the same keeps the two bit-identical.
    gscale = global_amax.float().reshape(()).to(xf.device) * _INV_NVFP4_RANGE
    gscale = torch.where(gscale > 0, gscale, torch.full_like(gscale, 1e-12))
    bmax = xf.abs().amax(-1, keepdim=True)
    scale = torch.clamp(bmax / (6.0 * gscale), max=FP8_MAX).to(torch.float8_e4m3fn).float() * gscale
    scale = torch.where(scale >= 1e-5, scale, torch.ones_like(scale))
    q = _e2m1_round(xf.abs() * (1.0 / scale)) * scale
    return torch.where(xf >= 0, q, -q).reshape(shape).to(dtype)


def fake_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Symmetric per-tensor int8 quantize-dequantize, narrow range [-127, 127], scale = amax / 127."""
    s = scale.float()
    return (torch.clamp(torch.round(x.float() / s), -127, 127) * s).to(x.dtype)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out/2, in] -> int8 [out, in]: low nibble is output row 2k, high nibble row 2k+1 (signed)."""
    lo = (packed & 0x0F).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    out = torch.empty(packed.shape[0] * 2, packed.shape[1], dtype=torch.int8, device=packed.device)
    out[0::2] = torch.where(lo > 7, lo - 16, lo)
    out[1::2] = torch.where(hi > 7, hi - 16, hi)
    return out


def unpack_e2m1_cols(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] -> float32 [out, in] e2m1 values: low nibble first along the input dim."""
    idx = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.long, device=packed.device)
    idx[:, 0::2] = (packed & 0x0F).long()
    idx[:, 1::2] = (packed >> 4).long()
    return torch.tensor(E2M1_VALUES, device=packed.device)[idx]


def dequantize_weight(algo: str, t: dict[str, torch.Tensor], group_size: int | None) -> torch.Tensor:
    """The fp32 weight an exported quantized linear layer represents."""
    w = t["weight"]
    if algo == "FP8":
        return _e4m3_to_float(w) * t["weight_scale"].float()
    if algo in ("W4A16_AWQ", "W4A8_AWQ"):
        q = unpack_int4_rows(w).float()
        scale = t["weight_scale"].float().repeat_interleave(group_size or 128, dim=1)[:, : q.shape[1]]
        deq = q * scale
        if algo == "W4A8_AWQ":  # the second, FP8 per-tensor weight quantizer
            deq = fake_fp8(deq, t["weight_scale_2"]).float()
        return deq
    if algo == "NVFP4":
        vals = unpack_e2m1_cols(w)
        scale = t["weight_scale"].float().repeat_interleave(group_size or NVFP4_BLOCK, dim=1)
        return vals * scale * t["weight_scale_2"].float()
    if algo == "W8A8_SQ_PER_CHANNEL":
        return w.float() * t["weight_scale"].float()[:, None]
    raise ValueError(f"no dequantizer for quant_algo={algo!r}")


class QuantLinear(nn.Module):
    """A linear layer as the quantized deployment computes it: dequantized weight, quantized input."""

    def __init__(self, algo: str, tensors: dict[str, torch.Tensor], group_size: int | None, dtype: torch.dtype):
        super().__init__()
        self.algo = algo
        w = dequantize_weight(algo, tensors, group_size).to(dtype)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.weight = nn.Parameter(w, requires_grad=False)
        bias = tensors.get("bias")
        self.bias = nn.Parameter(bias.to(dtype), requires_grad=False) if bias is not None else None
        pqs = tensors.get("pre_quant_scale")
        self.register_buffer("pre_quant_scale", pqs.to(dtype) if pqs is not None else None)
        inp = tensors.get("input_scale")
        self.register_buffer("input_scale", inp.float() if inp is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale
        if self.input_scale is not None:
            if self.algo == "NVFP4":
                x = fake_nvfp4(x, self.input_scale * (6.0 * FP8_MAX))
            elif self.algo == "W8A8_SQ_PER_CHANNEL":
                x = fake_int8(x, self.input_scale)
            else:
                x = fake_fp8(x, self.input_scale)
        return F.linear(x, self.weight, self.bias)


def _kv_quant_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA on keys and values fake-quantized as the KV cache stores them.

    FP8 quantize-dequantize with a fixed per-tensor scale is idempotent, so on a full-attention layer of a
    ``DynamicCache`` (what this runtime decodes with), without autograd, only the new positions (the last ``query``
    length ones) are quantized, in place: the cache tensor that ``key``/``value`` are then holds quantized values, and
    the positions before were quantized when they were new.
    Everywhere else (NVFP4, whose block scales follow the data; sliding-window caches, which return a copy) the
    whole key and value are quantized on every call."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    fmt = getattr(module, "kv_format", None)
    new = query.shape[2]
    in_place = (fmt != "NVFP4" and getattr(module, "sliding_window", None) is None
                and kwargs.get("sliding_window") is None and not torch.is_grad_enabled() and key.shape[2] >= new)
    for name in ("k", "v"):
        scale = getattr(module, f"kv_{name}_scale", None)
        if scale is None:
            continue
        t = key if name == "k" else value
        if in_place:
            t[:, :, -new:] = fake_fp8(t[:, :, -new:], scale)
            continue
        t = fake_nvfp4(t, scale * FP8_MAX) if fmt == "NVFP4" else fake_fp8(t, scale)
        if name == "k":
            key = t
        else:
            value = t
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface

    with _registered:
        AttentionInterface.register(ATTN_IMPL, _kv_quant_attention)


def read_quant_config(ckpt: Path) -> dict[str, Any]:
    p = Path(ckpt) / "hf_quant_config.json"
    if not p.is_file():
        return {}
    return json.loads(p.read_text()).get("quantization", {})


SUPPORTED_ALGOS = {None, "FP8", "W4A16_AWQ", "W4A8_AWQ", "NVFP4", "W8A8_SQ_PER_CHANNEL"}
SUPPORTED_KV = {None, "FP8", "NVFP4"}


def load(ckpt: str | Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> nn.Module:
    """Build the model described by ``ckpt/config.json`` and fill it from the (quantized) safetensors."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = Path(ckpt)
    q = read_quant_config(ckpt)
    algo, kv_algo = q.get("quant_algo"), q.get("kv_cache_quant_algo")
    if algo not in SUPPORTED_ALGOS:
        raise ValueError(f"reference runtime cannot load quant_algo={algo!r} "
                         f"(supported: {', '.join(sorted(a for a in SUPPORTED_ALGOS if a))}, none)")
    if kv_algo not in SUPPORTED_KV:
        raise ValueError(f"reference runtime cannot load kv_cache_quant_algo={kv_algo!r} (supported: FP8, NVFP4, none)")
    group_size = q.get("group_size")

    config = AutoConfig.from_pretrained(ckpt)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # Tensors are read one at a time from memory-mapped shards and dequantized on ``device``: the host never holds
    # the whole checkpoint, and no second copy of the model is made.
    handles = [safe_open(str(shard), framework="pt", device="cpu") for shard in sorted(ckpt.glob("*.safetensors"))]
    where = {k: h for h in handles for k in h.keys()}

    def take(key: str) -> torch.Tensor:
        return where.pop(key).get_tensor(key).to(device)

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)

    kv_scaled = False
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and f"{name}.weight_scale" in where:
            parts = {k: take(f"{name}.{k}") for k in
                     ("weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "bias")
                     if f"{name}.{k}" in where}
            new = QuantLinear(algo, parts, group_size, dtype)
            del parts
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
        for kind in ("k", "v"):
            key = f"{name}.{kind}_proj.{kind}_scale"
            if key in where:
                setattr(mod, f"kv_{kind}_scale", take(key).float())
                mod.kv_format = kv_algo
                kv_scaled = True

    tensors = {k: take(k) for k in list(where)}
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    del tensors
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
        return isinstance(model.get_submodule(owner), QuantLinear)  # filled from its quantized tensors already
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
