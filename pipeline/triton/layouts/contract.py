"""The contract between the OpenAI front end (``pipeline.serving``) and the layouts
(``pipeline/triton/layouts/<name>/``): everything a layout folder's ``served.py`` and ``openai_codec.py`` build on, and everything the front end reads back
from them. The front end imports the layouts; no layout imports the front end (an import-linter contract in
``pyproject.toml``).

- The served-model reading: what a layout's ``served.read`` returns (:class:`Reading`) and the helpers it reads a
  repository with (:func:`params`, :func:`resolve`, :func:`special_tokens_flag`, :func:`to_int`).
- The API error: :class:`APIError`, an error in OpenAI's schema (:class:`ErrorBody`), which a codec raises for a
  request its layout cannot serve and the front end answers with.
- The codec: the front end's generation request (:class:`GenRequest`, in OpenAI's terms), what one response adds
  (:class:`Delta`), a served model's interface (:class:`Spec`), and the :class:`Codec` base each layout folder's
  ``openai_codec.py`` builds on.

A codec turns one :class:`GenRequest` into a :class:`Call`: the model it goes to, its input tensors by name, the
outputs asked for, the streaming flag's name, and how each of its responses reads (:meth:`Call.decode` -> a
:class:`Delta`; :meth:`Call.finish`: what is left once the last one came). The driver (``pipeline.serving.driver``)
sends the call over gRPC and yields what ``decode`` makes of each response. Two calls serve text requests of any
layout whose record names the tensors: :class:`TextCall` (each response holds the text of its new tokens, read
straight from the raw tensors) and :class:`CumulativeCall` (each holds the whole text so far).

Sampling follows OpenAI's meaning on TensorRT-LLM (:meth:`Codec.sampling`): temperature 0 decodes greedily (top-k
1); any other temperature samples (top-p 1 unless given: TensorRT-LLM decodes greedily when top-k and top-p are both
unset). A field the served model has no input for is a 400 naming the field and the missing tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict

from pipeline.errors import UserError
from pipeline.triton.layouts import sampling
from pipeline.triton.render import parse_model_config


# ---------------------------------------------------------------------------------------------- the API error
class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


class APIError(Exception):
    """An error in OpenAI's schema (:class:`ErrorBody`): ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return ErrorBody(error=ErrorDetail(message=self.message, param=self.param, code=self.code,
                                           type=self.TYPES.get(self.status, "invalid_request_error"))).model_dump()


# ------------------------------------------------------------------------------------ the served-model reading
TRUE = ("true", "1", "t", "y", "yes")
FALSE = ("false", "0", "f", "n", "no")


def special_tokens_flag(value: str | None) -> bool:
    """Preprocessing's ``add_special_tokens`` parameter as upstream's preprocessing model reads it
    (tensorrtllm_backend ``all_models/inflight_batcher_llm/preprocessing/1/model.py`` @ c2e65b8, ``initialize``): one
    of its true or false words in any case, and true for anything else (absent, unfilled, misspelt)."""
    v = (value or "").lower()
    return v in TRUE if v in TRUE + FALSE else True


