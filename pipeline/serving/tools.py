"""Tool calls over the OpenAI API: the tools rendered through the model's own chat template (``tools=`` of
``apply_chat_template``), the model's tool-call text parsed into OpenAI's ``tool_calls`` (streamed as OpenAI streams
them: a call's first delta carries its ``id``, ``type`` and ``function.name``, the next one its ``arguments``), and
``tool_choice`` ``required`` or a named function enforced by guided decoding against the tools' parameter schemas.

Which models have a parser is one table, :data:`FORMATS`: a model's format is the first whose mark its chat template
contains, else the first that names its family (``config.json``'s ``model_type``); a chat template that does not
render tools at all has none. A model without one refuses ``tools`` (with a ``tool_choice`` other than ``none``)
with a 400 naming the model. The formats follow what each family's chat template writes and what vLLM's parsers of
the same name read (``vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py``,
``llama_tool_parser.py``):

- ``hermes`` (Qwen2.5, QwQ, Qwen3, Hermes 2 Pro/3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block a call, blocks separated by a newline; text before the first block is the message's content.
- ``llama3_json`` (Llama 3.1, 3.2, 3.3): the answer is ``{"name": ..., "parameters": {...}}`` (after the
  ``<|python_tag|>`` special token, which decoding drops), several separated by ``;``.

Under ``required`` or a named function the guide is the format's own: ``hermes`` an EBNF grammar (XGrammar's JSON
grammar of each call, ``{"name": <the tool's name>, "arguments": <its parameters>}``, between the tags; one or more
blocks, one with ``parallel_tool_calls: false`` or a named function), ``llama3_json`` a JSON schema of one call. The
answer then holds tool calls only, whatever the weights.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pipeline.serving import protocol as P
from pipeline.triton.layouts.contract import Guide


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def arguments_text(args: Any) -> str:
    """A call's arguments as OpenAI's ``function.arguments``: JSON text."""
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class Calls:
    """One answer's tool-call parser for a format: :meth:`feed` takes text pieces as they come and returns what can
    go out (a ``str`` of content, or a :class:`~pipeline.serving.protocol.ToolCallDelta`), :meth:`flush` the rest
    at the end; ``calls`` the calls found so far (OpenAI's ``tool_calls``)."""

    def __init__(self):
        self.calls: list[P.ToolCall] = []

    def feed(self, text: str) -> list:
        raise NotImplementedError

    def flush(self) -> list:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[P.ToolCall]]:
        """A whole answer: (its content, None when there is none besides calls; its calls)."""
        items = self.feed(text) + self.flush()
        content = "".join(x for x in items if isinstance(x, str))
        return (content if content.strip() or not self.calls else None), self.calls

    def _call(self, name: str, args: Any) -> list[P.ToolCallDelta]:
        """A parsed call: kept, and its two deltas (the name, then the arguments)."""
        index = len(self.calls)
        call = P.ToolCall(id=call_id(), type="function",
                          function=P.FunctionCall(name=name, arguments=arguments_text(args)))
        self.calls.append(call)
        return [P.ToolCallDelta(index=index, id=call.id, type="function",
                                function=P.FunctionCallDelta(name=name, arguments="")),
                P.ToolCallDelta(index=index, function=P.FunctionCallDelta(arguments=call.function.arguments))]


