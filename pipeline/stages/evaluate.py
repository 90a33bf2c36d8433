"""eval_baseline and evaluate: task accuracy of the served model against its unquantized baseline.

Both stages serve a Triton repository, put the OpenAI front end in front of it and run lm-evaluation-harness against
that endpoint (``pipeline.eval``): what is measured is what applications get.

- ``eval_baseline``: the fetched checkpoint (``model.dtype``), without weight or KV-cache quantization, served by the
  reference runtime (``inflight_batcher_llm`` layout) in the build's compute dtype (``runtime.dtype``, as the
  quantized model computes) on a server this stage starts (``serve.launcher`` local or docker; with ``external`` the
  baseline is still served here, locally). Its fingerprint holds the fetched checkpoint, the tasks (names, the
  project's task files' digests, limit, few-shot, seed), lm-eval's version, the serving settings that shape the
  repository, the compute dtype and the device kind (``target.device``: CPU and GPU kernels round differently), and
  nothing of the quantization or the target: every format and target of one model on one device kind shares one
  baseline.
- ``evaluate``: the packaged repository of this build, served as the bench serves it (``serve.launcher`` local,
  docker or external), the same tasks; then the paired gate per task (``pipeline.eval.stats``): both scores, the
  per-item difference with its confidence interval, the item count and the verdict against
  ``eval.max_drop[quant.format]``. ``fail`` fails the stage; ``inconclusive`` fails it only with ``eval.strict``.

Output: ``eval.json`` (per task: aggregate results and per-item scores; evaluate adds the gate), ``eval.md``
(evaluate: the table), ``lm-eval.log``, ``server.log`` (Triton's) and ``frontend.log`` (the errors the OpenAI front end
answered). ``eval.tasks=[]`` skips both (nothing served).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from pipeline import eval as ev
from pipeline.catalog import ENGINE_REL
from pipeline.errors import StageFailed, UserError
from pipeline.eval import tasks as evtasks
from pipeline.identity import ArtifactKey
from pipeline.results import EvalResult
from pipeline.runner.contract import Context, Stage
from pipeline.triton import server as srv

EVAL_JSON, EVAL_MD = ev.EVAL_JSON, "eval.md"
# the serving settings that shape a packaged repository (the baseline's is rendered here)
REPO_SERVE_KEYS = ("serve.decoupled", "serve.preprocessing_instance_count", "serve.postprocessing_instance_count",
                   "serve.llm_instance_count", "serve.bls_instance_count", "serve.max_queue_delay_microseconds",
                   "serve.max_queue_size", "serve.enable_kv_cache_reuse", "serve.enable_chunked_context",
                   "serve.repo_mount")
# where and how a server runs: never what it computes
LAUNCH_KEYS = ("serve.launcher", "serve.host", "serve.server_bin", "serve.startup_timeout_s", "serve.image",
               "serve.url", "serve.torch_threads", "serve.openai")
TASK_KEYS = ("eval.tasks", "eval.limit", "eval.num_fewshot", "eval.seed", "eval.max_length")
RUN_KEYS = ("eval.concurrency", "eval.request_timeout_s", "eval.timeout_s")


def task_extra(cfg, store_dir=None) -> dict[str, Any]:
    """The project's task files' digests (fingerprint input)."""
    return {"task_files": evtasks.digests(list(cfg.eval.tasks))}


def _label_baseline(cfg) -> str:
    return f"{cfg.model.name}.{getattr(cfg.target.device, 'value', cfg.target.device)}"


def _evaluate_repo(ctx: Context, repo: Path, serve, shared=None) -> dict[str, Any]:
    """Serve ``repo`` and run the tasks against it (``pipeline.eval.evaluate_repo``; ``shared``: the run's scope,
    whose server and front end for ``repo`` the bench may have started); server faults fail the stage with the
    server's log tail kept beside its outputs."""
    try:
        doc = ev.evaluate_repo(repo, serve, ctx.cfg.eval, ctx.out, ctx.paths["store"] / "servers", shared=shared,
                               stage=ctx.stage.name)
    except srv.ServerError as exc:
        (ctx.out / "server-error.txt").write_text(str(exc) + "\n")
        raise StageFailed(str(exc).splitlines()[0] + " (server log tail: server-error.txt)") from exc
    doc["task_files"] = dict(ctx.extra.get("task_files") or {})
    return doc


