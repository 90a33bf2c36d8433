"""Reference runtime: load a ModelOpt *unified HF checkpoint* by dequantizing it into a transformers model.

Plain ``from_pretrained`` drops ModelOpt's scales (it reports them as unexpected keys), so it is no check of an
export. This loader reads every quantized tensor with its scales and reproduces what the quantized deployment
computes: each quantized linear layer's weight dequantized from the export, its input multiplied by
``pre_quant_scale`` (AWQ / SmoothQuant smoothing) and fake-quantized with the static ``input_scale``; keys and values
fake-quantized with ``k_proj.k_scale`` / ``v_proj.v_scale`` right before attention (after RoPE), where the KV cache
stores them.

What each format computes comes from the format registry, passed in (``load(..., formats=...)``): its records by
``quant_algo`` (``BY_ALGO``, ``KV_BY_ALGO``) carry ``dequantize``, ``quantize_input`` and ``quantize_kv``. In the
project that is ``pipeline.formats``; in a model repository, where ``pipeline`` is not importable, the served
``model.py`` passes the copy the package stage puts beside this file (``reference_formats``), which is also what
``load`` reads when given none there.

It depends only on torch, safetensors and transformers (and the registry it is given), so Triton's python backend
can import this file on its own (the package stage copies it next to the served ``model.py``).
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

ATTN_IMPL = "pipeline_kv_quant"
_registered = threading.Lock()


class QuantLinear(nn.Module):
    """A linear layer as the quantized deployment computes it: dequantized weight, quantized input. ``fmt``: the
    format's record (``dequantize``, ``quantize_input``)."""

    def __init__(self, fmt, tensors: dict[str, torch.Tensor], group_size: int | None, dtype: torch.dtype):
        super().__init__()
        self.fmt = fmt
        self.algo = fmt.quant_algo
        w = fmt.dequantize(tensors, group_size).to(dtype)
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
        if self.input_scale is not None and self.fmt.quantize_input is not None:
            x = self.fmt.quantize_input(x, self.input_scale)
        return F.linear(x, self.weight, self.bias)


def _kv_quant_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA on keys and values fake-quantized as the KV cache stores them (``module.kv_format``: the KV format's
    record, whose ``quantize_kv`` takes a tensor and its per-tensor scale).

    A format whose quantize-dequantize is idempotent (FP8: a fixed per-tensor scale) is applied, on a full-attention
    layer of a ``DynamicCache`` (what this runtime decodes with), without autograd, to the new positions only (the
    last ``query`` length ones), in place: the cache tensor that ``key``/``value`` are then holds quantized values,
    and the positions before were quantized when they were new.
    Everywhere else (NVFP4, whose block scales follow the data; sliding-window caches, which return a copy) the
    whole key and value are quantized on every call."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    fmt = module.kv_format
    new = query.shape[2]
    in_place = (fmt.idempotent and getattr(module, "sliding_window", None) is None
                and kwargs.get("sliding_window") is None and not torch.is_grad_enabled() and key.shape[2] >= new)
    for name in ("k", "v"):
        scale = getattr(module, f"kv_{name}_scale", None)
        if scale is None:
            continue
        t = key if name == "k" else value
        if in_place:
            t[:, :, -new:] = fmt.quantize_kv(t[:, :, -new:], scale)
            continue
        t = fmt.quantize_kv(t, scale)
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


def default_formats():
    """The format registry this file serves with when none is passed: ``pipeline.formats`` where it is
    ``pipeline.runtime.reference``; in a model repository, where the package stage copies it as
    ``reference_runtime.py``, the copy of the registry beside it (``reference_formats``)."""
    if __name__.startswith("pipeline."):
        from pipeline import formats

        return formats
    try:
        import reference_formats
    except ImportError as exc:
        raise ImportError(f"{__name__}: no format registry beside it (reference_formats/, which the package stage "
                          f"copies next to the reference runtime); pass load(..., formats=...) or re-run package") \
            from exc
    return reference_formats


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), as torch's own CPU probes report it."""
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(p is not None and p() for p in probes)


