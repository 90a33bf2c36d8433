"""The bench stage: serve the packaged repository, check that the server serves it, run the answer checks and the
load, write the reports and gate."""
from __future__ import annotations

import contextlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pipeline.errors import StageFailed, UserError
from pipeline.identity import ArtifactKey
from pipeline.results import BenchResult
from pipeline.runner.contract import Context, Stage
from pipeline.runner import leases
from pipeline.stages.bench.gates import GATE_FIELDS, gates, previous_bench, summary_row
from pipeline.stages.bench.load import COUNTING, OPENAI_READS, OPENAI_UNHASHED, run_workloads
from pipeline.stages.bench.bench_md import against_prediction, markdown, plot
from pipeline.stages.bench.bench_md import note as report_note
from pipeline.triton import server as srv
from pipeline.triton.layouts import ENGINE_REL, ENTRY_POINTS  # the tokenizer lives with the engine in every layout
from pipeline.ui import status

log = logging.getLogger(__name__)


def choose_entry(choice: str, layout: str, entry_points: list[str] | tuple[str, ...] | None = None) -> str:
    """The model the load goes through: ``bench.model`` (``auto``: the layout's first entry point). A choice the
    layout lacks is a :class:`UserError` naming the ones it has."""
    have = list(entry_points or ENTRY_POINTS.get(layout, ()))
    if layout not in ENTRY_POINTS or not have:
        raise UserError(f"the packaged repository has layout '{layout}', which the bench cannot drive "
                        f"(it drives: {', '.join(ENTRY_POINTS)})")
    if choice == "auto":
        return have[0]
    if choice not in have:
        raise UserError(f"bench.model={choice}: the {layout} layout has no such entry point (it has: "
                        f"{', '.join(have)}); set bench.model=auto")
    return choice


def _layout_of(cfg) -> str | None:
    from pipeline.triton import repository

    try:
        return repository.layout(cfg)
    except UserError:  # package reports a layout that cannot serve the runtime itself
        return None


def packaged_configs(repo: Path) -> dict[str, Any]:
    """{model name: its parsed config.pbtxt} for every model of the packaged repository."""
    from pipeline.triton.render import parse_model_config

    return {p.parent.name: parse_model_config(p.read_text(), name=f"{p.parent.name}/config.pbtxt")
            for p in sorted(repo.glob("*/config.pbtxt"))}


