"""`pipeline validate` with NVIDIA's performance model installed: every shipped combination composed and planned,
cold (an empty answer cache: the model processes load each GPU's tables and sweep every TensorRT-LLM
combination's profile) and warm.

    python -m benchmarks validate_cost [--repeat 1]

Each run is the real CLI (`python -m pipeline validate --json`). Target: cold at most 90 s on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._instrument import REPO
from benchmarks._provenance import commit_label

TITLE = "`validate` with the performance model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=1)


def _validate(env: dict[str, str]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline", "validate", "--json"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"validate failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    doc = json.loads(proc.stdout)
    return elapsed, {k: doc[k] for k in ("combinations", "failing", "refused")}


def run(args) -> dict:
    from pipeline import perfmodel

    if perfmodel.available():
        raise SystemExit(perfmodel.available())
    times: dict[str, list[float]] = {"cold": [], "warm": []}
    counts = {}
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "perfmodel").symlink_to(perfmodel.env_path(), target_is_directory=True)
            env = {**os.environ, "PIPELINE_PERFMODEL_ENV": f"{d}/perfmodel"}
            cold, counts = _validate(env)
            answers = sum(1 for _ in (Path(d) / "perfmodel-cache").rglob("*.json"))
            warm, _ = _validate(env)
        times["cold"].append(round(cold, 1))
        times["warm"].append(round(warm, 1))
    return {"repeat": args.repeat, "seconds": times, "counts": counts, "answers": answers,
            "model": perfmodel.installed(), "load_1min": os.getloadavg()[0]}


def render(record: dict) -> list[str]:
    t, c = record["seconds"], record["counts"]
    return [f"{record['date'][:16].replace('T', ' ')} UTC · commit {commit_label(record)} · {record['machine']} · "
            f"{c['combinations']} combinations ({c['refused']} refused by the rules, {c['failing']} failing), "
            f"{record['answers']:,} distinct model answers, {record['model']}; load average {record['load_1min']:.1f} "
            f"at the end.", "",
            "| validate | runs (s) |", "|---|---|",
            f"| cold: empty answer cache | {', '.join(f'{x:.1f}' for x in t['cold'])} |",
            f"| warm | {', '.join(f'{x:.1f}' for x in t['warm'])} |", "",
            f"Cold: {min(t['cold']):.1f} s (target: at most 90 s on 2 cores)."]
