"""The OpenAI request bodies the front end accepts, the response bodies it answers with, and its errors.

Fields follow OpenAI's API reference for ``/v1/chat/completions`` and ``/v1/completions``, plus the extensions that
vLLM and ``trtllm-serve`` accept and benchmarks send (``top_k``, ``min_tokens``, ``ignore_eos``,
``repetition_penalty``, ``chat_template_kwargs``, ``stream_options.continuous_usage_stats``, ``response_format`` on
``/v1/completions``). The sampling fields are the rows of one table (``pipeline/triton/layouts/sampling.py``). A
field that is not in the schema is refused by name (OpenAI answers "Unrecognized request argument supplied"); a known
field whose value would change the output in a way no layout can honour (``n`` > 1, ``logit_bias``, the legacy
``functions``, ``suffix``, ``best_of`` > 1) is refused by :func:`unsupported`, never ignored. ``response_format``
(``json_object``, ``json_schema``) and ``tools`` with ``tool_choice`` are served by guided decoding
(``pipeline.serving.guide``, ``pipeline.serving.tools``).

Every response body is one of the typed models below (OpenAI's ``Completion``, ``ChatCompletion``,
``ChatCompletionChunk``, ``Model``, the model list and the error body), written by :func:`dump`: compact JSON of the
fields that were set, in the models' field order, non-ASCII text as it is. A field the answer leaves out is one not
passed to the model (a chat delta's ``role`` after the first chunk; a chunk's ``usage`` without
``stream_options.include_usage``); a field passed as None is ``null``. The streaming hot path writes its per-token
chunk as bytes around the text (``pipeline.serving.generation``); ``tests/unit/test_serving.py`` checks those bytes
against :func:`dump` of the same chunk.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from pipeline.triton.layouts import sampling
from pipeline.triton.layouts.contract import APIError, ErrorBody, ErrorDetail  # noqa: F401 - the layouts raise it too


def dumps(doc: Any) -> bytes:
    """Compact JSON, non-ASCII as it is (what every response body and event is written as)."""
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def dump(model: BaseModel) -> bytes:
    """A response model as the front end writes it: the fields that were set, in field order (:func:`dumps`)."""
    return dumps(model.model_dump(exclude_unset=True))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


# One optional field per row of the sampling table (pipeline/triton/layouts/sampling.py), with the row's check.
_SamplingFields = create_model("_SamplingFields", __base__=_Strict,
                               **{p.name: (sampling.annotation(p), Field(None, **p.check)) for p in sampling.PARAMS})


class _Sampling(_SamplingFields):
    model: str
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(None, ge=0)
    ignore_eos: bool = False
    n: Optional[int] = Field(None, ge=1)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None  # recorded by OpenAI for abuse monitoring; no effect on the output
    # accepted with no effect on the output
    store: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None

    def sampling(self) -> dict[str, Any]:
        """The sampling table's values of this request (``sampling.values``: normalised, the unset ones left out)."""
        return sampling.values(self)


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: the schema (``schema``), its name and OpenAI's ``strict`` (the schema is
    always enforced here, strict or not)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as the answer carried it


class CalledTool(_Strict):
    """A tool call of an earlier assistant turn, sent back with the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[CalledTool]] = None
    tool_call_id: Optional[str] = None
    # what an SDK sends back with an earlier answer's message (OpenAI's ChatCompletionMessage); no effect here
    refusal: Optional[str] = None
    annotations: Optional[list[Any]] = None
    audio: Optional[dict[str, Any]] = None
    function_call: Optional[dict[str, Any]] = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for k, part in enumerate(self.content):
            if part.get("type") != "text":
                raise APIError(400, f"messages[{index}].content[{k}] is of type {part.get('type')!r}: this model "
                                    f"takes text only", param=f"messages[{index}].content")
            try:
                out.append(TextPart.model_validate(part).text)
            except ValidationError as exc:
                raise from_validation(exc, prefix=f"messages[{index}].content[{k}]") from None
        return "".join(out)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    # at least 1, as OpenAI's API and vLLM (SamplingParams: "max_tokens must be at least 1") refuse 0 with a 400
    # naming the field; only /v1/completions takes 0, with echo (the prompt's log probabilities only)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None
    response_format: Optional[ResponseFormat] = None
    modalities: Optional[list[str]] = None
    audio: Optional[dict[str, Any]] = None
    prediction: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    web_search_options: Optional[dict[str, Any]] = None

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> Optional[int]:
        """None: no log probs; 0: the sampled token's; k: and the k most likely."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_Sampling):
    prompt: PromptType
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    best_of: Optional[int] = Field(None, ge=1)
    suffix: Optional[str] = None
    response_format: Optional[ResponseFormat] = None  # vLLM's extension of /v1/completions

    def limit(self) -> Optional[int]:
        return self.max_tokens

    def num_logprobs(self) -> Optional[int]:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