def params(config_pbtxt: Path) -> dict[str, str]:
    """A model config's filled ``parameters`` (name -> string value); a :class:`UserError` when it cannot be read."""
    try:
        cfg = parse_model_config(config_pbtxt.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{config_pbtxt}: cannot read it ({exc})") from None
    return {k: v.string_value for k, v in cfg.parameters.items() if not v.string_value.startswith("${")}


def resolve(repo: Path, path: str) -> Path:
    """A path parameter as it exists here: relative -> under the repository root; absolute and present -> itself;
    absolute and absent (the serving container's mount) -> the longest tail of it found in the repository."""
    p = Path(path)
    if not p.is_absolute():
        return (repo / p).resolve()
    if p.exists():
        return p
    parts = p.parts[1:]
    for i in range(len(parts)):
        cand = repo.joinpath(*parts[i:])
        if cand.exists():
            return cand
    return p


@dataclass
class Reading:
    """What a layout folder's ``served.read(repo, model_dirs)`` finds in a written repository."""

    tokenizer_dir: Path
    max_seq_len: int | None  # None: not in the repository (the checkpoint's max_position_embeddings is used)
    add_special_tokens: bool  # how the layout's tokenizer step encodes text prompts


def to_int(v) -> int | None:
    try:
        return int(v) if v not in (None, "") else None
    except (TypeError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------- the codec


@dataclass
class Spec:
    """One served Triton model: its inputs (name -> (data type, dims)), outputs, batching and transaction policy."""

    name: str
    inputs: dict[str, tuple[str, list[int]]]
    outputs: set[str]
    batched: bool
    decoupled: bool
    required: tuple[str, ...] = ()  # inputs that are not optional

    @classmethod
    def from_config(cls, cfg: dict) -> "Spec":
        return cls(cfg["name"],
                   {t["name"]: (t.get("data_type", "TYPE_INVALID"), [int(d) for d in t.get("dims", [])])
                    for t in cfg.get("input", [])},
                   {t["name"] for t in cfg.get("output", [])},
                   int(cfg.get("max_batch_size", 0) or 0) > 0,
                   bool((cfg.get("model_transaction_policy") or {}).get("decoupled", False)),
                   tuple(t["name"] for t in cfg.get("input", []) if not t.get("optional", False)))


@dataclass(frozen=True)
class Guide:
    """Guided decoding for one request, as TensorRT-LLM takes it: ``type`` is a ``guided_decoding_guide_type``
    (``json``, ``json_schema``, ``regex``, ``ebnf_grammar``) and ``text`` its ``guided_decoding_guide`` (the schema's
    JSON, the regex, the grammar; empty for ``json``). The front end makes it from ``response_format`` or the tools
    (``pipeline.serving.guide``); each layout's codec sends it to the tensors its record names (``Layout.guide``)."""

    type: str
    text: str = ""


@dataclass
class GenRequest:
    """One generation, in OpenAI's terms (the layout's codec maps it onto the layout's tensors). ``sampling``: the
    request's values of the sampling table (``pipeline.triton.layouts.sampling``: row -> value, normalised; a row
    that asks for nothing is absent)."""

    prompt_text: str | None
    prompt_ids: list[int] | None
    max_tokens: int
    stream: bool
    sampling: dict[str, Any] = field(default_factory=dict)
    guide: Guide | None = None  # guided decoding (response_format, tools); None: unconstrained
    guide_param: str = "response_format"  # the request field the guide comes from (for a 400)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus the k most likely
    prompt_logprobs: bool = False  # echo with logprobs: the prompt tokens' log probabilities
    request_id: str = ""
    # called once the request is on its way to Triton; an error it returns ends the request (stopped on the server)
    after_send: Callable[[], BaseException | None] | None = None

    @property
    def token_level(self) -> bool:
        return self.prompt_ids is not None or self.logprobs is not None or self.prompt_logprobs

    @property
    def stop(self) -> list[str]:
        """The stop strings (none: [])."""
        return self.sampling.get(sampling.STOP, [])

    @property
    def temperature(self) -> float:
        return self.sampling.get("temperature", sampling.BY_NAME["temperature"].default)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: the first prompt token (nothing predicts it)
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Delta:
    """What one Triton response adds: new text, and for token-level requests the new token ids and log probs."""

    text: str = ""
    ids: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None
    num_output_tokens: int | None = None  # the engine's count so far, where the layout reports it
    finish_reason: str | None = None  # the model's own finish reason (llmapi's, on its last response)
    prompt_logprobs: list[TokenLogprob] | None = None  # echo with logprobs: on the first delta


# ------------------------------------------------------------------------------------------------------- calls
class Call:
    """One request as its layout sends it (``spec``: the model; ``inputs``: tensor name -> value; ``outputs``: the
    outputs asked for, none: all; ``stream_input``: the BOOL input that asks for a stream, set by the driver when the
    model has it), and how its responses read."""

    __slots__ = ("spec", "inputs", "outputs", "stream_input")

    def __init__(self, spec: Spec, inputs: dict[str, Any], outputs: tuple[str, ...], stream_input: str):
        self.spec, self.inputs, self.outputs, self.stream_input = spec, inputs, outputs, stream_input

    def decode(self, resp) -> Delta:
        """One ``ModelInferResponse`` -> what it adds."""
        raise NotImplementedError

    def finish(self) -> tuple[Delta, ...]:
        """What is left once the last response came (text held back, an entry only the end explains)."""
        return ()


class TextCall(Call):
    """Each response holds the text of its new tokens (``output``) and, where the model reports it, the engine's
    count so far (``count``)."""

    __slots__ = ("output", "count")

    def __init__(self, spec: Spec, inputs: dict[str, Any], outputs: tuple[str, ...], stream_input: str,
                 output: str = "text_output", count: str = "num_output_tokens"):
        super().__init__(spec, inputs, outputs, stream_input)
        self.output, self.count = output, count

    def decode(self, resp) -> Delta:
        fast = text_delta(resp, self.output, self.count)  # the common streamed chunk, without InferResult's numpy
        if fast is not None:
            return fast
        result = _result(resp)
        n = result.as_numpy(self.count)
        return Delta(text=_joined(result.as_numpy(self.output)),
                     num_output_tokens=None if n is None or not n.size else int(n.reshape(-1)[0]))


class CumulativeCall(Call):
    """Each response holds the whole text so far (``output``; the LLM API's ``RequestOutput``) and, where asked, the
    model's finish reason (``reason``): what is new is what goes beyond the text before."""

    __slots__ = ("output", "reason", "so_far")

    def __init__(self, spec: Spec, inputs: dict[str, Any], outputs: tuple[str, ...], stream_input: str,
                 output: str = "text_output", reason: str = "finish_reason"):
        super().__init__(spec, inputs, outputs, stream_input)
        self.output, self.reason, self.so_far = output, reason, ""

    def decode(self, resp) -> Delta:
        result = _result(resp)
        whole = _joined(result.as_numpy(self.output))
        reason = result.as_numpy(self.reason)
        reason = None if reason is None or not reason.size else _s(reason.reshape(-1)[0])
        prev = self.so_far
        if whole.startswith(prev):
            new = whole[len(prev):]
        else:  # a unary answer, or a text that was re-decoded: whatever is new beyond the common prefix
            new = whole[len(common_prefix(prev, whole)):]
        self.so_far = whole
        return Delta(text=new, finish_reason=reason if reason not in ("None", "") else None)


# ------------------------------------------------------------------------------------------------------- codec
class Codec:
    """The front end's mapping of OpenAI requests onto one layout's tensors (``layout``: its record; ``served``: the
    model the front end serves, for its tokenizer and end id). A layout folder's ``codec.py`` defines ``Codec`` as a
    subclass with :meth:`call`; the rest has defaults:

    - ``side_models``: models besides the entry point whose configs the driver reads at start (``inflight_batcher_llm``:
      ``tensorrt_llm``, for token-level requests), handed to :meth:`call` as ``side``;
    - ``stop_model``: the model that takes upstream's ``stop`` request for a generation left before its end (None: the
      entry point), and :meth:`stop_dummies`, values for its required inputs;
    - :meth:`entry_problem`: why a served model is not an entry point of the layout;
    - :meth:`why_not_token_level`: the 400 for token ids and log probabilities where the layout has no token path.
    """

    side_models: tuple[str, ...] = ()
    stop_model: str | None = None

    def __init__(self, layout, served):
        self.layout, self.served = layout, served

    def call(self, req: GenRequest, entry: Spec, side: dict[str, Spec]) -> Call:
        raise NotImplementedError

    def entry_problem(self, entry: Spec) -> str | None:
        lay = self.layout
        if lay.text_input not in entry.inputs or lay.output not in entry.outputs:
            return f"no {lay.text_input}/{lay.output}"
        return None

    def stop_target(self, entry: Spec | None, side: dict[str, Spec]) -> Spec | None:
        return side.get(self.stop_model) if self.stop_model else entry

    def stop_dummies(self) -> dict[str, Any]:
        """Values for the stop model's required inputs in a stop request (anything else required gets 0)."""
        return {self.layout.text_input: ""}

    def stop_inputs(self, spec: Spec) -> dict[str, Any]:
        dummy = self.stop_dummies()
        values = {k: dummy.get(k, 0) for k in spec.required}
        values["stop"] = True
        return values

    def refuse_token_level(self, req: GenRequest) -> None:
        if req.token_level:
            raise APIError(400, self.why_not_token_level(req), param=token_param(req))

    def why_not_token_level(self, req: GenRequest) -> str:
        what = ("echo with logprobs needs prompt log probabilities" if req.prompt_logprobs else
                "logprobs: per-token log probabilities" if req.logprobs is not None else "prompt as token ids")
        return f"{what}: the {self.layout.name} layout's model takes text only and returns text only"

    # --- helpers for codecs ------------------------------------------------------------------------------------
    def sampling(self, spec: Spec, req: GenRequest, names: Mapping[str, str], out: dict[str, Any],
                 own: tuple[str, ...] = ()) -> None:
        """The request's sampling table values -> their tensors (``names``: row -> tensor of ``spec``; ``own``: rows
        the caller sends itself). Temperature 0 is greedy (top-k 1); otherwise sample with top-p 1 unless top-p or
        top-k is given. A row with no tensor in ``names`` is a 400 naming the field."""

        def tensor(name: str) -> str:
            if name not in names:
                raise APIError(400, f"{name} is not supported by the {self.layout.name} layout's '{spec.name}' "
                                    f"model (it has no input for it)", param=name)
            return names[name]

        values = dict(req.sampling)
        temperature = values.pop("temperature", sampling.BY_NAME["temperature"].default)
        top_k, top_p = values.pop("top_k", None), values.pop("top_p", None)
        if temperature == 0.0:
            out[tensor("top_k")] = 1
        else:
            if temperature != 1.0:
                out[tensor("temperature")] = temperature
            if top_k is not None:
                out[tensor("top_k")] = top_k
            if top_p is not None:
                out[tensor("top_p")] = top_p
            elif top_k is None:
                out[tensor("top_p")] = 1.0
        for name, value in values.items():
            if name not in own:
                out[tensor(name)] = value

    def guide_inputs(self, spec: Spec, req: GenRequest, names: tuple[str, ...], out: dict[str, Any]) -> None:
        """The request's guide -> its two tensors (``names``: the guide type's and the guide's inputs of ``spec``); a
        model without them is a 400 naming the request field that asked for it."""
        if req.guide is None:
            return
        if len(names) != 2 or not set(names) <= set(spec.inputs):
            raise APIError(400, f"{req.guide_param} needs guided decoding, which the {self.layout.name} layout's "
                                f"'{spec.name}' model does not take (it has no guided_decoding_guide_type/"
                                f"guided_decoding_guide inputs)", param=req.guide_param)
        out[names[0]] = req.guide.type
        if req.guide.text:
            out[names[1]] = req.guide.text

    def check(self, spec: Spec, inputs: dict[str, Any], fields: dict[str, str]) -> None:
        """Every input must exist in the served model; name the request field that asked for a missing one."""
        for name in inputs:
            if name not in spec.inputs:
                fld = fields.get(name, name)
                raise APIError(400, f"{fld} is not supported by the {self.layout.name} layout's '{spec.name}' "
                                    f"model (it has no input '{name}')", param=fld)


def token_param(req: GenRequest) -> str:
    """The request field that made a request token-level."""
    return "echo" if req.prompt_logprobs else "logprobs" if req.logprobs is not None else "prompt"


# ------------------------------------------------------------------------------------------------- responses
def text_delta(resp, output: str = "text_output", count: str = "num_output_tokens") -> Delta | None:
    """The text (BYTES ``output``) and count (INT32/INT64 ``count``) of a text response, straight from
    ``raw_output_contents`` (tritonclient's ``deserialize_bytes_tensor``, without ``InferResult``'s numpy arrays per
    output); None when the response is not in that form (the caller falls back to ``InferResult``)."""
    import struct

    from tritonclient.utils import deserialize_bytes_tensor

    raw = resp.raw_output_contents
    if len(raw) != len(resp.outputs):
        return None
    text, n = "", None
    for out, buf in zip(resp.outputs, raw):
        if out.name == output:
            if out.datatype != "BYTES":
                return None
            try:
                text = b"".join(deserialize_bytes_tensor(buf)).decode("utf-8", "replace")
            except struct.error:  # a length prefix that runs past the buffer
                return None
        elif out.name == count:
            width = {"INT32": 4, "INT64": 8}.get(out.datatype)
            if width is None or len(buf) < width:
                return None
            n = int.from_bytes(buf[:width], "little", signed=True)
    return Delta(text=text, num_output_tokens=n)


def _result(resp):
    from tritonclient.grpc import InferResult

    return InferResult(resp)


def _joined(out) -> str:
    """A BYTES output's elements as one text ("" when absent)."""
    if out is None:
        return ""
    return "".join(x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in out.reshape(-1))


def _s(x) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)


def common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def top(row: np.ndarray, k: int) -> tuple[np.ndarray, list[tuple[int, float]]]:
    """log_softmax of one logits row, and its k most likely (id, log prob)."""
    x = row.astype(np.float64)
    m = x.max()
    lp = x - (m + math.log(np.exp(x - m).sum()))
    if k <= 0:
        return lp, []
    idx = np.argpartition(-lp, min(k, lp.size - 1))[:k]
    idx = idx[np.argsort(-lp[idx], kind="stable")]
    return lp, [(int(i), float(lp[i])) for i in idx]
