"""How long the default evaluation tasks take: the eval_baseline and evaluate stages, measured fresh.

    python -m benchmarks eval_tasks                              # SmolLM2 (the default model) on this machine
    python -m benchmarks eval_tasks --shape 4b --out $OUT        # a CUDA machine: Qwen3-4B's shape, fp8 for h200
    python -m benchmarks eval_tasks --root /data/ev -- eval.concurrency=4 ...   # extra overrides after --
    python -m benchmarks eval_tasks render benchmarks/results/eval_tasks-*.json   # print those records' blocks

Runs ``python -m pipeline build until=bench`` first (earlier stages cached or run, unmeasured), then
``python -m pipeline build until=evaluate force=[eval_baseline,evaluate]``, and reads both stages' manifests and
``eval.json``: the stage's wall time (server start, front end, lm-eval and the gate), lm-eval's own wall time, items
and requests (four per item for the multiple-choice task), the scores and the gate. The machine's load average is
recorded before and after: on a shared machine the figures are upper bounds.

``--shape 4b`` (``benchmarks/gpu_e2e.py``'s SHAPES) evaluates a seeded random model of Qwen3-4B's shape with the
synthetic tokenizer (65,536 tokens), served by the reference runtime on ``target.device`` (cuda for h200): the
timing is the point; random weights score about chance (0.25) and make no accuracy claim, so the gate's allowed drop
is set to 1 there, and the bench before it runs one request (it is not measured here).

The raw record is ``benchmarks/results/eval_tasks-<date>-<commit>-<host>-<model>.json``; with ``--out DIR`` it goes to
DIR alone (a device run's ``$OUT``; copy it into ``benchmarks/results/`` here), and when a stage fails, its logs
(lm-eval's, the front end's, Triton's) are copied there too. A failed run's record states its ``error`` (exit 1) and is
never the page's current figure. The page keeps one current record per model and device.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._instrument import REPO
from benchmarks._provenance import commit_label

TITLE = "Task evaluation time: the default tasks, baseline and quantized"

# The bench stage runs before evaluate (stage order) but is not measured here: one request.
QUICK_BENCH = ["bench.concurrency=[1]", "bench.requests_per_level=1", "bench.warmup_requests=0", "bench.only=[chat]",
               "bench.openai=false", "bench.plot=false"]
SYNTHETIC_NOTE = ("synthetic weights (seeded, random) and the synthetic tokenizer: scores are about chance (0.25) "
                  "and make no accuracy claim; eval.max_drop.{fmt}=1 so the gate cannot fail on them")


def shape_overrides(shape: str, fmt: str, target: str) -> list[str]:
    """The pipeline overrides for a synthetic model of ``shape`` (``benchmarks/gpu_e2e.py``'s), its bench cut to one
    request, and an allowed drop that random weights cannot breach."""
    from benchmarks.gpu_e2e import overrides

    model = (["model=tiny-qwen3", f"quant={fmt}", "quant.gate=warn", f"target={target}", "runtime=reference"]
             if shape == "tiny" else [o for o in overrides(shape, fmt, target) if not o.startswith("bench.")])
    return model + QUICK_BENCH + [f"eval.max_drop.{fmt}=1"]


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "numpy", "lm_eval", "nvidia-pytriton", "tritonclient"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _gpu() -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def measure(root: Path, overrides: list[str], shape: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    prep = [sys.executable, "-m", "pipeline", "build", "until=bench", f"paths.root={root}", *overrides]
    t0 = time.perf_counter()
    p = subprocess.run(prep, cwd=root, env=env, capture_output=True, text=True)
    prep_s = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"preparing the build failed:\n{p.stderr[-3000:]}")
    load_before = os.getloadavg()
    cmd = [sys.executable, "-m", "pipeline", "build", "until=evaluate", "force=[eval_baseline,evaluate]",
           f"paths.root={root}", *overrides]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    load_after = os.getloadavg()
    reports = sorted((root / "reports").glob("*.json"), key=lambda f: f.stat().st_mtime)
    rep = json.loads(reports[-1].read_text())
    rows = {r["stage"]: r for r in rep["stages"]}
    out = {"host": platform.node(), "cpus": os.cpu_count(), "gpu": _gpu(), "python": platform.python_version(),
           "versions": _versions(), "shape": shape, "prepare_s": round(prep_s, 1),
           "overrides": overrides, "model": rep["model"], "quant": rep["quant"], "target": rep["target"],
           "returncode": p.returncode, "command_wall_s": round(wall, 1),
           "load_avg_before": [round(x, 2) for x in load_before], "load_avg_after": [round(x, 2) for x in load_after],
           "stages": {}}
    for name in ("eval_baseline", "evaluate"):
        r = rows.get(name)
        if r is None:
            continue
        doc = json.loads((Path(r["output"]) / "eval.json").read_text()) if (Path(r["output"]) / "eval.json").is_file() else {}
        tasks = {}
        for task, t in (doc.get("tasks") or {}).items():
            items = t["items"].get("acc") or next(iter(t["items"].values()))
            tasks[task] = {"items": len(items), "score": sum(items.values()) / max(1, len(items)),
                           "output_types": t.get("output_types")}
        out["stages"][name] = {"stage_wall_s": r.get("stage_wall_s"), "lm_eval_wall_s": doc.get("wall_s"),
                               "concurrency": doc.get("concurrency"), "tasks": tasks, "timings": doc.get("timings")}
        if name == "evaluate" and "gate" in doc:
            out["gate"] = {k: {f: v[f] for f in ("baseline", "quantized", "difference", "ci_low", "ci_high",
                                                 "verdict")} for k, v in doc["gate"]["tasks"].items()}
    if p.returncode:
        out["error"] = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "failed"
    return out


FAILURE_LOGS = ("lm-eval.log", "frontend.log", "server.log", "server-error.txt", "harness-spec.json")


def failure_logs(root: Path, dest: Path) -> list[str]:
    """The logs of every failed evaluation stage under ``root`` (its kept reports) copied to ``dest/<report>/``;
    -> the copied paths, relative to ``dest``."""
    import shutil

    copied = []
    for rep in sorted((root / "reports" / "failed").glob("*eval*")):
        for name in FAILURE_LOGS:
            if (rep / name).is_file():
                (dest / rep.name).mkdir(parents=True, exist_ok=True)
                shutil.copy2(rep / name, dest / rep.name / name)
                copied.append(f"{rep.name}/{name}")
    return copied


def variant(record: dict) -> str:
    return f"{record['model']} on {record.get('gpu') or 'CPU'}"


def suffix(record: dict) -> str:
    return f"{record['host']}-{record['model']}"


def render(record: dict) -> list[str]:
    r = record
    lines = [f"{r['date'][:10]} · commit {commit_label(r)} · {r['host']} · {r['cpus']} CPUs"
             + (f" · {r['gpu']}" if r.get("gpu") else "") + f" · Python {r['python']}", "",
             "Each stage serves its model on a real tritonserver behind the OpenAI front end and runs lm-eval "
             "(`local-completions`, echo + logprobs) over every item; stage time includes the server start and stop.",
             ""]
    if r.get("note"):
        lines += [f"{r['model']} ({r.get('shape')} shape): {r['note']}.", ""]
    lines += ["| model | quant | target | stage | items | lm-eval s | stage s | score | load avg before → after |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, s in r["stages"].items():
        for task, t in s["tasks"].items():
            lines.append(f"| {r['model']} | {r['quant'] if name == 'evaluate' else 'none (baseline)'} | "
                         f"{r['target']} | {name} ({task}) | {t['items']} | {s['lm_eval_wall_s']} | "
                         f"{s['stage_wall_s']} | {t['score']:.4f} | {r['load_avg_before'][0]} → "
                         f"{r['load_avg_after'][0]} |")
    for name, s in r["stages"].items():
        t = s.get("timings")
        if t:
            lines += ["", f"Where {name}'s time went ({r['model']}): tritonserver start {t.get('server_start_s')} s, "
                      f"front end start {t.get('frontend_start_s')} s, lm-eval {t.get('lm_eval_s')} s (its "
                      f"imports {t.get('import_s')} s, tasks {t.get('tasks_load_s')} s, requests and scoring "
                      f"{t.get('evaluate_s')} s), stop {t.get('stop_s')} s."]
    for task, g in (r.get("gate") or {}).items():
        lines += ["", f"Gate ({r['model']} {r['quant']}, {task}): difference {g['difference']:+.4f}, CI "
                      f"[{g['ci_low']:+.4f}, {g['ci_high']:+.4f}]: {g['verdict']}."]
    if r.get("error"):
        lines += ["", f"Run failed: {r['error']}"]
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", type=Path, help="output root (default: a new temp directory)")
    parser.add_argument("--shape", choices=("4b", "14b", "32b", "tiny"),
                        help="a synthetic model of this shape (benchmarks/gpu_e2e.py; tiny: the test model, a smoke "
                             "run)")
    parser.add_argument("--quant", default="fp8", help="with --shape: the format (default fp8)")
    parser.add_argument("--target", default="h200", help="with --shape: the target (default h200, device cuda)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides after --")


def run(args) -> dict:
    import tempfile

    root = args.root or Path(tempfile.mkdtemp(prefix="eval-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    overrides = (shape_overrides(args.shape, args.quant, args.target) if args.shape else []) + list(args.overrides)
    out = measure(root, overrides, args.shape)
    if args.shape:
        out["note"] = SYNTHETIC_NOTE.format(fmt=args.quant)
    if out["returncode"]:
        # the failed stages' logs come back with a device run's $OUT; here they stay under the root
        out["failure_logs"] = failure_logs(root, args.out_dir) if args.out_dir else [
            str(p) for p in sorted((root / "reports" / "failed").glob("*eval*/*.log"))]
    return out
