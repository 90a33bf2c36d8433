"""Seeded random weights for a transformers config, generated on the GPU when there is one, identical on any device.

Each tensor's values come from a counter-based generator: element ``i`` of tensor ``name`` is a function of
``(seed, name, i)`` alone (splitmix64 over 64-bit integers, which CPUs and GPUs compute exactly alike). Four 16-bit
fields of each hash sum to an Irwin-Hall variate (bell-shaped, mean 0), scaled to the config's
``initializer_range`` in float64 and rounded to float32, then to the model's dtype: every step is exact or correctly
rounded, so a CPU and a GPU produce the same bits, in chunks of any size.

As transformers' own initialisation does: matrices (linear layers, embeddings) get that noise, the embedding's padding
row is zero, 1-D weights (norms) are ones and biases zeros. The model is never materialised: shapes come from a
model on the ``meta`` device, and tensors are generated, moved to the host and written one safetensors shard at a time.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
IRWIN_HALL_MEAN = 2 * 65535  # four uniform 16-bit fields
IRWIN_HALL_STD = ((65536**2 - 1) / 3) ** 0.5
CHUNK = 1 << 24  # elements generated at once (int64 temporaries: 128 MiB each)
SHARD_BYTES = 5 * 1024**3


def _signed(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def tensor_key(seed: int, name: str) -> int:
    """A 64-bit key per (seed, tensor name): tensors are independent of each other and of their order."""
    return _signed(int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little"))


def noise(key: int, shape: tuple[int, ...], std: float, dtype, device, chunk: int = CHUNK):
    """A tensor of ``shape`` on ``device``: bell-shaped noise with standard deviation ``std``, bit-identical for a
    given ``key`` whatever the device or ``chunk``."""
    import torch

    numel = 1
    for s in shape:
        numel *= s
    out = torch.empty(numel, dtype=dtype, device=device)
    scale = std / IRWIN_HALL_STD
    step, mix1, mix2 = _signed(GOLDEN), _signed(MIX1), _signed(MIX2)
    with torch.no_grad():
        for start in range(0, numel, chunk):
            n = min(chunk, numel - start)
            z = torch.arange(start, start + n, dtype=torch.int64, device=device)
            z.mul_(step).add_(key)  # wraps modulo 2**64, like splitmix64's state
            z = _mix(z, mix1, mix2)
            s = (z & 0xFFFF) + ((z >> 16) & 0xFFFF) + ((z >> 32) & 0xFFFF) + ((z >> 48) & 0xFFFF)
            del z
            v = (s - IRWIN_HALL_MEAN).to(torch.float64).mul_(scale).to(torch.float32)
            out[start:start + n] = v.to(dtype)
    return out.view(shape)


def _mix(z, mix1: int, mix2: int):
    """splitmix64's finaliser on int64 (arithmetic shifts are masked to act as logical ones)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * mix1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * mix2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def plan_tensors(model) -> list[tuple[str, tuple[int, ...], str, Any]]:
    """(name, shape, kind, extra) of every tensor a checkpoint of ``model`` (on ``meta``) holds, in state-dict order:
    kind is ``noise``, ``ones`` or ``zeros``; extra is the embedding's padding row (or None)."""
    import torch

    persistent = set(model.state_dict())
    padding: dict[str, int | None] = {}
    for mname, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding):
            padding[f"{mname}.weight" if mname else "weight"] = module.padding_idx
    out = []
    for name, p in model.named_parameters():  # shared (tied) parameters once, as save_pretrained writes them
        if name.endswith("bias"):
            kind = "zeros"
        elif p.dim() >= 2:
            kind = "noise"
        else:
            kind = "ones"
        out.append((name, tuple(p.shape), kind, padding.get(name)))
    names = {n for n, *_ in out}
    extra_buffers = [n for n, _ in model.named_buffers() if n in persistent and n not in names]
    if extra_buffers:
        from pipeline.errors import UserError

        raise UserError(f"model.synthetic: the architecture has persistent buffers ({extra_buffers[0]}, ...), which "
                        f"synthetic weights do not generate; use a model source with a checkpoint")
    return out


def write_checkpoint(model, out: Path, *, seed: int, std: float, device: str | None = None) -> dict[str, Any]:
    """Generate ``model``'s (a ``meta`` model's) tensors on ``device`` and write them as safetensors shards of at most
    ``SHARD_BYTES`` with the index transformers reads. -> {params, device, shards}."""
    import torch
    from safetensors.torch import save_file

    device = device or default_device()
    dtype = next(model.parameters()).dtype
    tensors = plan_tensors(model)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...], str, Any]]] = [[]]
    size = 0
    for t in tensors:
        nbytes = itemsize * _numel(t[1])
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        host = {}
        for name, shape, kind, pad in shard:
            if kind == "noise":
                t = noise(tensor_key(seed, name), shape, std, dtype, device)
                if pad is not None:
                    t[pad].zero_()
            else:
                t = (torch.ones if kind == "ones" else torch.zeros)(shape, dtype=dtype, device=device)
            host[name] = t.to("cpu")
            weight_map[name] = fname
            total += host[name].numel() * itemsize
            del t
        save_file(host, str(out / fname), metadata={"format": "pt"})
        del host
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    return {"params": sum(_numel(t[1]) for t in tensors), "device": device, "shards": len(names)}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
