"""build: turn the quantized checkpoint into what a runtime on one target serves.

Runtime ``reference`` (PyTorch, runs anywhere): the engine directory holds the exported checkpoint (hard-linked) and
``build.json``; the build is checked by loading it through the reference dequantizer and generating a few tokens.
"""
from __future__ import annotations

import json
import time
from typing import Any

from pipeline import store
from pipeline.errors import StageFailed
from pipeline.runner import Context, Stage, lib_versions
from pipeline.ui import status


def run(ctx: Context) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from pipeline.runtime import reference

    src = ctx.inputs["quantize"] / "checkpoint"
    engine = ctx.out / "engine"
    store.link_tree(src, engine, skip_manifest=False)
    up = {f["path"]: f["sha256"] for f in ctx.manifests["quantize"].get("files", [])}
    ctx.known_hashes.update({f"engine/{p[len('checkpoint/'):]}": h for p, h in up.items() if p.startswith("checkpoint/")})

    rt = ctx.cfg.runtime
    device = "cuda" if ctx.cfg.target.device.value == "cuda" else "cpu"
    dtype = getattr(torch, rt.dtype.value)
    t0 = time.perf_counter()
    with status(f"loading the engine through the reference runtime on {device}"):
        model = reference.load(engine, dtype=dtype, device=device)
        tok = AutoTokenizer.from_pretrained(engine)
    load_s = time.perf_counter() - t0
    ids = tok(rt.check_prompt, add_special_tokens=False)["input_ids"]
    t0 = time.perf_counter()
    out = list(reference.generate(model, ids, rt.check_tokens))
    gen_s = time.perf_counter() - t0
    text = tok.decode(out, skip_special_tokens=True)
    if len(out) == 0:
        raise StageFailed("reference runtime generated no tokens from the built engine")

    record = {
        "runtime": rt.name.value,
        "target": ctx.cfg.target.name,
        "sm": ctx.cfg.target.sm,
        "device": device,
        "gpu_name": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "dtype": rt.dtype.value,
        "quant": reference.read_quant_config(engine),
        "build_settings": {k: v for k, v in ctx.cfg.build.items()},
        "versions": lib_versions(("torch", "transformers", "safetensors")),
        "check": {"prompt": rt.check_prompt, "completion": text, "tokens": len(out),
                  "load_s": round(load_s, 3), "tokens_per_s": round(len(out) / max(gen_s, 1e-9), 2)},
    }
    (ctx.out / "build.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return {"engine_dir": "engine", "check": record["check"]}


STAGE = Stage(
    volatile=("build.json",),
    name="build",
    run=run,
    reads=("runtime", "target", "build"),
    inputs=("quantize",),
    libs=("torch", "transformers", "safetensors"),
    code=("pipeline.runtime.reference",),
    root="engines",
    label=lambda cfg: f"{cfg.model.name}.{cfg.quant.format.value}-kv{cfg.quant.kv_cache.value}"
                      f".{cfg.target.name}.{cfg.runtime.name.value}",
)
