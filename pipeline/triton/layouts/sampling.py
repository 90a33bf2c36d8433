"""The OpenAI request parameters that shape sampling: one row each (:data:`PARAMS`), read by every place that needs
them, as vLLM's request model builds its ``SamplingParams`` in one place (``ChatCompletionRequest.to_sampling_params``).

A row is the parameter's OpenAI name, its JSON type, its check (the bounds the request schema enforces: a value
outside is a 400 naming the field), what an absent field means (``default``) and the values that ask for nothing
(``unset``: sent as if absent). Who reads the table:

- the request schema (``pipeline.serving.protocol``): one optional field per row, with the row's check;
- the generation request (:class:`pipeline.triton.layouts.contract.GenRequest`): ``sampling`` holds each row's
  value as :func:`values` normalises it (only the rows that ask for something);
- the codecs (:meth:`pipeline.triton.layouts.contract.Codec.sampling`): each row goes to the tensor the layout's
  record names for it (``Layout(sampling={row: tensor})``, in each layout folder's ``__init__.py``); a row the
  served model has no tensor for is a 400 naming the field. ``inflight_batcher_llm``'s token path reads the
  ``tensorrt_llm`` model's tensor for each row from upstream's ensemble (the step that feeds ``tensorrt_llm``);
- ``docs/serving.md``'s table of them (:func:`markdown`, written by ``python -m pipeline.triton.layouts --write``;
  ``tests/unit/test_sampling_table.py`` holds it current).

Adding a parameter: a row here, and its tensor in each layout's ``Layout(sampling=...)`` that has one.

``temperature``, ``top_k`` and ``top_p`` keep OpenAI's meaning on TensorRT-LLM (the codec base): temperature 0
decodes greedily (top-k 1); any other temperature samples, with top-p 1 unless top-p or top-k is given (TensorRT-LLM
decodes greedily when both are unset: ``cpp/tensorrt_llm/kernels/samplingTopKKernels.h`` ``regularizeTopKTopP``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass(frozen=True)
class Param:
    """One request parameter (see the module's doc)."""

    name: str  # the OpenAI request field; the key of GenRequest.sampling and of each layout's Layout(sampling=...)
    type: Any  # its JSON type, as the request schema declares it
    check: dict[str, Any] = field(default_factory=dict)  # pydantic Field bounds (ge, gt, le, lt)
    default: Any = None  # what an absent field means (None: the model's own default; nothing is sent)
    unset: tuple = ()  # values that ask for nothing: treated as absent
    meaning: str = ""  # one line for the docs


STOP = "stop"

PARAMS: tuple[Param, ...] = (
    Param("temperature", float, {"ge": 0.0, "le": 2.0}, default=1.0,
          meaning="0 decodes greedily (top-k 1); OpenAI's default 1 samples"),
    Param("top_p", float, {"gt": 0.0, "le": 1.0}, meaning="nucleus sampling; 1 unless given while sampling"),
    Param("top_k", int, {"ge": -1}, unset=(0, -1), meaning="0 and -1: no top-k (TensorRT-LLM's 0, vLLM's -1)"),
    Param("seed", int, {"ge": 0, "lt": 2 ** 64}, meaning="the same seed and inputs sample the same text"),
    Param("presence_penalty", float, {"ge": -2.0, "le": 2.0}, meaning="subtracted once per token already generated"),
    Param("frequency_penalty", float, {"ge": -2.0, "le": 2.0},
          meaning="subtracted per occurrence of a token already generated"),
    Param("repetition_penalty", float, {"gt": 0.0}, meaning="vLLM's and TensorRT-LLM's extension"),
    Param("min_tokens", int, {"ge": 0}, unset=(0,), meaning="end ids are masked until this many tokens"),
    Param(STOP, Union[str, list[str]], unset=((),), meaning="stop strings: sent to the model and enforced on the text"),
)
BY_NAME = {p.name: p for p in PARAMS}
GREEDY_RULE = ("temperature", "top_k", "top_p")  # sent together by OpenAI's rule (module doc), not one by one


def annotation(p: Param) -> Any:
    """The request schema's type of the field (optional: absent means ``default``)."""
    return Optional[p.type]


def normalized(p: Param, value: Any) -> Any:
    """A request's value as the generation request holds it: ``default`` for None; None for a value in ``unset``;
    stop strings as a list without empty ones."""
    if value is None:
        value = p.default
    if p.name == STOP and value is not None:
        value = tuple(s for s in ([value] if isinstance(value, str) else value) if s)
    if value is None or value in p.unset:
        return None
    return list(value) if p.name == STOP else value


def values(req: Any) -> dict[str, Any]:
    """``{row: value}`` of a request (any object with one attribute per row), normalised; the rows that ask for
    nothing are left out."""
    out = {}
    for p in PARAMS:
        v = normalized(p, getattr(req, p.name, None))
        if v is not None:
            out[p.name] = v
    return out


def unknown(names) -> list[str]:
    """The names that are no row of the table (a layout record's mistake)."""
    return [n for n in names if n not in BY_NAME]


def markdown(layouts: dict) -> str:
    """The table as ``docs/serving.md`` shows it: each row with its check, default and each layout's tensor
    (``layouts``: name -> record)."""

    def check(p: Param) -> str:
        sym = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}

        def num(v) -> str:
            return "2^64" if v == 2 ** 64 else f"{v:g}"

        return ", ".join(f"{sym[k]} {num(v)}" for k, v in p.check.items()) or "—"

    def dflt(p: Param) -> str:
        parts = [] if p.default is None else [f"{p.default}"]
        parts += [f"{u!r} = absent" if u != () else "[] = absent" for u in p.unset]
        return "; ".join(parts) or "the model's"

    head = "| parameter | check | default | " + " | ".join(f"`{n}`" for n in layouts) + " | meaning |"
    lines = [head, "|" + "---|" * (4 + len(layouts))]
    for p in PARAMS:
        cells = [f"`{lay.sampling[p.name]}`" if p.name in lay.sampling else "400 (no input)"
                 for lay in layouts.values()]
        lines.append(f"| `{p.name}` | {check(p)} | {dflt(p)} | " + " | ".join(cells) + f" | {p.meaning} |")
    return "\n".join(lines)


START, END = "<!-- sampling-table:start -->", "<!-- sampling-table:end -->"
DOC = "docs/serving.md"


def doc_text(text: str, layouts: dict) -> str:
    """``text`` (``docs/serving.md``) with the table between the markers made from the table and the records."""
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{markdown(layouts)}\n{END}{tail}"

