"""The names every floor of the package uses, on the bottom floor: it imports nothing from ``pipeline``, so any module
may read it without an arrow running up.

- :data:`STAGE_NAMES`: the stages in order (``until=`` and ``force=`` take these; ``pipeline.stages`` registers one
  ``Stage`` each, in this order);
- :data:`RUNTIMES`: what ``runtime.name`` may be;
- :data:`ENGINE_REL`, :data:`LLM_MODEL`: where the engine or checkpoint (and its tokenizer) lies in every Triton
  layout's repository, and the model that runs the LLM there;
- the SM table: GPU architectures by compute capability (x10);
- :func:`layout_names`: the Triton layouts (``pipeline/triton/layouts/<name>/``), by their folders alone.

The format registry (``pipeline/formats``) keeps its own copy of the SM and runtime tuples: it is copied into model
repositories, where ``pipeline`` cannot be imported (``tests/unit/test_catalog.py`` holds the two equal).
"""
from __future__ import annotations

from pathlib import Path

STAGE_NAMES = ("fetch", "quantize", "build", "package", "bench", "eval_baseline", "evaluate", "publish")

RUNTIMES = ("reference", "trtllm_engine", "trtllm_llmapi")

ENGINE_REL = "tensorrt_llm/1/engine"  # the engine or checkpoint, and its tokenizer, in every layout's repository
LLM_MODEL = "tensorrt_llm"  # the model that runs the LLM, in every layout

# GPU architecture by SM (compute capability x10), as NVIDIA names them
ARCHITECTURES = {80: "Ampere", 86: "Ampere", 89: "Ada", 90: "Hopper", 100: "Blackwell", 103: "Blackwell",
                 120: "Blackwell"}
ALL_GPUS = tuple(ARCHITECTURES)
BLACKWELL = tuple(sm for sm, arch in ARCHITECTURES.items() if arch == "Blackwell")

LAYOUTS_DIR = Path(__file__).resolve().parent / "triton" / "layouts"
LAYOUT_INTERFACE = "interface.yaml"  # a layout's own interface, for one that is not NVIDIA's


def layout_names() -> tuple[str, ...]:
    """Every Triton layout, by its folder: a sub-directory of ``pipeline/triton/layouts/`` that holds an
    ``__init__.py`` and whose name does not start with ``_`` or ``.``; sorted, so every machine lists them alike."""
    return tuple(sorted(d.name for d in LAYOUTS_DIR.iterdir()
                        if d.is_dir() and not d.name.startswith(("_", ".")) and (d / "__init__.py").is_file()))


def nvidia_layouts() -> tuple[str, ...]:
    """The layouts whose interface is NVIDIA's recorded one (``pipeline/upstream/trtllm-<line>.yaml``): those without
    an ``interface.yaml`` of their own."""
    return tuple(n for n in layout_names() if not (LAYOUTS_DIR / n / LAYOUT_INTERFACE).is_file())