class HermesCalls(Calls):
    """``<tool_call>{json}</tool_call>`` blocks (module doc). Text that may be the start of ``<tool_call>`` is held
    back; a block goes out once it is closed; a block that does not parse, or is never closed, is content as it
    was written. Whitespace between and after blocks is dropped."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self.buf = ""
        self.inside = False

    def feed(self, text: str) -> list:
        self.buf += text
        out: list = []
        while True:
            if not self.inside:
                at = self.buf.find(self.OPEN)
                if at < 0:
                    keep = _partial_suffix(self.buf, self.OPEN)
                    self._content(out, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                self._content(out, self.buf[:at])
                self.buf, self.inside = self.buf[at:], True
            end = self.buf.find(self.CLOSE)
            if end < 0:
                return out
            block, self.buf = self.buf[:end + len(self.CLOSE)], self.buf[end + len(self.CLOSE):]
            self.inside = False
            parsed = _json(block[len(self.OPEN):-len(self.CLOSE)])
            if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
                out += self._call(parsed["name"], parsed.get("arguments", {}))
            else:
                self._content(out, block)

    def _content(self, out: list, text: str) -> None:
        if text and not (self.calls and not text.strip()):
            out.append(text)

    def flush(self) -> list:
        out: list = []
        self._content(out, self.buf)
        self.buf, self.inside = "", False
        return out


class Llama3JsonCalls(Calls):
    """An answer that is ``{"name": ..., "parameters": ...}`` objects separated by ``;`` (module doc): held back
    until the end when it starts with ``{``, parsed whole then; any other answer is content."""

    def __init__(self):
        super().__init__()
        self.buf = ""
        self.held: bool | None = None  # None: not decided (only whitespace so far)

    def feed(self, text: str) -> list:
        if self.held is False:
            return [text] if text else []
        self.buf += text
        head = self.buf.lstrip()
        if not head:
            return []
        self.held = head.startswith("{")
        if self.held:
            return []
        out, self.buf = self.buf, ""
        return [out]

    def flush(self) -> list:
        text, self.buf = self.buf, ""
        if not self.held:
            return [text] if text else []
        found = []
        for part in text.strip().split(";"):
            obj = _json(part)
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
                return [text]
            found.append(obj)
        out: list = []
        for obj in found:
            out += self._call(obj["name"], obj.get("parameters", obj.get("arguments", {})))
        return out


def _json(text: str) -> Any:
    try:
        return json.loads(text.strip())
    except ValueError:
        return None


def _partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# ---------------------------------------------------------------------------------------------- the guides
def call_schema(tool: P.Tool, arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call of ``tool``: ``{"name": <its name>, <arguments_key>: <its parameters>}``."""
    from pipeline.serving.guide import json_strings

    params = json_strings(tool.function.parameters or {"type": "object", "properties": {}})
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, arguments_key: params},
            "required": ["name", arguments_key], "additionalProperties": False}


def hermes_guide(tools: list[P.Tool], parallel: bool) -> Guide:
    """``<tool_call>\\n{call}\\n</tool_call>`` blocks, each call one of ``tools`` with arguments of its parameter
    schema (XGrammar's JSON grammar, compact: one space after ``,`` and ``:`` as the chat templates write it); one
    block, or with ``parallel`` one or more separated by a newline. Built with XGrammar's grammar combinators and
    sent as its EBNF text (``ebnf_grammar``)."""
    import xgrammar as xgr

    schemas = [xgr.Grammar.from_json_schema(json.dumps(call_schema(t, "arguments")), any_whitespace=False)
               for t in tools]
    call = schemas[0] if len(schemas) == 1 else xgr.Grammar.union(*schemas)
    block = xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'), call,
                               xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))
    text = str(block)
    if parallel:  # the block's root becomes a rule of its own, repeated
        if not text.startswith("root ::= "):
            raise RuntimeError(f"XGrammar printed a grammar that does not start with its root: {text[:40]!r}")
        text = 'root ::= tool_call ("\\n" tool_call)*\ntool_call ::= ' + text[len("root ::= "):]
    return Guide("ebnf_grammar", text)


