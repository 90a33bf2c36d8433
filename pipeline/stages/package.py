"""package: a Triton model repository for the runtime's layout, rendered strictly and schema-checked.

Runtime ``reference``: TensorRT-LLM's ensemble interface (``ensemble`` -> ``preprocessing`` -> ``tensorrt_llm``
-> ``postprocessing``), where ``tensorrt_llm`` is a decoupled python model running the reference runtime. The engine
is hard-linked into ``tensorrt_llm/1/engine`` and every path in the configs is relative to the repository root, so
the repository can be moved or shipped as it is.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

from pipeline import store
from pipeline.runner import Context, Stage
from pipeline.triton.render import MODELS_DIR, parse_model_config, render

MODELS = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing")
ENGINE_REL = "tensorrt_llm/1/engine"
REFERENCE_SRC = Path(importlib.util.find_spec("pipeline.runtime.reference").origin)  # copied next to model.py


def templates_digest(cfg=None, store_dir=None) -> dict[str, Any]:
    """The model templates and python models are code too: their bytes enter the fingerprint."""
    files = sorted(p for p in MODELS_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return {"templates": store.digest([(p.relative_to(MODELS_DIR).as_posix(), store.sha256_file(p)) for p in files])}


def run(ctx: Context) -> dict[str, Any]:
    cfg = ctx.cfg
    repo = ctx.out
    up = {f["path"]: f["sha256"] for f in ctx.manifests["build"].get("files", [])}
    store.link_tree(ctx.inputs["build"] / "engine", repo / ENGINE_REL)
    ctx.known_hashes.update({f"{ENGINE_REL}/{p[len('engine/'):]}": h for p, h in up.items() if p.startswith("engine/")})
    device = "cuda" if cfg.target.device.value == "cuda" else "cpu"
    values = {
        "ensemble": {"triton_max_batch_size": cfg.build.max_batch_size},
        "preprocessing": {"triton_max_batch_size": cfg.build.max_batch_size, "tokenizer_dir": ENGINE_REL,
                          "max_input_len": cfg.build.max_input_len,
                          "preprocessing_instance_count": cfg.serve.preprocessing_instance_count},
        "postprocessing": {"triton_max_batch_size": cfg.build.max_batch_size, "tokenizer_dir": ENGINE_REL,
                           "postprocessing_instance_count": cfg.serve.postprocessing_instance_count},
        "tensorrt_llm": {"triton_max_batch_size": cfg.build.max_batch_size, "decoupled_mode": cfg.serve.decoupled,
                         "max_queue_delay_microseconds": cfg.serve.max_queue_delay_microseconds,
                         "engine_dir": ENGINE_REL, "dtype": cfg.runtime.dtype.value, "device": device,
                         "torch_threads": cfg.serve.torch_threads, "max_seq_len": cfg.build.max_seq_len,
                         "llm_instance_count": cfg.serve.llm_instance_count},
    }
    for name in MODELS:
        src = MODELS_DIR / name
        text = render((src / "config.pbtxt.tmpl").read_text(), values[name], name=f"{name}/config.pbtxt")
        parse_model_config(text, name=f"{name}/config.pbtxt")  # schema check before anything is written
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "config.pbtxt").write_text(text)
        if (src / "1" / "model.py").is_file():
            shutil.copy2(src / "1" / "model.py", repo / name / "1" / "model.py")
    shutil.copy2(REFERENCE_SRC, repo / "tensorrt_llm" / "1" / "reference_runtime.py")
    return {"layout": "reference-ensemble", "models": list(MODELS), "engine_dir": ENGINE_REL,
            "max_batch_size": cfg.build.max_batch_size, "decoupled": cfg.serve.decoupled}


STAGE = Stage(
    name="package",
    run=run,
    reads=("build.max_batch_size", "build.max_input_len", "build.max_seq_len", "runtime.dtype", "target.device",
           "serve.decoupled", "serve.preprocessing_instance_count", "serve.postprocessing_instance_count",
           "serve.llm_instance_count", "serve.max_queue_delay_microseconds", "serve.torch_threads"),
    inputs=("build",),
    libs=("tritonclient",),
    code=("pipeline.triton.render", "pipeline.runtime.reference"),
    root="triton_repo",
    extra=templates_digest,
    label=lambda cfg: f"{cfg.model.name}.{cfg.quant.format.value}-kv{cfg.quant.kv_cache.value}"
                      f".{cfg.target.name}.{cfg.runtime.name.value}",
)
