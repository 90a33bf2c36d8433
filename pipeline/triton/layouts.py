"""The Triton-layout registry: per upstream model-repository layout, its models, entry points, request tensors,
engine path and how the prompt is left out of the returned text.

Read by the package stage (which models to render per runtime), the bench and its load generator (the entry point
and its tensors), ``pipeline lint``, ``pipeline serve`` and any front end that turns a request into a Triton call.
The tensor names are upstream's (``pipeline/upstream/trtllm-<line>.yaml``, read from
``triton-inference-server/tensorrtllm_backend`` and ``TensorRT-LLM/triton_backend/all_models``); their data types
are read from that record by :meth:`Layout.input_types`, so nothing here repeats it.

API for a front end::

    lay = layouts.get("llmapi")
    lay.entry_points            # ("tensorrt_llm",): models a request may go to, the default first
    lay.text_input, lay.max_tokens, lay.stream, lay.output   # tensor names of one text request and its answer
    lay.sampling                # {"temperature": "sampling_param_temperature", ...}: OpenAI-style name -> tensor
    lay.exclude_input           # optional BOOL input that leaves the prompt out of text_output
    lay.cumulative              # True: each streamed response repeats the whole text so far
    lay.input_types(model)      # {"text_input": "TYPE_STRING", ...} from the upstream record
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from pipeline.errors import UserError

ENGINE_REL = "tensorrt_llm/1/engine"  # the engine or checkpoint, and its tokenizer, in every layout
IFB, LLMAPI = "inflight_batcher_llm", "llmapi"
LLM_MODEL = "tensorrt_llm"  # the model that runs the LLM, in every layout


@dataclass(frozen=True)
class Layout:
    """One upstream model-repository layout."""

    name: str
    models: Mapping[str, tuple[str, ...]]  # runtime -> model templates (pipeline/triton/models/<template>)
    entry_points: tuple[str, ...]  # models a client may send text to; the first is the default
    text_input: str  # BYTES prompt
    max_tokens: str  # INT32 number of tokens to generate
    stream: str  # BOOL: stream the answer (a decoupled model)
    exclude_input: str  # optional BOOL: leave the prompt out of the returned text (sent as true when present)
    sampling: Mapping[str, str] = field(default_factory=dict)  # request field -> tensor name
    output: str = "text_output"  # BYTES answer
    cumulative: bool = False  # each streamed response holds the whole text so far (the LLM API's RequestOutput)

    @property
    def text_tensors(self) -> tuple[str, str, str]:
        """(text input, max-tokens input, streaming flag input): what every text request sends."""
        return self.text_input, self.max_tokens, self.stream

    @property
    def runtimes(self) -> tuple[str, ...]:
        return tuple(self.models)

    def templates(self, runtime: str) -> tuple[str, ...]:
        return self.models[runtime]

    def input_types(self, model: str | None = None, line: str | None = None) -> dict[str, str]:
        """Input tensor -> Triton data type (``TYPE_STRING``, ``TYPE_INT32``...) of an entry point, from the upstream
        record of ``line`` (the default line when None)."""
        from pipeline import upstream

        model = model or self.entry_points[0]
        spec = upstream.interface(line or upstream.DEFAULT_LINE, self.name)[model]
        return {t["name"]: t["data_type"] for t in spec["inputs"]}


_SHARED = ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm_bls")
_IFB_SAMPLING = {k: k for k in ("temperature", "top_k", "top_p", "presence_penalty", "frequency_penalty", "seed",
                                "stop_words")}
_LLMAPI_SAMPLING = {k: f"sampling_param_{k}" for k in ("temperature", "top_k", "top_p", "presence_penalty",
                                                        "frequency_penalty", "seed", "stop")}

LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in (
    Layout(IFB, {"reference": (*_SHARED, "tensorrt_llm.reference"), "trtllm_engine": (*_SHARED, "tensorrt_llm.engine")},
           entry_points=("ensemble", "tensorrt_llm_bls"), text_input="text_input", max_tokens="max_tokens",
           stream="stream", exclude_input="exclude_input_in_output", sampling=_IFB_SAMPLING),
    Layout(LLMAPI, {"reference": ("tensorrt_llm.llmapi_reference",), "trtllm_llmapi": ("tensorrt_llm.llmapi",)},
           entry_points=(LLM_MODEL,), text_input="text_input", max_tokens="sampling_param_max_tokens",
           stream="streaming", exclude_input="sampling_param_exclude_input_from_output", sampling=_LLMAPI_SAMPLING,
           cumulative=True),
)}
# The python models that run the reference runtime (they get its self-contained copies beside model.py).
REFERENCE_TEMPLATES = tuple(t for lay in LAYOUTS.values() for t in lay.models.get("reference", ())
                            if t.startswith(f"{LLM_MODEL}."))
ENTRY_POINTS = {name: lay.entry_points for name, lay in LAYOUTS.items()}


def get(name: str) -> Layout:
    """The layout called ``name``; a :class:`UserError` naming the known ones otherwise."""
    if name not in LAYOUTS:
        raise UserError(f"unknown Triton layout '{name}' (known: {', '.join(LAYOUTS)})")
    return LAYOUTS[name]


def default_for(runtime: str) -> str:
    """The layout ``serve.layout=auto`` picks for a runtime: the first that serves it."""
    return next(name for name, lay in LAYOUTS.items() if runtime in lay.models)


def of_repository(model_dirs: Mapping[str, object]) -> str:
    """The layout of a written repository from its model directories: ``llmapi`` when the ``tensorrt_llm`` model is
    driven by a ``1/model.yaml``, else ``inflight_batcher_llm``."""
    from pathlib import Path

    llm = model_dirs.get(LLM_MODEL)
    return LLMAPI if llm is not None and (Path(llm) / "1" / "model.yaml").is_file() else IFB