def llama3_guide(tools: list[P.Tool], parallel: bool) -> Guide:
    """One ``{"name": ..., "parameters": ...}`` call of one of ``tools`` (a JSON schema)."""
    schemas = [call_schema(t, "parameters") for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return Guide("json_schema", json.dumps(schema, ensure_ascii=False))


# ------------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Format:
    """One way models write tool calls: its parser, where it is recognized, its guide."""

    name: str
    template_mark: str  # a chat template that renders tools this way contains it
    model_types: tuple[str, ...]  # config.json model_type of the families that write it
    models: str  # which models, in words (docs/serving.md)
    parser: Callable[[], Calls]
    guide: Callable[[list[P.Tool], bool], Guide]


FORMATS: tuple[Format, ...] = (
    Format("hermes", "<tool_call>", ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"),
           "Qwen2.5, QwQ, Qwen3, Hermes 2 Pro / 3", HermesCalls, hermes_guide),
    Format("llama3_json", "<|python_tag|>", ("llama",), "Llama 3.1, 3.2, 3.3", Llama3JsonCalls, llama3_guide),
)
BY_NAME = {f.name: f for f in FORMATS}


def format_for(served) -> tuple[Format | None, str]:
    """(The served model's tool-call format, None where it has none; why not)."""
    template = getattr(served.tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: the one tools use, else the default
        template = template.get("tool_use") or template.get("default") or ""
    if "tools" not in template:
        return None, "its chat template does not render tools"
    for fmt in FORMATS:
        if fmt.template_mark in template:
            return fmt, ""
    model_type = _model_type(served)
    for fmt in FORMATS:
        if model_type in fmt.model_types:
            return fmt, ""
    return None, (f"no tool-call parser is known for its family ({model_type or 'unknown model_type'}) or its chat "
                  f"template (parsers: {', '.join(f'{f.name} for {f.models}' for f in FORMATS)})")


def _model_type(served) -> str | None:
    try:
        return json.loads((Path(served.tokenizer_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


# ------------------------------------------------------------------------------------------------ a request
@dataclass
class Plan:
    """What a chat request's tools ask of the answer: the tools to render (None: none), the format to parse the
    answer with (None: no parsing) and the guide that enforces a call (None: free)."""

    render: list[dict[str, Any]] | None = None
    format: Format | None = None
    guide: Guide | None = None


def plan(req: P.ChatRequest, served, fmt: Format | None, why: str, compile_guide) -> Plan:
    """The request's tools and ``tool_choice`` as a :class:`Plan` (``fmt``, ``why``: :func:`format_for`'s answer;
    ``compile_guide(key, build, param)``: the front end's guides, ``Guides.built``, which builds a guide once per key
    and compiles it). Absent ``tool_choice`` means ``auto`` with tools and ``none`` without, as OpenAI's."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise P.APIError(400, "tool_choice needs tools: send the tools it chooses from", param="tool_choice")
        return Plan()
    if choice == "none":
        return Plan()  # the model answers in text: the tools are not shown to it
    if fmt is None:
        raise P.APIError(400, f"the model '{served.name}' cannot take tools: {why}; send the request without tools "
                              f"(or tool_choice: none)", param="tools")
    names = [t.function.name for t in req.tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise P.APIError(400, f"tools: the function name {dup[0]!r} is given twice", param="tools")
    render = [t.model_dump(exclude_none=True) for t in req.tools]
    if choice in (None, "auto"):
        return Plan(render=render, format=fmt)
    if isinstance(choice, P.NamedToolChoice):
        chosen = [t for t in req.tools if t.function.name == choice.function.name]
        if not chosen:
            raise P.APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not one of "
                                  f"the tools ({', '.join(names)})", param="tool_choice")
        parallel = False
    else:  # required
        chosen, parallel = list(req.tools), req.parallel_tool_calls is not False

    def build() -> Guide:  # the guide holds the answer to the tools' parameter schemas: they must compile
        from pipeline.serving.guide import schema_problems

        for i, t in enumerate(req.tools):
            problems = schema_problems(t.function.parameters or {})
            if problems:
                raise P.APIError(400, f"tools[{i}].function.parameters: {problems[0]}", param="tools")
        return fmt.guide(chosen, parallel)

    key = json.dumps([fmt.name, [t.model_dump(exclude_none=True) for t in chosen], parallel], sort_keys=True)
    return Plan(render=render, format=fmt, guide=compile_guide(key, build, "tools"))


def template_messages(req: P.ChatRequest) -> list[dict[str, Any]]:
    """The conversation as chat templates take it: ``developer`` as ``system``; an assistant turn's ``tool_calls``
    with their arguments as objects (as Hugging Face's tool-use templates expect; text that is no JSON as it is); a
    ``tool`` turn's ``tool_call_id``. A ``tool`` turn without its id, and ``tool_calls`` on another role, are 400s."""
    out = []
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise P.APIError(400, f"messages[{i}]: tool_calls belong to an assistant message, not {m.role}",
                                 param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _args(c.function.arguments)}}
                                 for c in m.tool_calls]
        if m.role == "tool":
            if not m.tool_call_id:
                raise P.APIError(400, f"messages[{i}]: a tool message needs the tool_call_id it answers",
                                 param=f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _args(text: str) -> Any:
    parsed = _json(text)
    return parsed if isinstance(parsed, dict) else text

