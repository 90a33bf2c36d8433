"""package: a Triton model repository in the runtime's layout, rendered strictly, schema-checked and linted.

Layouts (one ``tensorrt_llm`` model each, the rest shared):

- ``reference``: TensorRT-LLM's ensemble interface (``ensemble`` and ``tensorrt_llm_bls`` over ``preprocessing`` ->
  ``tensorrt_llm`` -> ``postprocessing``), where ``tensorrt_llm`` is a decoupled python model running the reference
  runtime.
- ``trtllm_engine`` (``inflight_batcher_llm``): the same, with ``tensorrt_llm`` on the C++ ``tensorrtllm`` backend,
  every mandatory parameter filled from the build record and the capacity plan.
- ``trtllm_llmapi`` (``llmapi``): one python model, ``tensorrt_llm/1/model.yaml`` generated from the LLM-API options.

The engine or checkpoint is hard-linked into ``tensorrt_llm/1/engine``. Paths read by the python models are relative
to the repository root; the C++ backend's ``engine_dir`` is ``serve.repo_mount`` + that path. The repository is
linted (``python -m pipeline lint``) before it is published into place.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

from pipeline import planning, store
from pipeline.errors import StageFailed
from pipeline.runner import Context, Stage, artifact_label
from pipeline.triton.render import MODELS_DIR, parse_model_config, render

ENGINE_REL = "tensorrt_llm/1/engine"
REFERENCE_SRC = Path(importlib.util.find_spec("pipeline.runtime.reference").origin)  # copied next to model.py
SHARED = ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm_bls")
LAYOUTS = {"reference": (*SHARED, "tensorrt_llm.reference"), "trtllm_engine": (*SHARED, "tensorrt_llm.engine"),
           "trtllm_llmapi": ("tensorrt_llm.llmapi",)}
LAYOUT_NAMES = {"reference": "reference-ensemble", "trtllm_engine": "inflight_batcher_llm", "trtllm_llmapi": "llmapi"}


def templates_digest(cfg=None, store_dir=None) -> dict[str, Any]:
    """The model templates and python models are code too: their bytes enter the fingerprint."""
    files = sorted(p for p in MODELS_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return {"templates": store.digest([(p.relative_to(MODELS_DIR).as_posix(), store.sha256_file(p)) for p in files])}


def values(cfg, engine_cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every placeholder of every template, from the config, the build record and the capacity plan."""
    b, sv = cfg.build, cfg.serve
    engine_bs = (engine_cfg.get("build_config") or {}).get("max_batch_size")
    bs = min(int(b.max_batch_size), int(engine_bs)) if engine_bs else int(b.max_batch_size)
    plan = planning.capacity_plan(cfg)
    kv_tokens = plan.row(plan.chosen_kv).max_tokens if plan is not None else 0
    device = "cuda" if cfg.target.device.value == "cuda" else "cpu"
    common = {"triton_max_batch_size": bs}
    return {
        "ensemble": common,
        "preprocessing": {**common, "tokenizer_dir": ENGINE_REL, "max_input_len": b.max_input_len,
                          "preprocessing_instance_count": sv.preprocessing_instance_count},
        "postprocessing": {**common, "tokenizer_dir": ENGINE_REL,
                           "postprocessing_instance_count": sv.postprocessing_instance_count},
        "tensorrt_llm_bls": {**common, "decoupled_mode": sv.decoupled, "tensorrt_llm_model_name": "tensorrt_llm",
                             "bls_instance_count": sv.bls_instance_count},
        "tensorrt_llm.reference": {**common, "decoupled_mode": sv.decoupled,
                                   "max_queue_delay_microseconds": sv.max_queue_delay_microseconds,
                                   "engine_dir": ENGINE_REL, "dtype": cfg.runtime.dtype.value, "device": device,
                                   "torch_threads": sv.torch_threads, "max_seq_len": b.max_seq_len,
                                   "llm_instance_count": sv.llm_instance_count},
        "tensorrt_llm.engine": {**common, "triton_backend": "tensorrtllm", "decoupled_mode": sv.decoupled,
                                "max_queue_delay_microseconds": sv.max_queue_delay_microseconds,
                                "max_queue_size": sv.max_queue_size, "max_beam_width": b.max_beam_width,
                                "batching_strategy": "inflight_fused_batching",
                                "engine_dir": f"{sv.repo_mount.rstrip('/')}/{ENGINE_REL}",
                                "encoder_input_features_data_type": "TYPE_FP16", "logits_datatype": "TYPE_FP32",
                                "max_tokens_in_paged_kv_cache": kv_tokens,
                                "kv_cache_free_gpu_mem_fraction": b.kv_cache_free_gpu_mem_fraction,
                                "enable_kv_cache_reuse": sv.enable_kv_cache_reuse,
                                "enable_chunked_context": sv.enable_chunked_context,
                                "llm_instance_count": sv.llm_instance_count},
        "tensorrt_llm.llmapi": {**common, "decoupled_mode": sv.decoupled, "llm_instance_count": sv.llm_instance_count},
    }


