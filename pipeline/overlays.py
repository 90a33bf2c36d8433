"""Small side environments made with pip beside the running one (the evaluation overlay, the Triton stub env).

Each is built in a sibling ``.tmp`` directory and renamed into place once complete, so an interrupted or failed
install never leaves a half-made environment where the pipeline looks for it.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replacing(root: Path) -> Iterator[Path]:
    """A fresh temporary directory beside ``root`` that replaces ``root`` when the block completes."""
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)


def pip_target(spec: str, target: Path, *, find_links: str | None, purpose: str) -> None:
    """``pip install --target`` of one requirement without its dependencies (offline from ``find_links`` when set).

    Raises UserError naming ``purpose`` and pip's last line when the install fails."""
    from pipeline.errors import UserError

    index = ["--no-index", "--find-links", find_links] if find_links else []
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", *index,
                        "--target", str(target), spec], capture_output=True, text=True)
    if r.returncode:
        tail = (r.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise UserError(f"could not install {spec} for {purpose}: {tail}")
