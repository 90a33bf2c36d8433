"""package: a Triton model repository in one of upstream's layouts, rendered strictly, schema-checked and linted.

Layouts (``serve.layout``; ``auto`` picks ``llmapi`` for ``trtllm_llmapi`` and ``inflight_batcher_llm`` otherwise):

- ``inflight_batcher_llm``: ``ensemble`` and ``tensorrt_llm_bls`` over ``preprocessing`` -> ``tensorrt_llm`` ->
  ``postprocessing``, every model with upstream's tensors, types, dims and parameters (``pipeline/upstream``). With
  ``trtllm_engine`` the ``tensorrt_llm`` model runs on the C++ ``tensorrtllm`` backend, its required parameters
  (``gpt_model_path``, ``tokenizer_dir``, guided-decoding keys) filled from the build record; with ``reference`` it is
  a python model running the reference runtime behind the same config.
- ``llmapi``: one python ``tensorrt_llm`` model; ``1/model.yaml`` holds ``model`` (absolute under ``serve.repo_mount``,
  as upstream's examples), the LLM-API options and ``triton_config`` (``max_batch_size``, ``decoupled``), which the
  model's ``auto_complete_config`` applies. N instances (``serve.llm_instance_count``) are one instance group with
  ``gpu_device_ids`` naming each instance's GPUs. With ``reference`` the same config and model.yaml are served by the
  reference runtime.

The engine or checkpoint is hard-linked into ``tensorrt_llm/1/engine``. Path parameters are absolute under
``serve.repo_mount`` (where the serving container mounts the repository); the reference model's own ``engine_dir``
is relative to the repository root. The repository is linted (``python -m pipeline lint``) before it is published.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

from pipeline import planning, store
from pipeline.errors import StageFailed, UserError
from pipeline.results import PackageResult
from pipeline.identity import ArtifactKey
from pipeline.runner import Context, Stage
from pipeline.triton import layouts
from pipeline.triton.layouts import ENGINE_REL, ENTRY_POINTS, IFB, LLMAPI, REFERENCE_TEMPLATES
from pipeline.triton.render import MODELS_DIR, parse_model_config, render

REFERENCE_SRC = Path(importlib.util.find_spec("pipeline.runtime.reference").origin)  # copied next to model.py
BATCHING_SRC = Path(importlib.util.find_spec("pipeline.runtime.batching").origin)
REFERENCE_COPIES = {"reference_runtime.py": REFERENCE_SRC, "reference_batching.py": BATCHING_SRC,
                    "reference_common.py": MODELS_DIR / "reference_common.py"}  # what both reference model.py share
# Packages copied beside them (their .py files, never __pycache__): the format registry, which the reference model.py
# passes to reference_runtime.load (pipeline is not importable in the serving container)
FORMATS_SRC = Path(importlib.util.find_spec("pipeline.formats").origin).parent
REFERENCE_PACKAGES = {"reference_formats": FORMATS_SRC}
MODELS = {(runtime, name): lay.templates(runtime) for name, lay in layouts.LAYOUTS.items() for runtime in lay.runtimes}
LLMAPI_MAX_BATCH_SIZE = 0  # upstream model.yaml triton_config.max_batch_size: requests carry 1-D tensors


def layout(cfg) -> str:
    """The repository layout: ``serve.layout``, with ``auto`` resolved from the runtime."""
    runtime = cfg.runtime.name.value
    chosen = getattr(cfg.serve.layout, "value", cfg.serve.layout)
    if chosen == "auto":
        return layouts.default_for(runtime)
    if (runtime, chosen) not in MODELS:
        fit = IFB if runtime == "trtllm_engine" else LLMAPI
        raise UserError(f"serve.layout={chosen} cannot serve runtime {runtime} (TensorRT engines need "
                        f"{IFB}, the LLM API needs {LLMAPI}); set serve.layout={fit} or auto")
    return chosen


def reference_files() -> dict[str, Path]:
    """Every file the package stage copies into a reference model's version directory (``<model>/1/``): its path
    there -> its origin. A package's ``__init__.py`` is always listed, so a missing package fails the copy."""
    out = dict(REFERENCE_COPIES)
    for dst, src in REFERENCE_PACKAGES.items():
        out[f"{dst}/__init__.py"] = src / "__init__.py"
        for p in sorted(src.rglob("*.py")):
            rel = p.relative_to(src)
            if "__pycache__" not in rel.parts:
                out[f"{dst}/{rel.as_posix()}"] = p
    return out


