"""Which folders of ``pipeline/triton/layouts/`` are layouts, read from the file tree alone (nothing imported), for
the modules the registry itself depends on (``pipeline.upstream``).

A layout folder is a sub-directory of this package's directory that holds an ``__init__.py`` and whose name does
not start with ``_`` or ``.``; layouts are always listed in sorted order of their folder names. A layout whose folder
holds an ``interface.yaml`` is not one of NVIDIA's: its models' interface is that file instead of the upstream
record ``pipeline/upstream/trtllm-<line>.yaml``.
"""
from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
INTERFACE = "interface.yaml"  # a layout's own interface, for one that is not NVIDIA's


def names() -> tuple[str, ...]:
    """Every layout folder's name, sorted."""
    return tuple(sorted(d.name for d in HERE.iterdir()
                        if d.is_dir() and not d.name.startswith(("_", ".")) and (d / "__init__.py").is_file()))


def nvidia() -> tuple[str, ...]:
    """The layouts whose interface is NVIDIA's recorded one (no ``interface.yaml`` of their own), sorted."""
    return tuple(n for n in names() if not (HERE / n / INTERFACE).is_file())