def render_repository(cfg, repo: Path) -> list[str]:
    """Write every model of the runtime's layout into ``repo``, whose ``tensorrt_llm/1/engine`` already holds the
    build output. Returns the model names. Nothing is written for a template that fails rendering or the schema."""
    runtime = cfg.runtime.name.value
    engine_cfg = json.loads((repo / ENGINE_REL / "config.json").read_text()) if runtime == "trtllm_engine" else {}
    vals = values(cfg, engine_cfg)
    rendered = []
    for tmpl in LAYOUTS[runtime]:
        name = tmpl.split(".")[0]
        text = render((MODELS_DIR / tmpl / "config.pbtxt.tmpl").read_text(), vals[tmpl], name=f"{name}/config.pbtxt")
        parse_model_config(text, name=f"{name}/config.pbtxt")  # schema check before anything is written
        rendered.append((tmpl, name, text))
    for tmpl, name, text in rendered:
        src = MODELS_DIR / tmpl
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "config.pbtxt").write_text(text)
        if (src / "1" / "model.py").is_file():
            shutil.copy2(src / "1" / "model.py", repo / name / "1" / "model.py")
    if runtime == "reference":
        shutil.copy2(REFERENCE_SRC, repo / "tensorrt_llm" / "1" / "reference_runtime.py")
    if runtime == "trtllm_llmapi":
        import yaml

        options = json.loads((repo / ENGINE_REL / "llmapi.json").read_text())
        doc = {"model": "engine", "backend": "pytorch", **options,
               "triton_config": {"max_batch_size": vals["tensorrt_llm.llmapi"]["triton_max_batch_size"],
                                 "decoupled": bool(cfg.serve.decoupled)}}
        (repo / "tensorrt_llm" / "1" / "model.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return [name for _, name, _ in rendered]


def run(ctx: Context) -> dict[str, Any]:
    from pipeline.triton import lint

    cfg, repo = ctx.cfg, ctx.out
    up = {f["path"]: f["sha256"] for f in ctx.manifests["build"].get("files", [])}
    store.link_tree(ctx.inputs["build"] / "engine", repo / ENGINE_REL)
    ctx.known_hashes.update({f"{ENGINE_REL}/{p[len('engine/'):]}": h for p, h in up.items() if p.startswith("engine/")})
    models = render_repository(cfg, repo)
    findings = lint.lint(repo, trtllm_version=cfg.runtime.trtllm_version, repo_mount=cfg.serve.repo_mount)
    if findings:
        (repo / "LINT.txt").write_text("\n".join(findings) + "\n")
        raise StageFailed(f"the packaged repository fails lint: {findings[0]}"
                          + (f" (+{len(findings) - 1} more in LINT.txt)" if len(findings) > 1 else ""))
    return {"layout": LAYOUT_NAMES[cfg.runtime.name.value], "models": models, "engine_dir": ENGINE_REL,
            "max_batch_size": values(cfg, {})["ensemble"]["triton_max_batch_size"], "decoupled": cfg.serve.decoupled}


STAGE = Stage(
    name="package",
    run=run,
    reads=("build", "runtime", "target", "model.shape", "quant.format", "quant.kv_cache", "serve.decoupled",
           "serve.preprocessing_instance_count", "serve.postprocessing_instance_count", "serve.llm_instance_count",
           "serve.bls_instance_count", "serve.max_queue_delay_microseconds", "serve.max_queue_size",
           "serve.enable_kv_cache_reuse", "serve.enable_chunked_context", "serve.repo_mount", "serve.torch_threads"),
    inputs=("build",),
    libs=("tritonclient",),
    code=("pipeline.triton.render", "pipeline.triton.lint", "pipeline.runtime.reference", "pipeline.planning",
          "pipeline.capacity"),
    root="triton_repo",
    extra=templates_digest,
    label=artifact_label,
)
