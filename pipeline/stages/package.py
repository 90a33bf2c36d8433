"""package: a Triton model repository in one of the registry's layouts (``pipeline/triton/layouts/<name>/``),
rendered strictly, schema-checked and linted. Each layout folder holds its templates and python models and its
placeholder values (``placeholders.py``); this stage links the build output in, renders the chosen layout's
templates for the runtime, copies the reference runtime beside the python models that run it, and lints the result.

NVIDIA's layouts (``serve.layout``; ``auto`` picks ``llmapi`` for ``trtllm_llmapi`` and ``inflight_batcher_llm``
otherwise):

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

from pipeline.catalog import ENGINE_REL
from pipeline.errors import StageFailed, UserError
from pipeline.identity import ArtifactKey
from pipeline.results import PackageResult
from pipeline.runner.contract import Context, Stage
from pipeline.triton import layouts
from pipeline.triton.layouts import ENTRY_POINTS
from pipeline.triton.repository import CAPACITY, layout, render_repository, rendered_engine_parameters, templates_digest

def run(ctx: Context) -> PackageResult:
    from pipeline import upstream
    from pipeline.triton import lint

    cfg, repo = ctx.cfg, ctx.out
    ctx.link_input("build", "engine", ENGINE_REL)
    models = render_repository(cfg, repo, ctx.capacity)
    findings = lint.lint(repo, trtllm_version=cfg.runtime.trtllm_version, repo_mount=cfg.serve.repo_mount,
                         layout=layout(cfg))
    if findings:
        (repo / "LINT.txt").write_text("\n".join(findings) + "\n")
        raise StageFailed(f"the packaged repository fails lint: {findings[0]}"
                          + (f" (+{len(findings) - 1} more in LINT.txt)" if len(findings) > 1 else ""))
    lay = layout(cfg)
    return PackageResult(layout=lay, entry_points=list(ENTRY_POINTS[lay]), models=models, engine_dir=ENGINE_REL,
                         runtime=cfg.runtime.name.value,
                         trtllm_line=upstream.line_for(cfg.runtime.get("trtllm_version")),
                         max_batch_size=layouts.get(lay).max_batch_size(cfg, ctx.capacity),
                         decoupled=cfg.serve.decoupled)


def check(cfg) -> list[str]:
    """Plan time: the chosen layout's folder against its record (a missing template or python model, a tensor its
    interface lacks: :meth:`Layout.problems`), and every rendered ``tensorrt_llm`` parameter of an engine repository
    against what the C++ backend accepts (``pipeline/upstream/rules.yaml``, ``parameters``)."""
    from pipeline.upstream import rules

    try:
        lay = layouts.get(layout(cfg))
    except UserError:  # a layout that cannot serve the runtime is refused when the stage runs
        lay = None
    problems = [f"serve.layout={lay.name}: {p}" for p in lay.problems()] if lay is not None else []
    if problems or cfg.runtime.name.value != "trtllm_engine":
        return problems
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
