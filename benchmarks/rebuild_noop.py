"""Full build vs. a rerun with nothing changed, side by side in one run; prepends the result to docs/benchmarks.md.

    python benchmarks/rebuild_noop.py                 # the embedded default (SmolLM2-135M, fp8, cpu, reference)
    python benchmarks/rebuild_noop.py model=tiny-qwen3

Both runs use the real CLI in a fresh output root. Target: the no-op rerun takes <= 3 s and <= 2% of the full run.
"""
from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _docfile import prepend

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"


def timed(args: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"pipeline {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return elapsed


def machine() -> str:
    return f"{platform.node()} · {os.cpu_count()} CPUs · {platform.processor() or platform.machine()} · " \
           f"Python {platform.python_version()}"


def commit() -> str:
    """The commit the source files (``_provenance.SOURCES``) belong to, ``-dirty`` when they differ from it; a
    changed doc or result file does not count."""
    from _provenance import source_state

    state = source_state()
    if not state["commit"]:
        return "unknown"
    return state["commit"][:7] + ("-dirty" if state["dirty"] else "")


def main() -> None:
    overrides = sys.argv[1:]
    with tempfile.TemporaryDirectory(prefix="noop-bench-") as root:
        args = ["build", *overrides, f"paths.root={root}"]
        full = timed(args)
        noop = [timed(args) for _ in range(3)]
    best = min(noop)
    section = f"""
## Rebuild with nothing changed (`benchmarks/rebuild_noop.py`)
{dt.date.today().isoformat()} · commit {commit()} · {machine()} · overrides: `{' '.join(overrides) or '(defaults)'}`

| run | wall time (s) |
|---|---|
| full build, empty output root (every stage runs) | {full:.1f} |
| rerun, nothing changed (best of 3: {', '.join(f'{t:.2f}' for t in noop)}) | {best:.2f} |

No-op rerun / full build = {100 * best / full:.2f}% (target ≤ 2% and ≤ 3 s: {'met' if best <= 3 and best / full <= 0.02 else 'NOT met'}).
The wall times include Python start-up and the CLI's imports; the full build includes model conversion, calibration,
server start-up and the smoke benchmark.
"""
    prepend(section)
    print(section)


if __name__ == "__main__":
    main()