def run(ctx: Context) -> BenchResult:
    from transformers import AutoTokenizer

    from pipeline.stages.bench import triton_client

    cfg = ctx.cfg
    repo = ctx.inputs["package"]
    pkg = ctx.result("package")
    layout = pkg.layout
    entry_model = choose_entry(str(cfg.bench.model), layout, pkg.entry_points)
    tok = AutoTokenizer.from_pretrained(repo / ENGINE_REL)
    packaged = packaged_configs(repo)
    baseline = previous_bench(ctx)
    result: dict[str, Any] = {"model": entry_model, "layout": layout, "launcher": cfg.serve.launcher.value,
                              "runtime": cfg.runtime.name.value,
                              "counting": COUNTING, "workloads": {}, "answers": []}
    requests: list[dict[str, Any]] = []
    started = time.perf_counter()
    writer = ThreadPoolExecutor(1, thread_name_prefix="bench-reports")
    reports = None
    lease = None
    try:
        with contextlib.ExitStack() as stack:  # a server of its own is stopped on every exit path; the run's is kept
            with status(f"starting tritonserver ({cfg.serve.launcher.value}; loading models)"):
                lease = stack.enter_context(leases.triton(ctx.shared, cfg.serve, repo, ctx.paths["store"] / "servers",
                                                          "bench"))
            server = lease.value
            result["server_start_s"] = round(time.perf_counter() - started, 2)
            result["server"] = srv.describe(server, cfg.serve)  # what the bundle records it was benched on
            result["server_shared"] = {"started_by_this_stage": lease.started, "stages": lease.by}
            mismatches = triton_client.server_model_mismatches(server.grpc_url, packaged)
            if mismatches:
                more = f" (+{len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
                what = (f"the server at {server.grpc_url} does not serve this package's repository: "
                        f"{mismatches[0]}{more}")
                if cfg.serve.launcher.value == "external":
                    raise UserError(f"{what}; point serve.url at a server of {repo}")
                raise StageFailed(what)
            try:
                entry = triton_client.entry_point(server.grpc_url, entry_model, layout)
            except ValueError as exc:
                raise StageFailed(str(exc)) from exc
            result["decoupled"] = entry.decoupled
            run_workloads(ctx, lease, entry, tok, result, requests)
            # measured: the plot needs only the measurements; it is drawn while the server shuts down
            reports = writer.submit(_measurement_reports, ctx.out, result, bool(cfg.bench.plot))
    except srv.ServerError as exc:
        (ctx.out / "server-error.txt").write_text(str(exc) + "\n")
        raise StageFailed(str(exc).splitlines()[0] + " (server log tail: server-error.txt)") from exc
    finally:
        writer.shutdown(wait=True)
        if lease is not None:
            lease.copy_log(ctx.out / "server.log")
    reports.result()  # raises what the writer raised

    result["gates"] = gates(cfg, result, baseline)
    result["note"] = report_note(result)  # the reference runtime: the serving path, not a performance measurement
    summary = ctx.capacity.summary if ctx.capacity is not None else None
    vs = against_prediction(result, ((summary or {}).get("serving") or {}).get("predictions"),
                            int((summary or {}).get("gpus") or 1))
    if vs is not None:
        result["against_prediction"] = vs
        for w in vs["warnings"]:
            log.warning("bench vs prediction: %s", w)
    (ctx.out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (ctx.out / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    (ctx.out / "bench.md").write_text(markdown(cfg.model.name, result))
    failed = [a for a in result["answers"] if not a["pass"]]
    why = [f"answer check failed: {a['prompt']!r} -> {a['text']!r} (expected {a['expect']})" for a in failed]
    why += result["gates"]["breaches"]
    if why:
        raise StageFailed("; ".join(why))
    return bench_result(result)


def _measurement_reports(out: Path, result: dict[str, Any], with_plot: bool) -> None:
    """The plot: it reads the measurements only."""
    if with_plot:
        plot(result, out / "bench.png")


def bench_result(result: dict[str, Any]) -> BenchResult:
    """The stage's typed result from bench.json's content: the rows of every level and the gates (without checks)."""
    return BenchResult(
        model=result["model"], layout=result["layout"],
        workloads={w: [summary_row(lv) for lv in r["levels"]] for w, r in result["workloads"].items()},
        answers_passed=sum(1 for a in result["answers"] if a["pass"]), answers=len(result["answers"]),
        gates={k: result["gates"][k] for k in GATE_FIELDS})


def check(cfg) -> list[str]:
    """Plan time: the entry points named (``bench.model``; ``serve.openai.entry_point`` when the bench goes through the
    front end) must be the layout's that the package stage will write."""
    from pipeline.triton import layouts

    problems = []
    lay = _layout_of(cfg)
    if lay is None:
        return problems
    try:
        choose_entry(str(cfg.bench.model), lay)
    except UserError as exc:
        problems.append(str(exc))
    entry = str(cfg.serve.openai.entry_point)
    if cfg.bench.get("openai", False) and entry != "auto":
        try:
            layouts.get(lay).check_entry(entry)
        except UserError as exc:
            problems.append(str(exc))
    return problems


def env_check(cfg) -> list[str]:
    """Before any work starts, on this machine: aiperf where the bench runs it, and the server binary
    (serve.launcher=local)."""
    problems = []
    if cfg.bench.get("openai", False) and cfg.bench.get("aiperf", False):
        import importlib.util

        if importlib.util.find_spec("aiperf") is None:
            problems.append("bench.aiperf=true: aiperf is not installed (it writes the bench's aiperf export); "
                            "install it (pip install 'aiperf>=0.13') or set bench.aiperf=false")
    if cfg.serve.launcher.value == "local":
        try:
            srv.find_server(cfg.serve.server_bin)
        except UserError as exc:
            problems.append(str(exc))
    return problems


STAGE = Stage(
    check=check,
    env_check=env_check,
    volatile=("bench.json", "bench.md", "bench.png", "server.log", "requests.jsonl", "openai-front-end.log"),
    name="bench",
    run=run,
    reads=("bench", "model.name", "model.checks", "model.chat_template", "quant.format", "quant.kv_cache",
           "target.name", "target.device", "runtime.name", "serve.host", "serve.server_bin",
           "serve.startup_timeout_s", "serve.launcher", "serve.image", "serve.url", "serve.repo_mount",
           *OPENAI_READS),
    # the regression baseline: the bundle published there under this build's label (the recipe is part of it;
    # bench.json, volatile); where the front end listens
    unhashed_reads=("publish.dest", "quant.recipe", *OPENAI_UNHASHED),
    # the serving plan's predictions (a TensorRT-LLM bench is held against them at the same concurrency) and GPUs
    capacity=("summary",),
    inputs=("package",),
    serves=("package",),  # on the run's server: the task evaluation serves the same repository
    libs=("tritonclient", "nvidia-pytriton", "transformers", "aiperf"),
    root="store",
    label=lambda cfg: ArtifactKey.of(cfg).label,
)
