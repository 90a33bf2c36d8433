"""What NVIDIA's performance model costs a `plan`: the flagship's plan cold (an empty answer cache: the model's process
starts, loads the GPU's tables and sweeps the profile), warm (every answer cached: no process), and a plan the model
has no part in (the same model on the reference runtime), alternating.

    python -m benchmarks plan_overhead [--repeat 3] [overrides ...]

Each run is the real CLI (`python -m pipeline plan ...`, default: qwen32b fp8 on h200, runtime trtllm_llmapi). A cold
run reaches the installed model through a fresh directory (``PIPELINE_PERFMODEL_ENV``, a link to it), whose answer
cache is empty. Targets: cold at most 3 s; warm within 1 s of the plan without the model.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._instrument import REPO
from benchmarks._provenance import commit_label

TITLE = "The performance model's cost in a `plan`"
DEFAULT = ["model=qwen32b", "quant=fp8", "target=h200", "runtime=trtllm_llmapi"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help=f"plan's overrides (default: {' '.join(DEFAULT)})")


def _plan(overrides: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline", "plan", *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"plan failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return elapsed


def run(args) -> dict:
    from pipeline import perfmodel

    if perfmodel.available():
        raise SystemExit(perfmodel.available())
    overrides = list(args.overrides) or DEFAULT
    without = [o for o in overrides if not o.startswith("runtime=")] + ["runtime=reference"]
    env = dict(os.environ)
    _plan(overrides, env)  # warm-up: the default answer cache and the OS page cache
    times: dict[str, list[float]] = {"cold": [], "warm": [], "without": []}
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "perfmodel").symlink_to(perfmodel.env_path(), target_is_directory=True)
            times["cold"].append(round(_plan(overrides, {**env, "PIPELINE_PERFMODEL_ENV": f"{d}/perfmodel"}), 3))
        times["warm"].append(round(_plan(overrides, env), 3))
        times["without"].append(round(_plan(without, env), 3))
    med = {m: statistics.median(t) for m, t in times.items()}
    return {"overrides": overrides, "repeat": args.repeat, "seconds": times, "median_s": med,
            "model": perfmodel.installed(), "load_1min": os.getloadavg()[0]}


def render(record: dict) -> list[str]:
    t, med = record["seconds"], record["median_s"]
    return [f"{record['date'][:16].replace('T', ' ')} UTC · commit {commit_label(record)} · {record['machine']} · "
            f"`plan {' '.join(record['overrides'])}` with {record['model']}, {record['repeat']} runs each, "
            f"alternating, after a warm-up; load average {record['load_1min']:.1f} at the end.", "",
            "| plan | median (s) | runs (s) |", "|---|---|---|",
            f"| cold: empty answer cache | {med['cold']:.2f} | {', '.join(f'{x:.2f}' for x in t['cold'])} |",
            f"| warm: every answer cached | {med['warm']:.2f} | {', '.join(f'{x:.2f}' for x in t['warm'])} |",
            f"| the model has no part (runtime=reference) | {med['without']:.2f} | "
            f"{', '.join(f'{x:.2f}' for x in t['without'])} |", "",
            f"Cold: {med['cold']:.2f} s (target: at most 3 s); warm: {med['warm'] - med['without']:+.2f} s over a "
            f"plan without the model."]