def templates_digest(cfg=None, store_dir=None) -> dict[str, Any]:
    """The model templates and python models are code too: their bytes enter the fingerprint, and so do the files
    copied beside the reference models (:func:`reference_files`)."""
    files = sorted(p for p in MODELS_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    copies = sorted(reference_files().items())
    return {"templates": store.digest([(p.relative_to(MODELS_DIR).as_posix(), store.sha256_file(p)) for p in files]),
            "reference_copies": store.digest([(dst, store.sha256_file(p) if p.is_file() else None)
                                              for dst, p in copies])}


def gpu_device_ids(instances: int, world: int, gpus: int) -> str:
    """Upstream's llmapi multi-instance mapping: one comma-separated GPU list per instance, ``;`` between instances
    (instances share GPUs round-robin when there are fewer than ``instances * world``). Empty for one instance."""
    if instances <= 1:
        return ""
    pool = max(int(gpus or 0), world)
    return ";".join(",".join(str((i * world + r) % pool) for r in range(world)) for i in range(instances))


CAPACITY = ("tp", "pp", "world", "kv_tokens")  # what the repository takes from the resolved capacity plan


def values(cfg, engine_cfg: dict[str, Any], capacity) -> dict[str, dict[str, Any]]:
    """Every placeholder of every template, from the config, the build record and the resolved capacity plan
    (:data:`CAPACITY` of a ``planning.Capacity``). Where one of TensorRT-LLM's rules changes a setting by itself
    (``pipeline/upstream/rules.yaml``, action ``adjust``), the value upstream would use is rendered."""
    from pipeline.upstream import rules

    b, sv = cfg.build, cfg.serve
    engine_bs = (engine_cfg.get("build_config") or {}).get("max_batch_size")
    bs = min(int(b.max_batch_size), int(engine_bs)) if engine_bs else int(b.max_batch_size)
    kv_tokens = capacity.kv_tokens
    device = "cuda" if cfg.target.device.value == "cuda" else "cpu"
    in_container = f"{sv.repo_mount.rstrip('/')}/{ENGINE_REL}"
    world = capacity.world
    common = {"triton_max_batch_size": bs}
    queue = {"max_queue_delay_microseconds": sv.max_queue_delay_microseconds, "max_queue_size": sv.max_queue_size}
    llm = {**common, **queue, "decoupled_mode": sv.decoupled, "max_beam_width": b.max_beam_width,
           "batching_strategy": "inflight_fused_batching", "engine_dir": in_container,
           "encoder_input_features_data_type": "TYPE_FP16", "logits_datatype": "TYPE_FP32",
           # 0 (no capacity plan) is refused by the backend's KvCacheConfig; empty leaves the pool to the fraction
           "max_tokens_in_paged_kv_cache": kv_tokens if kv_tokens > 0 else "",
           "batch_scheduler_policy": "guaranteed_no_evict",
           "kv_cache_free_gpu_mem_fraction": b.kv_cache_free_gpu_mem_fraction,
           "exclude_input_in_output": True,
           "enable_kv_cache_reuse": rules.rendered_kv_cache_reuse(cfg.runtime.name.value, b.use_paged_context_fmha,
                                                                  sv.enable_kv_cache_reuse),
           "enable_chunked_context": sv.enable_chunked_context, "tokenizer_dir": in_container,
           "guided_decoding_backend": "", "xgrammar_tokenizer_info_path": ""}
    python_reference = {"checkpoint_dir": ENGINE_REL, "dtype": cfg.runtime.dtype.value, "device": device,
                        "torch_threads": sv.torch_threads, "max_seq_len": b.max_seq_len}
    llmapi = {"llm_instance_count": sv.llm_instance_count,
              "gpu_device_ids": gpu_device_ids(sv.llm_instance_count, world, cfg.target.gpus_per_node)}
    return {
        "ensemble": {**common, "logits_datatype": "TYPE_FP32"},
        "preprocessing": {**common, **queue, "tokenizer_dir": in_container, "engine_dir": in_container,
                          "add_special_tokens": False, "max_input_len": b.max_input_len,
                          "preprocessing_instance_count": sv.preprocessing_instance_count},
        "postprocessing": {**common, "tokenizer_dir": in_container, "skip_special_tokens": True,
                           "postprocessing_instance_count": sv.postprocessing_instance_count},
        "tensorrt_llm_bls": {**common, "decoupled_mode": sv.decoupled, "accumulate_tokens": False,
                             "bls_instance_count": sv.bls_instance_count, "logits_datatype": "TYPE_FP32"},
        "tensorrt_llm.engine": {**llm, "triton_backend": "tensorrtllm"},
        "tensorrt_llm.reference": {**llm, "triton_backend": "python", **python_reference},
        "tensorrt_llm.llmapi": llmapi,
        "tensorrt_llm.llmapi_reference": {**llmapi, **python_reference},
    }


def model_yaml(cfg, repo: Path, capacity) -> dict[str, Any]:
    """The llmapi layout's ``1/model.yaml``: ``model`` (absolute under the container mount), the LLM-API options
    (the build's ``llmapi.json``; for the reference runtime, the options TensorRT-LLM would get) and
    ``triton_config``."""
    from pipeline.config import to_plain
    from pipeline.runtime import trtllm

    options_file = repo / ENGINE_REL / "llmapi.json"
    if options_file.is_file():
        options = json.loads(options_file.read_text())
    else:
        options = trtllm.llmapi_options(to_plain(cfg.build), cfg.quant.kv_cache.value, max(1, capacity.tp),
                                        capacity.pp)
    return {"model": f"{cfg.serve.repo_mount.rstrip('/')}/{ENGINE_REL}", "backend": "pytorch", **options,
            "triton_config": {"max_batch_size": LLMAPI_MAX_BATCH_SIZE, "decoupled": bool(cfg.serve.decoupled)}}


def render_repository(cfg, repo: Path, capacity=None) -> list[str]:
    """Write every model of the layout into ``repo``, whose ``tensorrt_llm/1/engine`` already holds the build
    output. Returns the model names. Nothing is written for a template that fails rendering or the schema.
    ``capacity``: the build's resolved capacity plan (``Context.capacity``); outside a build it is resolved from
    the full ``cfg``."""
    if capacity is None:
        capacity = planning.resolve(cfg)
    runtime, lay = cfg.runtime.name.value, layout(cfg)
    engine_cfg = json.loads((repo / ENGINE_REL / "config.json").read_text()) if runtime == "trtllm_engine" else {}
    vals = values(cfg, engine_cfg, capacity)
    rendered = []
    for tmpl in MODELS[(runtime, lay)]:
        name = tmpl.split(".")[0]
        text = render((MODELS_DIR / tmpl / "config.pbtxt.tmpl").read_text(), vals[tmpl], name=f"{name}/config.pbtxt")
        parse_model_config(text, name=f"{name}/config.pbtxt")  # schema check before anything is written
        rendered.append((tmpl, name, text))
    for tmpl, name, text in rendered:
        src = MODELS_DIR / tmpl
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "config.pbtxt").write_text(text)
        for f in sorted((src / "1").glob("*.py")):
            shutil.copy2(f, repo / name / "1" / f.name)
        if tmpl in REFERENCE_TEMPLATES:
            for dst, origin in reference_files().items():
                if not origin.is_file():
                    raise StageFailed(f"{origin} is missing; the reference runtime cannot be packaged without it")
                (repo / name / "1" / dst).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, repo / name / "1" / dst)
    if lay == LLMAPI:
        import yaml

        doc = model_yaml(cfg, repo, capacity)
        (repo / "tensorrt_llm" / "1" / "model.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return [name for _, name, _ in rendered]


def run(ctx: Context) -> PackageResult:
    from pipeline import upstream
    from pipeline.triton import lint

    cfg, repo = ctx.cfg, ctx.out
    ctx.link_input("build", "engine", ENGINE_REL)
    models = render_repository(cfg, repo, ctx.capacity)
    findings = lint.lint(repo, trtllm_version=cfg.runtime.trtllm_version, repo_mount=cfg.serve.repo_mount)
    if findings:
        (repo / "LINT.txt").write_text("\n".join(findings) + "\n")
        raise StageFailed(f"the packaged repository fails lint: {findings[0]}"
                          + (f" (+{len(findings) - 1} more in LINT.txt)" if len(findings) > 1 else ""))
    lay = layout(cfg)
    return PackageResult(layout=lay, entry_points=list(ENTRY_POINTS[lay]), models=models, engine_dir=ENGINE_REL,
                         runtime=cfg.runtime.name.value,
                         trtllm_line=upstream.line_for(cfg.runtime.get("trtllm_version")),
                         max_batch_size=(values(cfg, {}, ctx.capacity)["ensemble"]["triton_max_batch_size"]
                                         if lay == IFB else LLMAPI_MAX_BATCH_SIZE),
                         decoupled=cfg.serve.decoupled)


ENGINE_TEMPLATE = "tensorrt_llm.engine"


def rendered_engine_parameters(cfg, capacity=None) -> dict[str, str]:
    """The ``tensorrt_llm`` parameters rendered for ``trtllm_engine``, from the config alone (the engine's own batch
    size, known after the build, can only lower ``triton_max_batch_size``)."""
    import string

    from pipeline.triton.render import _pbtxt_value
    from pipeline.upstream.pbtxt import parse_template

    vals = values(cfg, {}, capacity if capacity is not None else planning.resolve(cfg))[ENGINE_TEMPLATE]
    text = (MODELS_DIR / ENGINE_TEMPLATE / "config.pbtxt.tmpl").read_text()
    params = parse_template(text, name=ENGINE_TEMPLATE).get("parameters", {})
    fill = {k: _pbtxt_value(v) for k, v in vals.items()}
    return {k: string.Template(str(v)).safe_substitute(fill) for k, v in params.items()}


def check(cfg) -> list[str]:
    """Plan time: every rendered ``tensorrt_llm`` parameter of an engine repository against what the C++ backend
    accepts (``pipeline/upstream/rules.yaml``, ``parameters``)."""
    from pipeline.upstream import rules

    if cfg.runtime.name.value != "trtllm_engine":
        return []
    try:
        return [f"tensorrt_llm/config.pbtxt {p}" for p in rules.parameter_problems(rendered_engine_parameters(cfg))]
    except UserError as exc:
        return [str(exc)]


STAGE = Stage(
    name="package",
    check=check,
    run=run,
    reads=("build", "runtime", "target", "quant.format", "quant.kv_cache", "serve.decoupled",
           "serve.layout",
           "serve.preprocessing_instance_count", "serve.postprocessing_instance_count", "serve.llm_instance_count",
           "serve.bls_instance_count", "serve.max_queue_delay_microseconds", "serve.max_queue_size",
           "serve.enable_kv_cache_reuse", "serve.enable_chunked_context", "serve.repo_mount", "serve.torch_threads"),
    inputs=("build",),
    libs=("tritonclient",),
    root="triton_repo",
    extra=templates_digest,
    capacity=CAPACITY,
    label=lambda cfg: ArtifactKey.of(cfg).label,
)