def _skipped(ctx: Context, why: str) -> EvalResult:
    (ctx.out / EVAL_JSON).write_text(json.dumps({"skipped": why}) + "\n")
    return EvalResult(verdict="n/a", note=why)


# ------------------------------------------------------------------------------------------------------ baseline
def baseline_config(cfg):
    """The config the baseline repository is rendered with: the reference runtime in the build's compute dtype
    (``runtime.dtype``: the quantized model and its baseline compute alike),
    nothing quantized, the ``inflight_batcher_llm`` layout, this build's serving and build settings."""
    from pipeline import schema

    from pipeline.config import to_plain

    plain = to_plain(cfg)
    base = OmegaConf.structured(schema.PipelineConfig)
    merged = {
        "runtime": {"name": "reference", "dtype": plain["runtime"]["dtype"]},  # the build's compute dtype
        "quant": {"format": "none", "kv_cache": "none"},
        "target": {"name": plain["target"]["device"], "device": plain["target"]["device"],
                   "gpus_per_node": 1},
        "build": plain["build"],
        "serve": {**{k.split(".", 1)[1]: v for k, v in ((k, OmegaConf.select(cfg, k)) for k in
                                                        (*REPO_SERVE_KEYS, *LAUNCH_KEYS))},
                  "layout": "inflight_batcher_llm"},  # the front end's own settings; no key: served here alone
    }
    merged["serve"]["openai"] = {**merged["serve"]["openai"], "api_key_env": None, "model_name": None,
                                 "entry_point": "auto"}
    for key in ("runtime", "quant", "target", "build", "serve"):
        base[key] = OmegaConf.merge(OmegaConf.structured(schema.GROUPS[key]), merged[key])
    return base


def run_baseline(ctx: Context) -> EvalResult:
    from pipeline import planning
    from pipeline.triton import repository

    cfg = ctx.cfg
    if not list(cfg.eval.tasks):
        return _skipped(ctx, "eval.tasks is empty")
    bcfg = baseline_config(cfg)
    repo = ctx.out / "triton_repo"
    ctx.link_input("fetch", "", f"triton_repo/{ENGINE_REL}")
    s = planning.resolve(bcfg).settings
    cap = planning.CapacityView({"tp": 1, "pp": 1, "world": 1,
                                 "kv_tokens": int(s["max_batch_size"]) * int(s["max_seq_len"]), "settings": s})
    repository.render_repository(bcfg, repo, cap)
    serve = bcfg.serve
    if serve.launcher.value == "external":  # the external server serves the bundle; the baseline is served here
        serve = OmegaConf.merge(serve, {"launcher": "local"})
    doc = _evaluate_repo(ctx, repo, serve)  # its own repository, served by no other stage: a server of its own
    fetched = ctx.result("fetch")
    doc["checkpoint"] = {"model": cfg.model.name, "dtype": cfg.model.dtype.value, "fetch": ctx.inputs["fetch"].name,
                         "source_sha": fetched.resolved_sha or fetched.gguf_sha256}
    (ctx.out / EVAL_JSON).write_text(json.dumps(doc, indent=1) + "\n")
    scores = {n: _score(t) for n, t in doc["tasks"].items()}
    return EvalResult(verdict="n/a", lm_eval=doc["lm_eval"], wall_s=doc["wall_s"], scores=scores)


def _score(task: dict[str, Any]) -> dict[str, Any]:
    metric = ev.primary_metric(task)
    items = task["items"][metric]
    return {"metric": metric, "score": sum(items.values()) / max(1, len(items)), "items": len(items)}


BASELINE = Stage(
    name="eval_baseline",
    run=run_baseline,
    reads=("model.name", "model.dtype", "runtime.dtype", "target.device", "build", *REPO_SERVE_KEYS, *TASK_KEYS),
    unhashed_reads=(*LAUNCH_KEYS, *RUN_KEYS),
    inputs=("fetch",),
    libs=("lm_eval", "transformers", "torch", "tritonclient"),
    extra=task_extra,
    volatile=(EVAL_JSON, "lm-eval.log", "server.log", ev.FRONTEND_LOG),
    root="store",
    label=_label_baseline,
)


