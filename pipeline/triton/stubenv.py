"""A dedicated environment for the python stub of the bundled Triton 2.51 server (nvidia-pytriton 0.7), beside a
numpy 2 environment.

That stub hands tensors to Python through numpy's C API as numpy 1 laid it out: under numpy 2 every text (BYTES)
tensor arrives as copies of its first byte ("unpack_from requires a buffer of at least ... bytes"), and every request
fails. The stub ignores ``PYTHONPATH``; it takes its environment from the ``python3`` first on ``PATH``. So the
environment here is a virtual environment of its own: numpy<2 in its site-packages, then the running environment's
site-packages (torch, transformers, the pipeline) through a ``.pth`` file, and a start-up module giving numpy 1 the
two names numpy-2 builds of scipy read at import (``pipeline/triton/stub_sitecustomize.py``). The server puts its
``bin`` first on ``PATH`` (``pipeline.triton.server.running``).

    python -m pipeline.triton.stubenv [--find-links DIR]     # make stub-env; offline: from a wheelhouse

Where NVIDIA's ``tritonserver`` is on PATH (their containers) none of this is used.
"""
from __future__ import annotations

import argparse
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

from pipeline import overlays

NUMPY = "numpy>=1.24,<2"


def path() -> Path:
    return Path(sys.prefix) / "triton-stub-env"


def site_packages(root: Path | None = None) -> Path:
    root = root or path()
    rel = Path(sysconfig.get_path("purelib")).relative_to(sys.prefix)
    return root / rel


def bin_dir(root: Path | None = None) -> Path:
    return (root or path()) / "bin"


def create(root: Path | None = None, find_links: str | None = None) -> Path:
    """Make the environment at ``root`` (default :func:`path`), replacing one that is there. -> its root."""
    root = root or path()
    with overlays.replacing(root) as tmp:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp)], check=True)
        target = site_packages(tmp)
        overlays.pip_target(NUMPY, target, find_links=find_links, purpose="the bundled server's python stub")
        parents = [p for p in (*site.getsitepackages(), site.getusersitepackages()) if Path(p).is_dir()]
        # after the stub env's own site-packages (numpy<2 wins); addsitedir also runs the parents' .pth files
        (target / "_parent_env.pth").write_text(
            "".join(f"import site; site.addsitedir({p!r})\n" for p in parents))
        # a .pth line, not sitecustomize: a distribution's own sitecustomize (Debian's, in the standard library) wins
        shutil.copy2(Path(__file__).with_name("stub_sitecustomize.py"), target / "_stub_numpy_names.py")
        (target / "_stub_numpy_names.pth").write_text("import _stub_numpy_names\n")
    return root


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Make the bundled Triton server's python-stub environment (numpy<2).")
    ap.add_argument("--find-links", help="a wheelhouse to install from, without an index")
    ap.add_argument("--dest", type=Path, help=f"default: {path()}")
    a = ap.parse_args(argv)
    root = create(a.dest, a.find_links)
    print(f"stub env: {root} ({NUMPY} first; the server uses it for the bundled tritonserver's python stub)")


if __name__ == "__main__":
    main()