def unsupported(req: _Sampling) -> None:
    """Refuse, by name, a field whose value would change the output and that no layout can honour."""
    bad: list[str] = []
    if req.n is not None and req.n > 1:
        bad.append(f"n={req.n} (one choice per request; send n requests)")
    if req.logit_bias:
        bad.append("logit_bias")
    if isinstance(req, ChatRequest):
        for name in ("functions", "audio", "prediction", "web_search_options"):
            if getattr(req, name):
                bad.append(name + (" (deprecated by OpenAI: send tools)" if name == "functions" else ""))
        if req.function_call not in (None, "none", "auto"):
            bad.append("function_call (deprecated by OpenAI: send tool_choice)")
        if req.modalities and set(req.modalities) - {"text"}:
            bad.append("modalities other than text")
        if req.reasoning_effort is not None:
            bad.append("reasoning_effort (pass the model's own switch in chat_template_kwargs, e.g. "
                       "enable_thinking)")
    else:
        if req.best_of is not None and req.best_of > 1:
            bad.append(f"best_of={req.best_of}")
        if req.suffix:
            bad.append("suffix")
    if req.stream_options is not None and not req.stream:
        bad.append("stream_options (only with stream: true)")
    if bad:
        raise APIError(400, f"not supported by this server: {'; '.join(bad)}", param=bad[0].split(" ")[0].split("=")[0])


def from_validation(exc: ValidationError, prefix: str = "") -> APIError:
    """A pydantic error -> one 400 naming every bad field."""
    parts, first = [], None
    for e in exc.errors():
        loc = prefix + "".join(f"[{x}]" if isinstance(x, int) else (f".{x}" if i or prefix else str(x))
                               for i, x in enumerate(e.get("loc", ())))
        first = first or loc
        if e.get("type") == "extra_forbidden":
            parts.append(f"unrecognized request argument: {loc}")
        elif e.get("type") == "missing":
            parts.append(f"{loc} is required")
        else:
            parts.append(f"{loc}: {e.get('msg')}")
    # a union's alternatives repeat one field's problem; keep the distinct messages in order
    uniq = list(dict.fromkeys(parts))
    return APIError(400, "; ".join(uniq[:6]) + (f" (and {len(uniq) - 6} more)" if len(uniq) > 6 else ""), param=first)


# ----------------------------------------------------------------------------------------------------- responses
class _Out(BaseModel):
    """A response body (or part of one): every field it has is declared."""

    model_config = ConfigDict(extra="forbid")


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Optional[Literal["stop", "length", "tool_calls"]]


class CompletionLogprobs(_Out):
    """``/v1/completions`` log probabilities: per token its text, log prob (None: the first prompt token), top
    alternatives (None where not asked or for the first prompt token) and offset in the returned text."""

    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: FinishReason


class Completion(_Out):
    """``/v1/completions``' answer, and each chunk of its stream (OpenAI's streamed chunks are completions too; their
    ``usage`` is there only with ``stream_options.include_usage``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: Optional[str]
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(_Out):
    token: str
    logprob: Optional[float]
    bytes: list[int]


class TokenLogprobEntry(_Out):
    token: str
    logprob: Optional[float]
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Out):
    content: list[TokenLogprobEntry]
    refusal: Optional[list[TokenLogprobEntry]]


class FunctionCall(_Out):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Out):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Out):
    """The answer's message: ``content`` (None when the answer is tool calls and nothing else) and, where the model
    called tools, ``tool_calls``."""

    role: Literal["assistant"]
    content: Optional[str]
    refusal: Optional[str]
    tool_calls: Optional[list[ToolCall]] = None


class ChatChoice(_Out):
    index: int
    message: ChatMessage
    logprobs: Optional[ChoiceLogprobs]
    finish_reason: FinishReason


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: Optional[str]
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(_Out):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ToolCallDelta(_Out):
    """A streamed tool call, as OpenAI streams them: the first delta of call ``index`` carries its ``id``, ``type``
    and ``function.name`` (with empty ``arguments``), the next ones pieces of ``function.arguments``."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[FunctionCallDelta] = None


class ChatDelta(_Out):
    """What a chunk adds to the message: ``role`` on the first chunk, ``content`` where there is text,
    ``tool_calls`` where the model calls a tool (none of them on the finish chunk)."""

    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChoiceLogprobs]
    finish_reason: FinishReason


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: Optional[str]
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class ModelCard(_Out):
    """``GET /v1/models/{id}``: OpenAI's ``Model`` with vLLM's ``root`` and ``max_model_len`` and the build's
    ``metadata`` (layout, quant, kv_cache, target, runtime, version)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: Optional[int]
    metadata: dict[str, Any]


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]