# ------------------------------------------------------------------------------------------------------ evaluate
def run(ctx: Context) -> EvalResult:
    cfg = ctx.cfg
    if not list(cfg.eval.tasks):
        return _skipped(ctx, "eval.tasks is empty")
    base_path = ctx.inputs["eval_baseline"] / EVAL_JSON
    baseline = json.loads(base_path.read_text())
    if "skipped" in baseline:
        raise StageFailed(f"the baseline at {base_path.parent} was skipped; re-run it (force=[eval_baseline])")
    repo = ctx.inputs["package"]
    doc = _evaluate_repo(ctx, repo, cfg.serve, ctx.shared)  # the bench's server and front end, when it just ran
    t0 = time.perf_counter()
    doc["gate"] = ev.gate(baseline, doc, cfg.eval, cfg.quant.format.value)
    doc["baseline"] = {"source": ctx.inputs["eval_baseline"].name, "checkpoint": baseline.get("checkpoint"),
                       "lm_eval": baseline.get("lm_eval"), "wall_s": baseline.get("wall_s")}
    doc["gate_s"] = round(time.perf_counter() - t0, 3)
    (ctx.out / EVAL_JSON).write_text(json.dumps(doc, indent=1) + "\n")
    (ctx.out / EVAL_MD).write_text(ev.markdown(cfg.model.name, cfg.quant.format.value, doc))
    g = doc["gate"]
    if g["verdict"] == "fail" or (g["verdict"] == "inconclusive" and g["strict"]):
        why = g["failures"] or g["inconclusive"]
        raise StageFailed(f"task gate {g['verdict']} ({cfg.quant.format.value} vs its unquantized baseline): "
                          + "; ".join(why))
    return eval_result(doc)


def eval_result(doc: dict[str, Any]) -> EvalResult:
    """The stage's typed result from eval.json: per task what bundle.json records."""
    g = doc["gate"]
    per_task = {}
    for name, t in g["tasks"].items():
        per_task[name] = {k: t[k] for k in ("metric", "baseline", "quantized", "difference", "ci_low", "ci_high",
                                            "confidence", "items", "max_drop", "verdict", "explanation")}
        if "mcnemar" in t:
            per_task[name]["mcnemar"] = t["mcnemar"]
    return EvalResult(verdict=g["verdict"], strict=g["strict"], lm_eval=doc["lm_eval"], wall_s=doc["wall_s"],
                      baseline_wall_s=doc["baseline"].get("wall_s"), endpoint=doc["endpoint"],
                      task_files=doc["task_files"], tasks=per_task, baseline=doc["baseline"]["source"])


def check(cfg) -> list[str]:
    """Plan-time: the format has an allowed drop, every task of the project's own is known."""
    problems = []
    if list(cfg.eval.tasks) and cfg.quant.format.value not in dict(cfg.eval.max_drop):
        problems.append(f"eval.max_drop has no entry for quant.format={cfg.quant.format.value}; add "
                        f"eval.max_drop.{cfg.quant.format.value}=0.05 (say)")
    for fmt, v in dict(cfg.eval.max_drop).items():
        if not 0.0 <= float(v) <= 1.0:
            problems.append(f"eval.max_drop.{fmt}={v}: an allowed drop of the task score lies in [0, 1]")
    return problems


def env_check(cfg) -> list[str]:
    """Plan-time: lm-eval's child can start here."""
    from pipeline.eval import env

    if not list(cfg.eval.tasks):
        return []
    p = env.problem()
    return [p] if p else []


STAGE = Stage(
    name="evaluate",
    run=run,
    check=check,
    env_check=env_check,
    reads=("model.name", "quant.format", "quant.kv_cache", "target.name", "target.device", "runtime.name",
           *TASK_KEYS, "eval.max_drop", "eval.confidence", "eval.resamples", "eval.strict", *REPO_SERVE_KEYS,
           *LAUNCH_KEYS),
    unhashed_reads=RUN_KEYS,
    inputs=("package", "eval_baseline"),
    serves=("package",),  # on the run's server: the bench serves the same repository
    libs=("lm_eval", "transformers", "tritonclient"),
    extra=task_extra,
    volatile=(EVAL_JSON, EVAL_MD, "lm-eval.log", "server.log", ev.FRONTEND_LOG),
    root="store",
    label=lambda cfg: ArtifactKey.of(cfg).label,
)
