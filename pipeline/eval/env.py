"""The evaluation overlay: numpy 2 for lm-eval's child process on an environment that keeps numpy below 2.

lm-eval reads its tasks' data through ``datasets``, whose ``pyarrow`` (24 and newer) refuses numpy below 2 at import
("pyarrow requires NumPy 2.0 or newer"). The CPU environment keeps numpy<2 for the bundled Triton server
(``nvidia-pytriton`` pins it). The overlay is a directory holding numpy 2 alone; the evaluation child puts it first
on ``PYTHONPATH``, and everything else comes from the running environment. Environments with numpy 2 (GPU hosts)
need none of it.

    python -m pipeline.eval.env [--find-links DIR]      # make it (offline: from a wheelhouse)
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from pipeline import overlays

NUMPY = "numpy>=2,<2.4"


def path() -> Path:
    return Path(sys.prefix) / "eval-numpy2"


def needed() -> bool:
    """Whether the running environment's numpy is older than 2."""
    import numpy

    return int(numpy.__version__.split(".")[0]) < 2


def problem() -> str | None:
    """Why lm-eval's child cannot start here, with the fix; None when it can."""
    if needed() and not (path() / "numpy").is_dir():
        return (f"task evaluation needs numpy 2 for lm-eval's datasets/pyarrow, and this environment has numpy<2 "
                f"(for the bundled Triton server): run `python -m pipeline.eval.env` (or `make setup`) to make its "
                f"overlay at {path()}, or set eval.tasks=[] to skip task evaluation")
    return None


def pythonpath() -> list[str]:
    """What the evaluation child puts first on ``PYTHONPATH``."""
    return [str(path())] if needed() else []


def create(root: Path | None = None, find_links: str | None = None) -> Path:
    """Make the overlay at ``root`` (default :func:`path`), replacing one that is there."""
    root = root or path()
    with overlays.replacing(root) as tmp:
        overlays.pip_target(NUMPY, tmp, find_links=find_links, purpose="the evaluation overlay")
        shutil.rmtree(tmp / "bin", ignore_errors=True)  # numpy's f2py script: not used, and not on PATH
    return root


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Make the evaluation overlay (numpy 2 for lm-eval's child process).")
    ap.add_argument("--find-links", help="a wheelhouse to install from, without an index")
    ap.add_argument("--dest", type=Path, help=f"default: {path()}")
    ap.add_argument("--if-needed", action="store_true", help="do nothing where numpy is 2 or newer already")
    a = ap.parse_args(argv)
    if a.if_needed and not needed():
        print("evaluation overlay: not needed (numpy 2 installed)")
        return
    root = create(a.dest, a.find_links)
    print(f"evaluation overlay: {root} ({NUMPY}, first on lm-eval's PYTHONPATH)")


if __name__ == "__main__":
    main()
