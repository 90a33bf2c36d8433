"""NVIDIA's ``llmapi`` layout: one python ``tensorrt_llm`` model; ``1/model.yaml`` holds ``model`` (absolute under
``serve.repo_mount``, as upstream's examples), the LLM-API options and ``triton_config`` (``max_batch_size``,
``decoupled``), which the model's ``auto_complete_config`` applies. With ``reference`` the same config and model.yaml
are served by the reference runtime."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from pipeline.triton.layouts.record import Layout


def detect(model_dirs: Mapping[str, Path]) -> bool:
    """A ``tensorrt_llm`` model driven by a ``1/model.yaml``."""
    llm = model_dirs.get("tensorrt_llm")
    return llm is not None and (Path(llm) / "1" / "model.yaml").is_file()


LAYOUT = Layout(
    name="llmapi",
    models={"reference": ("tensorrt_llm.llmapi_reference",), "trtllm_llmapi": ("tensorrt_llm.llmapi",)},
    entry_points=("tensorrt_llm",),
    text_input="text_input", max_tokens="sampling_param_max_tokens", stream="streaming",
    exclude_input="sampling_param_exclude_input_from_output",
    # the sampling table's rows (pipeline/triton/layouts/sampling.py) -> upstream's inputs (helpers.py hands each to
    # SamplingParams under the row's name); upstream has none for repetition_penalty and min_tokens
    sampling={k: f"sampling_param_{k}" for k in ("temperature", "top_k", "top_p", "seed", "presence_penalty",
                                                 "frequency_penalty", "stop")},
    # this project's extension of upstream's model (pipeline/upstream/trtllm-<line>.yaml extensions): model.py builds
    # GuidedDecodingParams from them
    guide=("guided_decoding_guide_type", "guided_decoding_guide"),
    output="text_output",
    cumulative=True,
    detect=detect,
    auto_for=("trtllm_llmapi",),
    reference=("tensorrt_llm.llmapi_reference",),
)
