"""NVIDIA's ``inflight_batcher_llm`` layout: ``ensemble`` and ``tensorrt_llm_bls`` over ``preprocessing`` ->
``tensorrt_llm`` -> ``postprocessing``, every model with upstream's tensors, types, dims and parameters
(``pipeline/upstream/trtllm-<line>.yaml``). With ``trtllm_engine`` the ``tensorrt_llm`` model runs on the C++
``tensorrtllm`` backend; with ``reference`` it is a python model running the reference runtime behind the same
config."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from pipeline.triton.layouts.record import Layout

OWN = ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm_bls")  # the models only this layout has


def detect(model_dirs: Mapping[str, Path]) -> bool:
    """One of its own models, and no ``tensorrt_llm`` driven by an LLM-API ``1/model.yaml`` (that is ``llmapi``)."""
    llm = model_dirs.get("tensorrt_llm")
    if llm is not None and (Path(llm) / "1" / "model.yaml").is_file():
        return False
    return any(m in model_dirs for m in OWN)


LAYOUT = Layout(
    name="inflight_batcher_llm",
    models={"reference": (*OWN, "tensorrt_llm.reference"), "trtllm_engine": (*OWN, "tensorrt_llm.engine")},
    entry_points=("ensemble", "tensorrt_llm_bls"),
    text_input="text_input", max_tokens="max_tokens", stream="stream", exclude_input="exclude_input_in_output",
    # the sampling table's rows (pipeline/triton/layouts/sampling.py) -> the entry point's inputs
    sampling={**{k: k for k in ("temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty",
                                "repetition_penalty", "min_tokens")}, "stop": "stop_words"},
    guide=("guided_decoding_guide_type", "guided_decoding_guide"),
    output="text_output",
    detect=detect,
    auto_for=("reference", "trtllm_engine"),
    fallback=True,
    reference=("tensorrt_llm.reference",),
    required_models=("preprocessing", "postprocessing", "tensorrt_llm"),  # ensemble and the BLS: either will do
    entry_note="tensorrt_llm takes token ids; the front end uses it for token-level requests on its own",
)
