"""Guided decoding on CUDA: the reference runtime's decode loop applies XGrammar's token bitmask to logits on the GPU
(XGrammar's own CUDA kernel path, ``apply_token_bitmask_inplace`` on a CUDA row), so a json_schema answer and a
required tool call from the random tiny-qwen3 are valid there as on the CPU; the control without the mask is not.
Runs unchanged on any CUDA machine with xgrammar installed (``pytest -m gpu tests/gpu/test_guided_gpu.py``)."""
from __future__ import annotations

import json

import pytest

from tests.helpers.requires import requires_gpu

pytestmark = requires_gpu.marks


@pytest.fixture(scope="module")
def tiny_cuda(tmp_path_factory):
    from tests.helpers import tiny_reference

    model, tok, engine = tiny_reference.build(tmp_path_factory.mktemp("tiny-qwen3"), device="cuda")
    assert next(model.parameters()).device.type == "cuda"
    yield model, tok, engine
    engine.close()


def test_a_json_schema_and_a_required_tool_call_are_valid_on_cuda_and_only_the_grammar_makes_them_so(tiny_cuda):
    import jsonschema

    from pipeline.runtime import guided
    from pipeline.serving import guide, tools
    from tests.unit.test_structured import SCHEMA, TOOLS, NoGrammar, _answers, _valid

    model, tok, _ = tiny_cuda
    grammars = guided.Grammars.from_tokenizer(tok, model.config.vocab_size)
    # the schema as the front end sends it (guide.json_strings: XGrammar's own length-bounded string rule lets a raw
    # control character through, which this test first found here, on CUDA)
    answers = _answers(tiny_cuda, lambda: grammars.matcher("json_schema", json.dumps(guide.json_strings(SCHEMA))))
    assert all(ended for _, ended in answers) and all(_valid(text, SCHEMA) for text, _ in answers), answers
    planted = _answers(tiny_cuda, NoGrammar, max_new=64)
    assert not any(_valid(text, SCHEMA) for text, _ in planted), planted
    guide = tools.hermes_guide(TOOLS, parallel=False)
    params = {t.function.name: t.function.parameters for t in TOOLS}
    for text, ended in _answers(tiny_cuda, lambda: grammars.matcher(guide.type, guide.text)):
        content, calls = tools.HermesCalls().parse(text)
        assert ended and len(calls) == 1 and content is None, text
        jsonschema.validate(json.loads(calls[0].function.arguments), params[calls[0].function.name])
