"""What NVIDIA's performance model adds to a warm `plan`: the flagship's plan with the model off and on, alternating.

    python -m benchmarks plan_overhead [--repeat 3] [overrides ...]

Each run is the real CLI (`python -m pipeline plan ...`, default: qwen32b fp8 on h200, runtime trtllm_llmapi), with
``PIPELINE_PERFMODEL=off`` (the KV rule alone) and on (the service profile's sweep and the predictions, read from the
model's disk cache after one warm-up run). The target: at most 3 s more, warm.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from benchmarks._instrument import REPO
from benchmarks._provenance import commit_label

TITLE = "The performance model's cost in a warm `plan`"
DEFAULT = ["model=qwen32b", "quant=fp8", "target=h200", "runtime=trtllm_llmapi"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help=f"plan's overrides (default: {' '.join(DEFAULT)})")


def _plan(overrides: list[str], mode: str) -> float:
    env = {**os.environ, "PIPELINE_PERFMODEL": mode}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline", "plan", *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"plan failed ({mode}): {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return elapsed


def run(args) -> dict:
    overrides = list(args.overrides) or DEFAULT
    _plan(overrides, "on")  # warm-up: the model's cache and the OS page cache
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.repeat):
        for mode in ("off", "on"):
            times[mode].append(round(_plan(overrides, mode), 3))
    med = {m: statistics.median(t) for m, t in times.items()}
    return {"overrides": overrides, "repeat": args.repeat, "seconds": times, "median_s": med,
            "added_s": round(med["on"] - med["off"], 3), "load_1min": os.getloadavg()[0]}


def render(record: dict) -> list[str]:
    t, med = record["seconds"], record["median_s"]
    return [f"{record['date'][:16].replace('T', ' ')} UTC · commit {commit_label(record)} · {record['machine']} · "
            f"`plan {' '.join(record['overrides'])}`, {record['repeat']} runs each, alternating, after a warm-up; "
            f"load average {record['load_1min']:.1f} at the end (a shared machine).", "",
            "| performance model | median (s) | runs (s) |", "|---|---|---|",
            f"| off | {med['off']:.2f} | {', '.join(f'{x:.2f}' for x in t['off'])} |",
            f"| on (warm cache) | {med['on']:.2f} | {', '.join(f'{x:.2f}' for x in t['on'])} |", "",
            f"Added by the model, warm: {record['added_s']:+.2f} s (target: at most 3 s)."]