def compute_dtype(name: str | None, device: str) -> torch.dtype:
    """The compute dtype a model loads in: ``name`` (``bfloat16``, ``float16``, ``float32``), or for ``auto`` (and
    none) bfloat16 on a GPU and on a CPU with native bfloat16, float32 on any other CPU (its bfloat16 matrix products
    are emulated: a SmolLM2-135M forward pass on one thread ran 4.2 x slower in bfloat16, ``benchmarks/cpu_dtype.py``)."""
    if name in (None, "", "auto"):
        return torch.bfloat16 if str(device).startswith("cuda") or native_bf16() else torch.float32
    return getattr(torch, str(name))


def load(ckpt: str | Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", formats=None,
         runtime: str = "reference") -> nn.Module:
    """Build the model described by ``ckpt/config.json`` and fill it from the (quantized) safetensors.

    ``formats``: the format registry (a module or object with ``BY_ALGO`` and ``KV_BY_ALGO``: ``quant_algo`` ->
    record); None: :func:`default_formats`. ``runtime``: the runtime whose KV-cache scales to apply (the KV
    format's ``served_scales``: TensorRT-LLM's LLM API applies 1.0 to an FP8 KV cache whatever the checkpoint
    holds, its engines max(k, v, 1)); an export that quantizes the KV cache without scales (ModelOpt's ``_cast``
    presets) gets TensorRT-LLM's default of 1.0."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    formats = formats if formats is not None else default_formats()
    ckpt = Path(ckpt)
    q = read_quant_config(ckpt)
    algo, kv_algo = q.get("quant_algo"), q.get("kv_cache_quant_algo")
    if algo is not None and algo not in formats.BY_ALGO:
        raise ValueError(f"reference runtime cannot load quant_algo={algo!r} "
                         f"(supported: {', '.join(sorted(formats.BY_ALGO))}, none)")
    if kv_algo is not None and kv_algo not in formats.KV_BY_ALGO:
        raise ValueError(f"reference runtime cannot load kv_cache_quant_algo={kv_algo!r} "
                         f"(supported: {', '.join(sorted(formats.KV_BY_ALGO))}, none)")
    fmt = formats.BY_ALGO.get(algo)
    kv_fmt = formats.KV_BY_ALGO.get(kv_algo)
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
            if fmt is None:
                raise ValueError(f"{ckpt}: {name}.weight_scale is quantized, but hf_quant_config.json records no "
                                 f"quant_algo; export it with ModelOpt (which records the format) or drop the scales")
            parts = {k: take(f"{name}.{k}") for k in
                     ("weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "bias")
                     if f"{name}.{k}" in where}
            new = QuantLinear(fmt, parts, group_size, dtype)
            del parts
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
        exported = {}
        for kind in ("k", "v"):
            key = f"{name}.{kind}_proj.{kind}_scale"
            if key in where:
                if kv_fmt is None:
                    raise ValueError(f"{ckpt}: {key} is a KV-cache scale, but hf_quant_config.json records no "
                                     f"kv_cache_quant_algo; export it with ModelOpt (which records the KV format) or "
                                     f"drop the scales")
                exported[kind] = float(take(key).float().reshape(()))
        if kv_fmt is not None and (exported or _is_attention(mod)):
            k, v = exported.get("k"), exported.get("v")
            served = kv_fmt.served_scales(k, v, runtime) if getattr(kv_fmt, "served_scales", None) else (
                k if k is not None else 1.0, v if v is not None else 1.0)
            for kind, value in zip(("k", "v"), served):
                setattr(mod, f"kv_{kind}_scale", torch.tensor(float(value), dtype=torch.float32, device=device))
            mod.kv_format = kv_fmt
            kv_scaled = True

    # the unquantized tensors in the compute dtype (a bfloat16 checkpoint computed in float32 on a CPU without native
    # bfloat16); integer tensors as they are
    tensors = {k: (t.to(dtype) if t.is_floating_point() else t) for k, t in ((k, take(k)) for k in list(where))}
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


def _is_attention(mod: nn.Module) -> bool:
    """A transformers attention module: the one whose ``k_proj`` / ``v_proj`` ModelOpt's export names the KV scales
    after (``<attention>.k_proj.k_scale``)."""
    return isinstance(getattr(mod, "k_proj", None), nn.Module) and isinstance(getattr(mod, "v_proj", None), nn.Module)


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
