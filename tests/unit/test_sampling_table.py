"""The one table of sampling parameters (pipeline/triton/layouts/sampling.py) is what the request schema checks, what
the generation request holds, what each layout's record maps and what both codecs send; docs/serving.md shows it."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.serving import protocol as P
from pipeline.triton import layouts
from pipeline.triton.layouts import sampling
from pipeline.triton.layouts.contract import APIError, GenRequest, Spec

REPO = Path(__file__).resolve().parents[2]
ALL = {"temperature": 0.5, "top_p": 0.9, "top_k": 20, "seed": 7, "presence_penalty": 0.5, "frequency_penalty": 0.25,
       "repetition_penalty": 1.1, "min_tokens": 3, "stop": ["END"]}


def _chat(**kw):
    return P.ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def _spec(layout: str, model: str) -> Spec:
    rec = layouts.get(layout).interface()[model]
    return Spec.from_config({"name": model, "max_batch_size": 8, "input": rec["inputs"], "output": rec["outputs"],
                             "model_transaction_policy": {"decoupled": True}})


def _codec(layout: str):
    served = SimpleNamespace(eos_id=2, pad_id=0, tokenizer=SimpleNamespace(encode=lambda s, **k: [5, 6]))
    return layouts.get(layout).codec(served)


def test_every_row_of_the_table_is_a_checked_field_of_both_request_models():
    assert set(ALL) == set(sampling.BY_NAME)
    for model in (P.ChatRequest, P.CompletionRequest):
        assert set(sampling.BY_NAME) <= set(model.model_fields)
    assert _chat(**ALL).sampling() == ALL
    for p in sampling.PARAMS:
        for bound, value in p.check.items():
            outside = value - 1 if bound in ("ge", "gt") else value + (0 if bound == "lt" else 1)
            with pytest.raises(Exception) as err:
                _chat(**{p.name: outside})
            e = P.from_validation(err.value)
            assert e.status == 400 and e.param == p.name, (p.name, bound)


def test_absent_and_unset_values_ask_for_nothing_and_the_default_temperature_is_openais():
    assert _chat().sampling() == {"temperature": 1.0}
    assert _chat(top_k=0, min_tokens=0, stop=["", ""]).sampling() == {"temperature": 1.0}
    assert _chat(top_k=-1, stop="x").sampling() == {"temperature": 1.0, "stop": ["x"]}


def test_each_layout_record_maps_rows_of_the_table_and_a_planted_unknown_row_is_a_problem():
    assert layouts.problems() == []
    lay = layouts.get(layouts.IFB)
    assert set(lay.sampling) == set(sampling.BY_NAME)  # the disagreement of old: repetition_penalty, min_tokens
    planted = dataclasses.replace(lay, sampling={**lay.sampling, "temprature": "temperature"})
    assert any("'temprature', which is no row of the sampling table" in p for p in planted.problems())


def test_the_token_path_takes_each_rows_tensorrt_llm_input_from_upstreams_ensemble():
    from pipeline.triton.layouts.inflight_batcher_llm.openai_codec import llm_inputs

    lay = layouts.get(layouts.IFB)
    names = llm_inputs(lay)
    assert names["top_k"] == "runtime_top_k" and names["top_p"] == "runtime_top_p" and names["seed"] == "seed"
    assert "stop" not in names  # stop_words goes through preprocessing; the token path sends stop_words_list
    assert set(names.values()) <= {t["name"] for t in lay.interface()["tensorrt_llm"]["inputs"]}
    # the control: a record whose tensor the ensemble does not feed to tensorrt_llm gets no token-path input
    assert "top_k" not in llm_inputs(dataclasses.replace(lay, sampling={**lay.sampling, "top_k": "top_kk"}))


def test_both_codecs_send_every_row_they_have_a_tensor_for_and_refuse_the_others_by_name():
    ifb = _codec(layouts.IFB)
    req = GenRequest("hi", None, 8, False, dict(ALL))
    text = ifb.text_inputs(_spec(layouts.IFB, "ensemble"), req)
    assert {k: text[k] for k in ("temperature", "top_p", "top_k", "seed", "repetition_penalty", "min_tokens")} == \
        {k: ALL[k] for k in ("temperature", "top_p", "top_k", "seed", "repetition_penalty", "min_tokens")}
    assert text["stop_words"] == ["END"]
    token = ifb.token_inputs(_spec(layouts.IFB, "tensorrt_llm"), dataclasses.replace(req, prompt_ids=[1, 2]))
    assert token["runtime_top_k"] == 20 and token["runtime_top_p"] == 0.9 and token["min_tokens"] == 3
    assert token["stop_words_list"].shape[1] == 2

    llmapi = _codec(layouts.LLMAPI)
    spec = _spec(layouts.LLMAPI, "tensorrt_llm")
    ok = {k: v for k, v in ALL.items() if k not in ("repetition_penalty", "min_tokens")}
    sent = llmapi.inputs(spec, GenRequest("hi", None, 8, False, ok))
    assert sent["sampling_param_top_k"] == 20 and sent["sampling_param_stop"] == ["END"]
    for name in ("repetition_penalty", "min_tokens"):
        with pytest.raises(APIError) as err:
            llmapi.inputs(spec, GenRequest("hi", None, 8, False, {**ok, name: ALL[name]}))
        assert err.value.status == 400 and err.value.param == name and "llmapi" in err.value.message


def test_greedy_and_sampling_keep_openais_meaning():
    ifb, spec = _codec(layouts.IFB), _spec(layouts.IFB, "ensemble")
    assert ifb.text_inputs(spec, GenRequest("hi", None, 8, False, {"temperature": 0.0}))["top_k"] == 1
    sampled = ifb.text_inputs(spec, GenRequest("hi", None, 8, False, {"temperature": 1.0}))
    assert sampled["top_p"] == 1.0 and "temperature" not in sampled and "top_k" not in sampled


def test_docs_show_the_table_as_the_code_has_it():
    text = (REPO / sampling.DOC).read_text()
    assert sampling.START in text and sampling.doc_text(text, layouts.LAYOUTS) == text
    # the control: a row changed in the code makes the committed table stale
    old = sampling.PARAMS
    try:
        sampling.PARAMS = old[:-1]
        assert sampling.doc_text(text, layouts.LAYOUTS) != text
    finally:
        sampling.PARAMS = old
