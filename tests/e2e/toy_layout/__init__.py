"""``toy``: a layout that is not NVIDIA's, for tests (``tests/e2e/test_toy_layout.py`` copies this folder into a copy
of the project as ``pipeline/triton/layouts/toy/``). One python model, ``tensorrt_llm``, serves the reference runtime
behind tensors of its own: ``prompt``, ``max_new_tokens``, ``stream``, ``temperature`` in, ``completion`` (the text
of each response's new tokens) out; its interface is ``interface.yaml`` beside this file."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from pipeline.triton.layouts.record import Layout


def detect(model_dirs: Mapping[str, Path]) -> bool:
    """A ``tensorrt_llm`` model that takes ``prompt``."""
    from pipeline.errors import UserError
    from pipeline.triton.render import parse_model_config

    cfg = Path(model_dirs["tensorrt_llm"]) / "config.pbtxt" if "tensorrt_llm" in model_dirs else None
    if cfg is None or not cfg.is_file():
        return False
    try:
        return "prompt" in {t.name for t in parse_model_config(cfg.read_text()).input}
    except UserError:
        return False


LAYOUT = Layout(
    name="toy",
    models={"reference": ("tensorrt_llm.toy",)},
    entry_points=("tensorrt_llm",),
    text_input="prompt", max_tokens="max_new_tokens", stream="stream",
    sampling={"temperature": "temperature"},
    output="completion",
    detect=detect,
    reference=("tensorrt_llm.toy",),
)
