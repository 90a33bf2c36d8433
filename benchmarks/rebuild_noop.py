"""Full build vs. a rerun with nothing changed, side by side in one run.

    python -m benchmarks rebuild_noop                  # the embedded default (SmolLM2-135M, fp8, cpu, reference)
    python -m benchmarks rebuild_noop model=tiny-qwen3

Both runs use the real CLI (``python -m pipeline build``) in a fresh output root; the rerun is timed three times and
the best counts. Target: the no-op rerun takes <= 3 s and <= 2% of the full run.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

from benchmarks._instrument import REPO
from benchmarks._provenance import commit_label

TITLE = "Rebuild with nothing changed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for `python -m pipeline build`")


def timed(args: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"pipeline {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return elapsed


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="noop-bench-") as root:
        argv = ["build", *args.overrides, f"paths.root={root}"]
        full = timed(argv)
        noop = [timed(argv) for _ in range(3)]
    return {"overrides": args.overrides, "full_s": full, "noop_s": noop}


def render(record: dict) -> list[str]:
    full, noop = record["full_s"], record["noop_s"]
    best = min(noop)
    met = best <= 3 and best / full <= 0.02
    return [f"{record['date'][:10]} · commit {commit_label(record)} · {record['machine']} · overrides: "
            f"`{' '.join(record['overrides']) or '(defaults)'}`", "",
            "| run | wall time (s) |", "|---|---|",
            f"| full build, empty output root (every stage runs) | {full:.1f} |",
            f"| rerun, nothing changed (best of 3: {', '.join(f'{t:.2f}' for t in noop)}) | {best:.2f} |", "",
            f"No-op rerun / full build = {100 * best / full:.2f}% (target ≤ 2% and ≤ 3 s: "
            f"{'met' if met else 'NOT met'}). The wall times include Python start-up and the CLI's imports; the full "
            f"build includes model conversion, calibration, server start-up and the smoke benchmark."]
