"""Structured outputs and tool calls in process: the reference runtime's decode loop under XGrammar's token mask on the
random tiny-qwen3 model (only the grammar can make its answers valid: a planted grammar that masks nothing must fail
the same checks), the front end's guides, the tool-call parsers (each given another family's format must find no
call), the table of formats, and the guide fields the layouts' model.py files share with the upstream record. The
served path is tested end to end in tests/e2e/test_structured.py."""
from __future__ import annotations

import json

import jsonschema
import pytest

from pipeline.runtime import guided
from pipeline.serving import guide
from pipeline.serving import protocol as P, tools

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
    "population": {"type": "integer", "minimum": 0, "maximum": 999},
    "capital": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
    "required": ["city", "population", "capital", "tags"], "additionalProperties": False}
TOOLS = [P.Tool.model_validate({"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                            "unit": {"type": "string", "enum": ["C", "F"]}},
                           "required": ["city", "unit"]}}}),
         P.Tool.model_validate({"type": "function", "function": {
             "name": "add", "parameters": {"type": "object", "properties": {
                 "a": {"type": "integer", "minimum": 0, "maximum": 99},
                 "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}}})]
PROMPTS = ["Describe Paris as JSON.", "Hello", "What is 2+2?", "Write a poem about the sea"]


class NoGrammar:
    """The planted fault: a grammar that masks nothing and accepts every token (guided decoding not applied)."""

    def constrain(self, logits) -> None:
        pass

    def accept(self, token: int) -> bool:
        return True


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny-qwen3 on the CPU, loaded by the reference runtime: (model, tokenizer, batching engine)."""
    import torch

    from tests.helpers import tiny_reference

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok, engine = tiny_reference.build(tmp_path_factory.mktemp("tiny-qwen3"))
    yield model, tok, engine
    engine.close()
    torch.set_num_threads(threads)


def _answers(tiny, grammar_for, max_new: int = 256) -> list[tuple[str, bool]]:
    """Each prompt's answer (greedy, and sampled with a seed) under ``grammar_for()``: (text, ended by the end id)."""
    from pipeline.runtime.decode_engine import GenerationRequest

    model, tok, engine = tiny
    eos = frozenset([tok.eos_token_id])
    handles = []
    for p in PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        for temperature in (0.0, 1.0):
            handles.append(engine.submit(GenerationRequest(ids, max_new, end_ids=eos, temperature=temperature,
                                                           seed=7, grammar=grammar_for())))
    out = []
    for h in handles:
        toks = h.tokens()
        out.append((tok.decode([t for t in toks if t not in eos]), bool(toks) and toks[-1] in eos))
    return out


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_a_json_schema_answer_is_valid_whatever_the_weights_and_only_the_grammar_makes_it_so(tiny):
    model, tok, _ = tiny
    grammars = guided.Grammars.from_tokenizer(tok, model.config.vocab_size)
    answers = _answers(tiny, lambda: grammars.matcher("json_schema", json.dumps(guide.json_strings(SCHEMA))))
    assert all(ended for _, ended in answers), answers  # the grammar closed every answer
    assert all(_valid(text, SCHEMA) for text, _ in answers), answers
    # the control: the same requests without the mask are not valid (random weights write noise)
    planted = _answers(tiny, NoGrammar, max_new=64)
    assert not any(_valid(text, SCHEMA) for text, _ in planted), planted


def test_a_required_tool_call_is_one_of_the_tools_with_valid_arguments_and_a_planted_missing_mask_is_seen(tiny):
    model, tok, _ = tiny
    grammars = guided.Grammars.from_tokenizer(tok, model.config.vocab_size)
    guide = tools.hermes_guide(TOOLS, parallel=False)
    answers = _answers(tiny, lambda: grammars.matcher(guide.type, guide.text))
    params = {t.function.name: t.function.parameters for t in TOOLS}
    for text, ended in answers:
        content, calls = tools.HermesCalls().parse(text)
        assert ended and len(calls) == 1 and content is None, text
        jsonschema.validate(json.loads(calls[0].function.arguments), params[calls[0].function.name])
    planted = _answers(tiny, NoGrammar, max_new=64)
    assert not any(tools.HermesCalls().parse(text)[1] for text, _ in planted), planted
    # parallel calls: one block or more, each a valid call (the random model rarely stops: the last may be cut)
    guide = tools.hermes_guide(TOOLS, parallel=True)
    counts = []
    for text, _ in _answers(tiny, lambda: grammars.matcher(guide.type, guide.text), max_new=160):
        calls = tools.HermesCalls().parse(text)[1]
        counts.append(len(calls))
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    assert min(counts) >= 1 and max(counts) >= 2, counts


def test_a_named_function_guide_allows_that_function_only(tiny):
    model, tok, _ = tiny
    grammars = guided.Grammars.from_tokenizer(tok, model.config.vocab_size)
    guide = tools.hermes_guide(TOOLS[1:], parallel=False)
    for text, _ in _answers(tiny, lambda: grammars.matcher(guide.type, guide.text))[:4]:
        calls = tools.HermesCalls().parse(text)[1]
        assert [c.function.name for c in calls] == ["add"], text


# ------------------------------------------------------------------------------------------------- the parsers
HERMES = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}'


@pytest.mark.parametrize("fmt, text", [("hermes", HERMES), ("llama3_json", LLAMA3)])
def test_each_parser_reads_its_format_whole_and_streamed_in_any_pieces(fmt, text):
    content, calls = tools.BY_NAME[fmt].parser().parse(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris", "unit": "C"})]
    assert content == ("Let me check." if fmt == "hermes" else None)
    for size in (1, 3, 7):
        p = tools.BY_NAME[fmt].parser()
        items = [x for i in range(0, len(text), size) for x in p.feed(text[i:i + size])] + p.flush()
        deltas = [x for x in items if isinstance(x, P.ToolCallDelta)]
        assert "".join(x for x in items if isinstance(x, str)) == (content or "")
        # OpenAI's stream: the first delta names the call (id, type, name, empty arguments), the next its arguments
        assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
        assert deltas[0].function.arguments == "" and deltas[1].id is None
        assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Paris", "unit": "C"}


def test_a_parser_given_another_familys_format_finds_no_call():
    """The planted mismatch: each parser, fed the other format, returns the text as content and no tool call."""
    assert tools.HermesCalls().parse(LLAMA3) == (LLAMA3, [])
    assert tools.Llama3JsonCalls().parse(HERMES) == (HERMES, [])
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    assert tools.HermesCalls().parse(broken) == (broken, [])  # not JSON: content as written


def test_parallel_hermes_calls_and_text_around_them():
    text = HERMES + "\n" + HERMES.split("Let me check.")[1].replace("Paris", "Oslo") + "\n"
    content, calls = tools.HermesCalls().parse(text)
    assert content == "Let me check." and [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Oslo"]
    assert len({c.id for c in calls}) == 2


# ---------------------------------------------------------------------------------------------- the table
def _served(tmp_path, template, model_type="qwen3"):
    from types import SimpleNamespace

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return SimpleNamespace(name="m", tokenizer=SimpleNamespace(chat_template=template), tokenizer_dir=tmp_path)


def test_the_format_comes_from_the_chat_template_or_the_family_and_a_template_without_tools_has_none(tmp_path):
    from pipeline.stages.fetch import CHAT_TEMPLATE

    assert tools.format_for(_served(tmp_path, CHAT_TEMPLATE))[0].name == "hermes"  # tiny-qwen3's: Qwen3's form
    llama = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
    assert tools.format_for(_served(tmp_path, llama, "llama"))[0].name == "llama3_json"  # by family
    fmt, why = tools.format_for(_served(tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}", "llama"))
    assert fmt is None and "does not render tools" in why  # SmolLM2's template
    fmt, why = tools.format_for(_served(tmp_path, llama, "gpt2"))
    assert fmt is None and "gpt2" in why and "hermes for Qwen2.5" in why


# ------------------------------------------------------------------------------------------- the front end
def test_guides_are_compiled_once_per_schema_and_report_the_time(tiny):
    from types import SimpleNamespace

    from pipeline.serving.guide import Guides

    _, tok, _ = tiny
    guides = Guides(SimpleNamespace(name="m", tokenizer=tok, tokenizer_dir="/nonexistent"))
    rf = P.ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
    first = guides.response_format(rf)
    assert first.type == "json_schema" and json.loads(first.text) == guide.json_strings(SCHEMA)
    assert guides.response_format(rf) == first
    assert guides.stats()["compiled"] == 1 and guides.stats()["cache_hits"] == 1 and guides.stats()["compile_s"] > 0
    assert guides.response_format(P.ResponseFormat(type="json_object")).type == "json"
    assert guides.response_format(P.ResponseFormat(type="text")) is None
    with pytest.raises(P.APIError) as err:
        guides.response_format(P.ResponseFormat.model_validate(
            {"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "strin"}}}))
    assert err.value.status == 400 and err.value.param == "response_format" and "strin" in err.value.message


def test_the_tool_plan_follows_tool_choice():
    from types import SimpleNamespace

    fmt = tools.BY_NAME["hermes"]
    served = SimpleNamespace(name="tiny")

    def plan(**kw):
        req = P.ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})
        return tools.plan(req, served, fmt, "", lambda key, build, param: build())

    t = [x.model_dump(exclude_none=True) for x in TOOLS]
    assert plan(tools=t).guide is None and plan(tools=t).format is fmt  # auto: parsed, not guided
    assert plan(tools=t, tool_choice="none").render is None
    assert plan(tools=t, tool_choice="required").guide.type == "ebnf_grammar"
    named = plan(tools=t, tool_choice={"type": "function", "function": {"name": "add"}}).guide.text
    assert '\\"add\\"' in named and "get_weather" not in named
    for kw, param in ((dict(tools=t, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
                      (dict(tool_choice="required"), "tool_choice")):
        with pytest.raises(P.APIError) as err:
            plan(**kw)
        assert err.value.status == 400 and err.value.param == param
    req = P.ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": t})
    with pytest.raises(P.APIError) as err:
        tools.plan(req, served, None, "its chat template does not render tools", lambda key, build, param: build())
    assert err.value.status == 400 and "the model 'tiny' cannot take tools" in err.value.message


def test_a_tool_turn_needs_its_call_id_and_calls_go_back_to_the_template_as_objects():
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]
    out = tools.template_messages(P.ChatRequest.model_validate({"model": "m", "messages": msgs}))
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"} and out[2]["tool_call_id"] == "call_1"
    del msgs[2]["tool_call_id"]
    with pytest.raises(P.APIError) as err:
        tools.template_messages(P.ChatRequest.model_validate({"model": "m", "messages": msgs}))
    assert err.value.param == "messages[2].tool_call_id"


# --------------------------------------------------------------------------------------- the shared records
def test_the_guide_types_and_fields_the_model_files_use_are_the_records():
    import ast
    from pathlib import Path

    from pipeline import upstream
    from pipeline.triton import layouts

    gd = upstream.guided_decoding("1.2.1")
    assert list(guided.GUIDE_TYPES) == gd["triton_backend"]["guide_types"]
    assert set(guided.LLM_API_GUIDE_TYPES) == set(gd["llm_api"]["guide_fields"])
    model_py = Path(layouts.get(layouts.LLMAPI).template_dir("tensorrt_llm.llmapi")) / "1" / "model.py"
    tree = ast.parse(model_py.read_text())
    fields = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                  and getattr(n.targets[0], "id", "") == "GUIDE_FIELDS")
    assert fields == gd["llm_api"]["guide_fields"] == upstream.guided_decoding("main")["llm_api"]["guide_fields"]
    for lay in (layouts.get(layouts.IFB), layouts.get(layouts.LLMAPI)):
        assert list(lay.guide) == gd["triton_backend"]["guide_inputs"]


# --------------------------------------------------------------------------------------------- schema problems
@pytest.mark.parametrize("schema, says", [
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
     "unsupported keyword 'uniqueItems' at $.properties.tags.uniqueItems"),
    ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 3}}},
     "unsupported keyword 'multipleOf' at $.properties.n.multipleOf"),
    ({"type": "object", "requried": ["a"]}, "unsupported keyword 'requried' at $.requried"),
    ({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}, "unsupported keyword 'not' at $.anyOf[1].not"),
    ({"type": "object", "properties": {"a b": {"type": "string", "format": "binary"}}},
     "unsupported format 'binary' at $.properties[\"a b\"].format"),
    ({"properties": {"x": {"$ref": "#/$defs/Y"}}}, "$ref '#/$defs/Y' at $.properties.x.$ref points nowhere"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "keyword 'maxLength' at $.maxLength is not enforced"),
    ({"type": "string", "pattern": "(?<=a)b"}, "pattern at $.pattern does not compile: Regex parsing error"),
    ({"type": "string", "pattern": "(a"}, "'(a' is not a 'regex' at $.pattern"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": "5"}}},
     "'5' is not of type 'integer' at $.properties.a.minLength"),
])
def test_a_schema_xgrammar_cannot_take_is_named_by_keyword_and_json_path(schema, says):
    from pipeline.serving.guide import schema_problems

    problems = schema_problems(schema)
    assert problems and says in problems[0], problems


def test_schemas_clients_send_have_no_problem():
    """The control: the strict schema the openai SDK makes of a pydantic model for chat.completions.parse (enums,
    optional fields, a nested model under $defs, formats), and the tools' schemas above."""
    import datetime
    from typing import Literal, Optional

    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel, Field

    from pipeline.serving.guide import schema_problems

    class Place(BaseModel):
        name: str = Field(max_length=20, description="its name")
        kind: Literal["city", "town"]

    class Trip(BaseModel):
        where: Place
        when: datetime.date
        nights: int = Field(ge=1, le=30)
        note: Optional[str] = None
        stops: list[Place] = Field(max_length=3)

    assert schema_problems(to_strict_json_schema(Trip)) == []
    assert schema_problems(SCHEMA) == [] and all(schema_problems(t.function.parameters) == [] for t in TOOLS)


def test_length_bounded_strings_are_sent_as_json_strings_and_xgrammars_own_rule_is_the_planted_fault():
    """XGrammar 0.1.25 compiles a string bounded by minLength/maxLength to ``[^"\\\r\n]{m,n}``, which takes a raw
    control character (seen on CUDA: a random model's answer held U+000E, which json.loads refuses); the schema the
    front end sends bounds a pattern of JSON's unescaped characters instead, which refuses it and takes the rest."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    sent = guide.json_strings(SCHEMA)
    assert sent["properties"]["tags"]["items"] == {"type": "string", "pattern": '^[^"\\\\\\x00-\\x1f]{0,6}$'}
    raw, fixed = (xgr.Grammar.from_json_schema(json.dumps(s)) for s in (SCHEMA, sent))
    answer = '{"city": "Nice", "population": 3, "capital": true, "tags": [%s]}'
    for tags, valid in (('"ab\u000ec"'.encode().decode("unicode_escape"), False), ('"ab", "été"', True),
                        ('"abcdefg"', False), ('"a\tb"'.encode().decode("unicode_escape"), False)):
        assert accepts(fixed, answer % tags) is valid, tags
        assert _valid(answer % tags, SCHEMA) is valid, tags
    assert accepts(raw, answer % '"ab\u000ec"'.encode().decode("unicode_escape"))  # the fault in XGrammar's own rule
    # the same for a tool's parameters, and strings with a pattern or a format are left as sent
    assert guide.json_strings({"type": "string", "minLength": 2}) == {"type": "string", "pattern": '^[^"\\\\\\x00-\\x1f]{2,}$'}
    for kept in ({"type": "string", "pattern": "^a+$"}, {"type": "string", "format": "date"}, {"type": "integer"}):
        assert guide.json_strings(kept) == kept
    params = tools.call_schema(TOOLS[0], "arguments")["properties"]["arguments"]
    assert params == TOOLS[0].function.parameters  # no length bound there: unchanged
