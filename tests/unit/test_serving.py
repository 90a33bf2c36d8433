"""The OpenAI front end's request schema, stop-string scanner and log-prob math, in process (the served behaviour
is tested end to end in tests/e2e/test_openai*.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.serving import protocol as P
from pipeline.serving.app import StopScanner
from pipeline.serving.driver import _top


def _chat(**kw):
    return P.ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def test_unknown_fields_are_refused_by_name():
    with pytest.raises(Exception) as err:
        _chat(temprature=0.5)
    e = P.from_validation(err.value)
    assert e.status == 400 and e.param == "temprature" and "unrecognized request argument: temprature" in e.message


@pytest.mark.parametrize("kw, words", [
    (dict(n=3), "n=3"), (dict(logit_bias={"1": 2.0}), "logit_bias"),
    (dict(tools=[{"type": "function"}]), "tools"), (dict(tool_choice="required"), "tool_choice"),
    (dict(response_format={"type": "json_schema"}), "response_format"),
    (dict(reasoning_effort="low"), "reasoning_effort"), (dict(stream_options={"include_usage": True}), "stream_options"),
])
def test_output_changing_fields_that_cannot_be_honoured_are_400(kw, words):
    with pytest.raises(P.APIError) as err:
        P.unsupported(_chat(**kw))
    assert err.value.status == 400 and words in err.value.message


def test_harmless_and_default_values_pass():
    for kw in (dict(n=1), dict(logit_bias={}), dict(tool_choice="none"), dict(response_format={"type": "text"}),
               dict(user="u", store=False, metadata={"a": 1}), dict(stream=True, stream_options={"include_usage": True})):
        P.unsupported(_chat(**kw))


def test_completion_prompts_in_every_shape():
    def prompts(p):
        return P.CompletionRequest.model_validate({"model": "m", "prompt": p}).prompts()

    assert prompts("a") == ["a"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2, 3]) == [[1, 2, 3]]
    assert prompts([[1, 2], [3]]) == [[1, 2], [3]]
    with pytest.raises(P.APIError):
        prompts([])


def test_top_logprobs_needs_logprobs():
    with pytest.raises(P.APIError, match="top_logprobs needs logprobs"):
        _chat(top_logprobs=2).num_logprobs()
    assert _chat(logprobs=True).num_logprobs() == 0 and _chat(logprobs=True, top_logprobs=3).num_logprobs() == 3
    assert _chat().num_logprobs() is None


def test_stop_scanner_cuts_at_the_first_stop_across_pieces():
    s = StopScanner(["END", "\n\n"])
    out = "".join(s.feed(p) for p in ["Hello E", "N", "D world"])
    assert (out, s.hit) == ("Hello ", True)
    s = StopScanner(["END"])
    out = "".join(s.feed(p) for p in ["Hello E", "x"]) + s.flush()
    assert (out, s.hit) == ("Hello Ex", False)  # a held-back prefix that was not a stop comes out whole
    s = StopScanner([])
    assert s.feed("abc") == "abc"
    # the control: a scanner that never holds back would leak the stop's first letters
    s = StopScanner(["END"])
    assert s.feed("xE") == "x"


def test_top_log_probs_are_a_normalized_log_softmax():
    row = np.array([1.0, 3.0, 2.0, -1.0], dtype=np.float32)
    lp, top = _top(row, 2)
    assert math.isclose(float(np.exp(lp).sum()), 1.0, rel_tol=1e-9)
    assert [t for t, _ in top] == [1, 2] and top[0][1] == pytest.approx(float(lp[1]))
    assert top[0][1] == pytest.approx(3.0 - math.log(sum(math.exp(x) for x in row)))
    assert _top(row, 0)[1] == []
