"""Task evaluation of served models: lm-evaluation-harness through the OpenAI front end, and the paired gate.

- :mod:`pipeline.eval.tasks`: the project's offline tasks (``pipeline/eval/tasks/*.yaml`` + ``*.jsonl``) and the
  digests of the task files that enter the fingerprints.
- :mod:`pipeline.eval.harness`: lm-eval in a child process against ``/v1/completions`` (log-likelihood tasks) and
  ``/v1/chat/completions`` (generative tasks); per-item scores.
- :mod:`pipeline.eval.stats`: the paired bootstrap interval, McNemar's test and the verdict.
- :mod:`pipeline.eval.env`: the numpy 2 overlay lm-eval's child needs on a numpy<2 environment.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from pipeline.catalog import ENGINE_REL  # the tokenizer lives with the checkpoint in every layout
from pipeline.errors import StageFailed
from pipeline.eval import stats, tasks


def _overlay_path() -> list[str]:
    """The numpy 2 overlay's path entries (:mod:`pipeline.eval.env`, imported here and not at the package's import, so
    that ``python -m pipeline.eval.env`` runs a module not imported before)."""
    from pipeline.eval import env

    return env.pythonpath()

EVAL_JSON = "eval.json"
FRONTEND_LOG = "frontend.log"


@contextlib.contextmanager
def served(serve, repo: Path, work: Path, timings: dict[str, Any] | None = None, *, shared=None,
           stage: str = "evaluate") -> Iterator[tuple[Any, Any]]:
    """Triton serving ``repo`` (``serve.launcher``: local, docker, or the server at ``serve.url``) with the OpenAI
    front end before it; yields the two leases (``pipeline.runner.leases.Lease``: the server, and the front end's
    base URL ``http://HOST:PORT/v1``). With the run's ``shared`` scope, the front end is ``python -m
    pipeline.serving`` in a process of its own (as the bench runs it), and a server and front end an earlier stage
    started for the same repository are reused; the run stops them. Without one, the front end runs in a thread of
    this process (the quickest to start) and everything started here is stopped on every exit path. ``timings``
    gets the seconds each step took (``server_start_s``, ``frontend_start_s``, ``stop_s``) and whether this stage
    started them."""
    from pipeline.eval import endpoint
    from pipeline.runner import leases
    from pipeline.ui import status

    timings = {} if timings is None else timings
    stopping: list[float] = []
    with contextlib.ExitStack() as stack:
        # the first callback registered runs last: after the front end and the server stopped (or were kept)
        stack.callback(lambda: stopping and timings.update(stop_s=round(time.perf_counter() - stopping[0], 2)))
        with status(f"starting tritonserver ({serve.launcher.value}; loading models)"):
            server = stack.enter_context(leases.triton(shared, serve, repo, work, stage))
        with status("starting the OpenAI front end"):
            if shared is None:
                t1 = time.perf_counter()
                url = stack.enter_context(endpoint.openai(serve, server.value, repo, work))
                leases.log.info("OpenAI front end started for %s (%s, in this process) by %s in %.1f s", repo, url,
                                stage, time.perf_counter() - t1)
                stack.callback(leases.log.info, "OpenAI front end stopped for %s", repo)
                front = leases.Lease(url, None, True, round(time.perf_counter() - t1, 2), 0, [stage])
            else:
                settings = leases.front_settings(serve.openai, repo)
                front = stack.enter_context(leases.front_end(shared, server, settings, repo, work, stage))
        timings.update(server_start_s=server.wait_s, frontend_start_s=front.wait_s,
                       server_started_by_this_stage=server.started, frontend_started_by_this_stage=front.started)
        try:
            yield server, front
        finally:
            stopping.append(time.perf_counter())


def evaluate_repo(repo: Path, serve, ecfg, out: Path, work: Path, *, shared=None,
                  stage: str = "evaluate") -> dict[str, Any]:
    """The tasks of ``ecfg`` against the model repository ``repo`` served with ``serve`` through the OpenAI front
    end (the run's, with ``shared``: see :func:`served`); lm-eval's log, the server's and the front end's (the part
    written while this stage used them) go to ``out``. -> the harness's document plus where it ran."""
    from pipeline.eval import endpoint
    from pipeline.ui import status

    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, Any] = {}
    leases: list[Any] = []

    def front_log() -> Path:  # a front end in a process of its own: the part of its log written meanwhile
        if len(leases) > 1:
            leases[1].copy_log(out / FRONTEND_LOG)
        return out / FRONTEND_LOG

    # a front end in this process: its log records, written while the block runs
    with frontend_log(out / FRONTEND_LOG) if shared is None else contextlib.nullcontext():
        try:
            with served(serve, repo, work, timings, shared=shared, stage=stage) as (server, front):
                leases[:] = [server, front]
                url = front.value
                key = endpoint.api_key(serve)
                model = endpoint.model_name(url, key)
                with status(f"lm-eval: {', '.join(ecfg.tasks)} via {url}"):
                    doc = run_harness(url, model, repo / ENGINE_REL, ecfg, out, api_key=key, frontend_log=front_log)
                doc.update(endpoint=url, served_model=model, launcher=serve.launcher.value)
        finally:
            if leases:
                leases[0].copy_log(out / "server.log")
                front_log()
    doc["timings"] = {**timings, "lm_eval_s": doc["wall_s"], **doc.pop("harness_timings", {})}
    return doc


@contextlib.contextmanager
def frontend_log(path: Path) -> Iterator[Path]:
    """The OpenAI front end's log records (every error it answers: server faults, refused requests) also written
    to ``path`` while the block runs."""
    import logging

    logger = logging.getLogger("pipeline.serving")
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    handler.setLevel(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield path
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


def run_harness(base_url: str, model: str, tokenizer: Path, ecfg, work: Path, *, api_key: str | None = None,
                frontend_log: Path | Callable[[], Path] | None = None) -> dict[str, Any]:
    """lm-eval's tasks ``ecfg.tasks`` against the OpenAI endpoint ``base_url`` (``http://HOST:PORT/v1``), model
    ``model``, tokenized with ``tokenizer``; its log goes to ``work/lm-eval.log``. ``api_key`` reaches lm-eval as
    ``OPENAI_API_KEY`` (which its local models send as a Bearer token), in the child's environment only.
    When lm-eval fails, the error names its cause (:func:`failure` : the first failed request, with what the front
    end's log ``frontend_log`` says of it; a callable writes that log and returns its path). -> the harness's
    document."""
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="eval-tasks-") as include:
        spec = {"base_url": base_url, "model": model, "tokenizer": str(tokenizer), "tasks": list(ecfg.tasks),
                "limit": ecfg.limit, "num_fewshot": ecfg.num_fewshot, "seed": int(ecfg.seed),
                "concurrency": int(ecfg.concurrency), "max_length": int(ecfg.max_length),
                "timeout_s": float(ecfg.request_timeout_s), "include_path": str(tasks.include_dir(Path(include))),
                "include_defaults": bool(set(ecfg.tasks) - set(tasks.builtin()))}
        spec_path, out_path, log_path = work / "harness-spec.json", work / "harness-out.json", work / "lm-eval.log"
        spec_path.write_text(json.dumps(spec, indent=1) + "\n")
        child_env = dict(os.environ)
        child_env["PYTHONPATH"] = os.pathsep.join(
            [*_overlay_path(), str(Path(__file__).resolve().parents[2]),
             *([child_env["PYTHONPATH"]] if child_env.get("PYTHONPATH") else [])])
        child_env.pop("OPENAI_API_KEY", None)
        if api_key:
            child_env["OPENAI_API_KEY"] = api_key
        child_env.update({"TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_CACHE": str(Path(include) / "datasets-cache")})
        if not spec["include_defaults"]:  # the project's own tasks only: nothing to fetch
            child_env.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
        t0 = time.perf_counter()
        with open(log_path, "w") as log:
            try:
                proc = subprocess.run([sys.executable, "-m", "pipeline.eval.harness", str(spec_path), str(out_path)],
                                      stdout=log, stderr=subprocess.STDOUT, env=child_env, cwd=work,
                                      timeout=float(ecfg.timeout_s))
            except subprocess.TimeoutExpired as exc:
                raise StageFailed(f"lm-eval did not finish within eval.timeout_s={ecfg.timeout_s:g} s "
                                  f"(log: {log_path})") from exc
        if proc.returncode != 0 or not out_path.is_file():
            if callable(frontend_log):
                frontend_log = frontend_log()
            raise StageFailed(f"lm-eval failed against {base_url} (exit {proc.returncode}): "
                              f"{failure(log_path, frontend_log)} (log: {log_path})")
        doc = json.loads(out_path.read_text())
        doc["wall_s"] = round(time.perf_counter() - t0, 2)
        spec_path.unlink()
        out_path.unlink()
        return doc


def failure(log_path: Path, frontend_log: Path | None = None) -> str:
    """Why lm-eval failed: the cause its log shows (``harness.failure_cause``), else the log's last lines; and the
    first error the front end logged, when it logged one."""
    from pipeline.eval import harness

    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    cause = harness.failure_cause(text)
    if cause is None:
        cause = " | ".join([ln for ln in text.splitlines() if ln.strip()][-3:])[-600:] or "no output"
    if frontend_log is not None and frontend_log.is_file():
        errors = [ln.split(" ERROR ", 1)[1] for ln in frontend_log.read_text(errors="replace").splitlines()
                  if " ERROR " in ln]
        if errors:
            cause += f"; the front end's first error: {errors[0][:500]}"
    return cause


def primary_metric(task: dict[str, Any]) -> str:
    """The metric a task is gated on: ``acc`` when it has one, else its first metric."""
    metrics = task.get("metrics") or []
    if not metrics:
        raise StageFailed("lm-eval returned no per-item scores for a task; is it a task with per-item metrics?")
    return "acc" if "acc" in metrics else metrics[0]


def gate(baseline: dict[str, Any], quantized: dict[str, Any], ecfg, quant_format: str) -> dict[str, Any]:
    """The paired gate of every task: {"verdict", "tasks": {name: stats.compare(...) + metric}, "failures",
    "inconclusive"}. The overall verdict is ``fail`` when a task fails, ``inconclusive`` when none fails and one is
    inconclusive, else ``pass``."""
    max_drop = dict(ecfg.max_drop)
    if quant_format not in max_drop:
        raise StageFailed(f"eval.max_drop has no entry for quant.format={quant_format}; add "
                          f"eval.max_drop.{quant_format}=0.05 (say)")
    out: dict[str, Any] = {}
    for name, q in quantized["tasks"].items():
        b = baseline["tasks"].get(name)
        if b is None:
            raise StageFailed(f"the baseline has no result for task {name}; re-run it (force=[eval_baseline])")
        metric = primary_metric(q)
        try:
            r = stats.compare(b["items"][metric], q["items"][metric], max_drop=float(max_drop[quant_format]),
                              confidence=float(ecfg.confidence), resamples=int(ecfg.resamples), seed=int(ecfg.seed))
        except ValueError as exc:
            raise StageFailed(f"task {name}: {exc}") from exc
        out[name] = {"metric": metric, **r}
    verdicts = [t["verdict"] for t in out.values()]
    overall = "fail" if "fail" in verdicts else "inconclusive" if "inconclusive" in verdicts else "pass"
    return {"verdict": overall, "strict": bool(ecfg.strict), "tasks": out,
            "failures": [f"{n}: {t['explanation']}" for n, t in out.items() if t["verdict"] == "fail"],
            "inconclusive": [f"{n}: {t['explanation']}" for n, t in out.items() if t["verdict"] == "inconclusive"]}


def markdown(model: str, quant: str, doc: dict[str, Any]) -> str:
    """eval.md: the task table."""
    g = doc["gate"]
    lines = [f"# evaluate: {model} {quant} vs its unquantized baseline", "",
             f"lm-eval {doc['lm_eval']} through the OpenAI front end ({doc['endpoint']}); baseline: "
             f"{doc['baseline']['source']}. Gate: **{g['verdict']}**"
             + (" (strict: inconclusive fails)" if g["strict"] else ""), "",
             "| task | metric | items | baseline | quantized | difference | CI | allowed drop | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, t in g["tasks"].items():
        lines.append(f"| {name} | {t['metric']} | {t['items']} | {t['baseline']:.4f} | {t['quantized']:.4f} | "
                     f"{t['difference']:+.4f} | [{t['ci_low']:+.4f}, {t['ci_high']:+.4f}] | {t['max_drop']:g} | "
                     f"{t['verdict']} |")
    lines.append("")
    for name, t in g["tasks"].items():
        extra = ""
        if "mcnemar" in t:
            m = t["mcnemar"]
            extra = f"; McNemar: {m['lost']} lost, {m['gained']} gained, p={m['p_value']:.3g}"
        lines.append(f"- {name}: {t['explanation']}{extra}")
    lines += ["", f"Intervals: {stats.METHOD}, {g['tasks'][next(iter(g['tasks']))]['resamples']} resamples, seed "
              f"{g['tasks'][next(iter(g['tasks']))]['seed']}." if g["tasks"] else "",
              "Task files: " + ", ".join(f"`{k}` {v[:12]}" for k, v in doc["task_files"].items())]
    return "\n".join(lines) + "\n"
