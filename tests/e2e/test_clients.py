"""The requests NVIDIA's own clients send, sent with tritonclient to the reference deployment of each layout,
decoupled and not, in the request mode each client uses. Written down from reading the clients (never copied):

- ``inflight_batcher_llm/client/end_to_end_grpc_client.py`` (tensorrtllm_backend @ c2e65b8): gRPC *stream*
  (``start_stream``/``async_stream_infer``/``stop_stream``) to ``ensemble`` (or ``--model-name tensorrt_llm_bls``)
  with ``text_input`` [[prompt]] BYTES, ``max_tokens`` [[n]] INT32, ``stream`` [[S]] BOOL, ``beam_width`` [[1]]
  INT32, ``temperature`` [[1.0]] FP32, ``exclude_input_in_output`` [[False]] BOOL; requests ``text_output`` and reads
  ``text_output[0]``; ``--batch-inputs`` stacks prompts into one [batch, 1] request and also requests
  ``batch_index``, read as ``batch_index[0][0]``.
- ``inflight_batcher_llm/client/inflight_batcher_llm_client.py``: ``tensorrt_llm`` directly with ``input_ids``
  [[ids]], ``input_lengths``, ``request_output_len`` [[16]], ``beam_width`` [[1]], ``temperature`` [[1.0]],
  ``streaming`` [[S]], ``end_id``/``pad_id`` [[id]] INT32, ``runtime_top_k`` [[1]] INT32, ``runtime_top_p`` [[0.0]]
  FP32; unary gRPC ``async_infer`` without ``-S``, a gRPC stream with it; reads ``output_ids[0][0]`` and
  ``sequence_length[0][0]``.
- ``tools/inflight_batcher_llm/end_to_end_test.py`` (HTTP or gRPC, unary ``infer``): ``preprocessing`` with
  ``QUERY`` [[p]], ``BAD_WORDS_DICT``/``STOP_WORDS_DICT`` [[""]], ``REQUEST_OUTPUT_LEN`` [[n]], reading ``INPUT_ID``,
  ``REQUEST_INPUT_LEN``, ``REQUEST_OUTPUT_LEN``, ``DECODER_INPUT_ID``, ``OUT_END_ID``, ``OUT_PAD_ID``; then
  ``tensorrt_llm`` with ``input_ids``, ``decoder_input_ids``, ``input_lengths``, ``request_output_len``, ``end_id``,
  ``pad_id``; then ``postprocessing`` with ``TOKENS_BATCH``/``SEQUENCE_LENGTH``; then ``ensemble`` with ``text_input``,
  ``max_tokens``, ``bad_words``/``stop_words`` [[""]]; ``--test-bls`` sends the same to ``tensorrt_llm_bls`` and
  asserts its ``text_output`` equals the ensemble's. ``--test-llmapi``: ``text_input`` [p] and
  ``sampling_param_max_tokens`` [n] (1-D), optional ``streaming`` [True] over a gRPC stream and
  ``return_finish_reason``/``return_stop_reason`` [True], reading ``text_output[0]``, ``finish_reason``,
  ``stop_reason``.
- ``triton_backend/tools/llmapi_client.py`` (TensorRT-LLM): unary gRPC ``async_infer`` to ``tensorrt_llm`` with
  ``text_input`` [p] BYTES and ``sampling_param_max_tokens`` [n] INT32 (1-D), request parameter ``Streaming``;
  reads ``text_output[0]``.

A decoupled model refuses unary ``ModelInfer``, and streaming asks for a decoupled model: those two refusals are the
same as upstream's and are asserted as refusals. One repository per layout x decoupled pair is rendered from the
shared tiny-qwen3 build and served once.
"""
from __future__ import annotations

import json
import queue
import shutil
import time
import urllib.request
from functools import partial

import numpy as np
import pytest

from pipeline import hardware
from pipeline.catalog import ENGINE_REL
from pipeline.triton.repository import render_repository
from pipeline.triton import lint, server
from tests.conftest import TINY

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
PROMPT = "The capital of France is"


def _serve(layout, decoupled, tiny_build, tmp_path_factory):
    src = next(tiny_build.glob("triton_repo/*-package-*/manifest.json")).parent / ENGINE_REL
    repo = tmp_path_factory.mktemp(f"{layout}-{decoupled}") / "repo"
    shutil.copytree(src, repo / ENGINE_REL)
    cfg = hardware.compose([*TINY, f"serve.layout={layout}", f"serve.decoupled={str(decoupled).lower()}"])
    render_repository(cfg, repo)
    assert lint.lint(repo) == []
    return server.local_server(repo, host="127.0.0.1", server_bin=None, work_dir=repo.parent / "w", timeout_s=600), repo


@pytest.fixture(scope="module", params=[True, False], ids=["decoupled", "unary"])
def ifb(request, tiny_build, tmp_path_factory):
    """(decoupled, server, repo): the reference runtime's inflight_batcher_llm repository, served."""
    running, repo = _serve("inflight_batcher_llm", request.param, tiny_build, tmp_path_factory)
    with running as s:
        yield request.param, s, repo


@pytest.fixture(scope="module", params=[True, False], ids=["decoupled", "unary"])
def llmapi(request, tiny_build, tmp_path_factory):
    """(decoupled, server, repo): the reference runtime's llmapi repository, served."""
    running, repo = _serve("llmapi", request.param, tiny_build, tmp_path_factory)
    with running as s:
        yield request.param, s, repo


def _grpc(s):
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(s.grpc_url)


def _inputs(module, **arrays):
    from tritonclient.utils import np_to_triton_dtype

    out = []
    for name, arr in arrays.items():
        t = module.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _stream(client, model, inputs, outputs=None, parameters=None):
    """A gRPC stream as the clients use it: every response (or error) until the server closes the stream."""
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), got))
    client.async_stream_infer(model, inputs, outputs=outputs, request_id="1", parameters=parameters)
    client.stop_stream()
    items = []
    while not got.empty():
        items.append(got.get())
    return items


def _errors(items):
    from tritonclient.utils import InferenceServerException

    return [str(i) for i in items if isinstance(i, InferenceServerException)]


def _text(result, name="text_output"):
    out = result.as_numpy(name)
    return None if out is None else out.reshape(-1)[0].decode("utf-8", "replace")


def e2e_grpc_inputs(prompts, streaming, *, max_tokens=8):
    import tritonclient.grpc as grpcclient

    n = len(prompts)
    return _inputs(grpcclient, text_input=np.array([[p] for p in prompts], dtype=object),
                   max_tokens=np.full((n, 1), max_tokens, dtype=np.int32),
                   stream=np.full((n, 1), streaming, dtype=bool), beam_width=np.ones((n, 1), dtype=np.int32),
                   temperature=np.ones((n, 1), dtype=np.float32),
                   exclude_input_in_output=np.zeros((n, 1), dtype=bool))


# ---------------------------------------------------------------------------- end_to_end_grpc_client.py
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("streaming", [False, True])
def test_end_to_end_grpc_client(ifb, model, streaming):
    import tritonclient.grpc as grpcclient

    decoupled, s, _ = ifb
    client = _grpc(s)
    items = _stream(client, model, e2e_grpc_inputs([PROMPT], streaming),
                    outputs=[grpcclient.InferRequestedOutput("text_output")])
    if streaming and not decoupled:  # upstream refuses the same: streaming needs decoupled mode
        assert _errors(items) and "decoupled" in _errors(items)[0]
        return
    assert _errors(items) == []
    texts = [_text(r) for r in items if r.as_numpy("text_output") is not None]
    assert texts, "no text_output"
    if streaming:
        assert len(texts) > 1 and "".join(texts)  # one response per token
    else:
        assert len(texts) == 1 and texts[0].startswith(PROMPT) and len(texts[0]) > len(PROMPT)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_end_to_end_grpc_client_batch_inputs(ifb, model):
    import tritonclient.grpc as grpcclient

    s = ifb[1]
    prompts = [PROMPT, "Water boils at"]
    items = _stream(_grpc(s), model, e2e_grpc_inputs(prompts, False),
                    outputs=[grpcclient.InferRequestedOutput("text_output"),
                             grpcclient.InferRequestedOutput("batch_index")])
    assert _errors(items) == []
    by_index = {}
    for r in items:  # decoupled: one response per prompt; unary: one response holding both rows
        texts, index = r.as_numpy("text_output"), r.as_numpy("batch_index")
        if texts is not None:
            for row, b in zip(texts.reshape(-1), index.reshape(-1)):
                by_index[int(b)] = row.decode("utf-8", "replace")
    assert sorted(by_index) == [0, 1]
    for i, p in enumerate(prompts):
        assert by_index[i].startswith(p) and len(by_index[i]) > len(p)


# ------------------------------------------------------------------------ inflight_batcher_llm_client.py
def _ibl_inputs(repo, streaming, beam_width=1):
    import tritonclient.grpc as grpcclient
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(repo / ENGINE_REL)
    ids = [tok.encode(PROMPT)]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return ids, _inputs(grpcclient, input_ids=np.array(ids, dtype=np.int32),
                        input_lengths=np.array([[len(ids[0])]], dtype=np.int32),
                        request_output_len=np.array([[16]], dtype=np.int32),
                        beam_width=np.array([[beam_width]], dtype=np.int32),
                        temperature=np.array([[1.0]], dtype=np.float32),
                        streaming=np.array([[streaming]], dtype=bool),
                        end_id=np.array([[tok.eos_token_id]], dtype=np.int32),
                        pad_id=np.array([[pad]], dtype=np.int32),
                        runtime_top_k=np.array([[1]], dtype=np.int32),
                        runtime_top_p=np.array([[0.0]], dtype=np.float32))


def test_inflight_batcher_llm_client_unary(ifb):
    from tritonclient.utils import InferenceServerException

    decoupled, s, repo = ifb
    _, inputs = _ibl_inputs(repo, False)
    got: queue.Queue = queue.Queue()
    client = _grpc(s)
    client.async_infer("tensorrt_llm", inputs, callback=partial(lambda q, result, error: q.put(error or result), got),
                       request_id="1", parameters={"Streaming": False})
    result = got.get(timeout=120)
    if decoupled:  # unary ModelInfer cannot reach a decoupled model, upstream's included
        assert isinstance(result, InferenceServerException) and "decoupled" in str(result)
        return
    assert not isinstance(result, InferenceServerException), result
    out, lengths = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
    assert out.ndim == 3 and 0 < int(lengths[0][0]) <= out.shape[2]
    assert len(out[0][0][: int(lengths[0][0])]) > 0


def test_inflight_batcher_llm_client_streaming(ifb):
    decoupled, s, repo = ifb
    _, inputs = _ibl_inputs(repo, True)
    items = _stream(_grpc(s), "tensorrt_llm", inputs, parameters={"Streaming": True})
    if not decoupled:
        assert _errors(items) and "decoupled" in _errors(items)[0]
        return
    assert _errors(items) == []
    tokens = [t for r in items if r.as_numpy("output_ids") is not None and int(r.as_numpy("sequence_length")[0][0]) > 0
              for t in r.as_numpy("output_ids")[0][0][: int(r.as_numpy("sequence_length")[0][0])]]
    assert 0 < len(tokens) <= 16


def test_beam_search_is_refused_naming_the_feature(ifb):
    decoupled, s, repo = ifb
    _, inputs = _ibl_inputs(repo, False, beam_width=2)
    items = _stream(_grpc(s), "tensorrt_llm", inputs)
    assert _errors(items) and "beam_width" in _errors(items)[0]


# --------------------------------------------------------------------------- end_to_end_test.py (ifb)
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_end_to_end_test_calls_each_model(ifb, protocol):
    decoupled, s, _ = ifb
    if decoupled:
        pytest.skip("end_to_end_test.py sends unary requests, which a decoupled model refuses (upstream too)")
    if protocol == "http":
        import tritonclient.http as mod

        client = mod.InferenceServerClient(s.http_url.removeprefix("http://"))
    else:
        import tritonclient.grpc as mod

        client = mod.InferenceServerClient(s.grpc_url)
    empty = np.array([[""]], dtype=object)
    pre = client.infer("preprocessing", _inputs(
        mod, QUERY=np.array([[PROMPT]], dtype=object), BAD_WORDS_DICT=empty, STOP_WORDS_DICT=empty,
        REQUEST_OUTPUT_LEN=np.array([[8]], dtype=np.int32)))
    got = {n: pre.as_numpy(n) for n in ("INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN", "DECODER_INPUT_ID",
                                        "OUT_END_ID", "OUT_PAD_ID")}
    assert all(v is not None for v in got.values()), got
    assert int(got["REQUEST_INPUT_LEN"][0][0]) == got["INPUT_ID"].shape[1]
    llm = client.infer("tensorrt_llm", _inputs(
        mod, input_ids=got["INPUT_ID"], decoder_input_ids=got["DECODER_INPUT_ID"],
        input_lengths=got["REQUEST_INPUT_LEN"], request_output_len=got["REQUEST_OUTPUT_LEN"],
        end_id=got["OUT_END_ID"], pad_id=got["OUT_PAD_ID"]))
    post = client.infer("postprocessing", _inputs(
        mod, TOKENS_BATCH=llm.as_numpy("output_ids").astype(np.int32), SEQUENCE_LENGTH=llm.as_numpy("sequence_length")))
    assert post.as_numpy("OUTPUT").reshape(-1)[0]
    words = {"text_input": np.array([[PROMPT]], dtype=object), "max_tokens": np.array([[8]], dtype=np.int32),
             "bad_words": empty, "stop_words": empty}
    ensemble = client.infer("ensemble", _inputs(mod, **words)).as_numpy("text_output")
    bls = client.infer("tensorrt_llm_bls", _inputs(mod, **words)).as_numpy("text_output")
    assert ensemble.reshape(-1)[0] and (ensemble == bls).all()  # --test-bls asserts the two agree


def test_stop_words_end_generation_through_the_generate_endpoint(ifb):
    """HTTP generate maps JSON keys to the ensemble's inputs: a stop word ends the output (never ignored)."""
    from transformers import AutoTokenizer

    decoupled, s, repo = ifb
    if decoupled:
        pytest.skip("the unary generate endpoint needs a non-decoupled ensemble")
    tok = AutoTokenizer.from_pretrained(repo / ENGINE_REL)

    def generate(**extra):
        body = json.dumps({"text_input": PROMPT, "max_tokens": 12, "top_k": 1, **extra}).encode()
        req = urllib.request.Request(f"{s.http_url}/v2/models/ensemble/generate", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["text_output"]

    full = generate()
    ids = tok.encode(full, add_special_tokens=False)
    k = next((i for i in range(1, len(ids) - 1) if tok.encode(tok.decode([ids[i]]), add_special_tokens=False)
              == [ids[i]]), None)
    if k is None:
        pytest.skip("no generated token round-trips through the tokenizer on its own")
    stopped = generate(stop_words=[tok.decode([ids[k]])])
    assert len(stopped) < len(full) and full.startswith(stopped)


def test_http_generate_stream(ifb):
    decoupled, s, _ = ifb
    if not decoupled:
        pytest.skip("generate_stream with stream=true needs the decoupled ensemble")
    body = json.dumps({"text_input": PROMPT, "max_tokens": 6, "stream": True}).encode()
    req = urllib.request.Request(f"{s.http_url}/v2/models/ensemble/generate_stream", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [json.loads(line[5:]) for line in r.read().decode().splitlines() if line.startswith("data:")]
    assert len(events) > 1 and all("error" not in e for e in events)


# ----------------------------------------------------------------------- llmapi_client.py, --test-llmapi
def _llmapi_inputs(module, prompt=PROMPT, max_tokens=8, **extra):
    return _inputs(module, text_input=np.array([prompt], dtype=object),
                   sampling_param_max_tokens=np.array([max_tokens], dtype=np.int32), **extra)


def test_llmapi_client(llmapi):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    decoupled, s, _ = llmapi
    got: queue.Queue = queue.Queue()
    _grpc(s).async_infer("tensorrt_llm", _llmapi_inputs(grpcclient, max_tokens=16), outputs=None, request_id="1",
                         callback=partial(lambda q, result, error: q.put(error or result), got),
                         parameters={"Streaming": False})
    result = got.get(timeout=120)
    if decoupled:
        assert isinstance(result, InferenceServerException) and "decoupled" in str(result)
        return
    assert not isinstance(result, InferenceServerException), result
    assert result.as_numpy("text_output").shape == (1,) and _text(result)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_end_to_end_test_llmapi(llmapi, protocol):
    decoupled, s, _ = llmapi
    if decoupled:
        pytest.skip("--test-llmapi without --streaming sends unary requests")
    if protocol == "http":
        import tritonclient.http as mod

        client = mod.InferenceServerClient(s.http_url.removeprefix("http://"))
        outputs = [mod.InferRequestedOutput(n) for n in ("text_output", "finish_reason", "stop_reason")]
    else:
        import tritonclient.grpc as mod

        client = mod.InferenceServerClient(s.grpc_url)
        outputs = [mod.InferRequestedOutput(n) for n in ("text_output", "finish_reason", "stop_reason")]
    flags = {"return_finish_reason": np.array([True]), "return_stop_reason": np.array([True])}
    result = client.infer("tensorrt_llm", _llmapi_inputs(mod, **flags), outputs=outputs, request_id="0")
    assert _text(result) and result.as_numpy("finish_reason") is not None
    assert result.as_numpy("stop_reason") is not None
    plain = client.infer("tensorrt_llm", _llmapi_inputs(mod), outputs=[mod.InferRequestedOutput("text_output")])
    assert _text(plain)


def test_end_to_end_test_llmapi_streaming(llmapi):
    import tritonclient.grpc as grpcclient

    decoupled, s, _ = llmapi
    items = _stream(_grpc(s), "tensorrt_llm", _llmapi_inputs(grpcclient, streaming=np.array([True])),
                    outputs=[grpcclient.InferRequestedOutput("text_output")])
    if not decoupled:
        assert _errors(items) and "decoupled" in _errors(items)[0]
        return
    assert _errors(items) == []
    texts = [_text(r) for r in items if r.as_numpy("text_output") is not None]
    assert len(texts) > 1 and "".join(texts)


# ------------------------------------------------- the llmapi model's inputs and outputs, as upstream answers them
# Upstream: TensorRT-LLM triton_backend/all_models/llmapi/tensorrt_llm/1/model.py @ 044a90d209 (``_create_response``,
# ``handle_stop_request``, ``cancellation_loop``) and helpers.py ``get_sampling_params_from_request``; the LLM API
# behind it: tensorrt_llm/sampling_params.py, tensorrt_llm/executor/result.py ``_handle_sequence``.
def _llmapi_ask(llmapi, request_id="1", **extra):
    """One request with ``extra`` inputs as ``--test-llmapi`` sends them (1-D tensors): a gRPC stream to the decoupled
    model, a unary gRPC infer to the other. -> every response (or error)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    decoupled, s, _ = llmapi
    prompt, max_tokens = extra.pop("prompt", PROMPT), extra.pop("max_tokens", 8)
    if max_tokens is None:  # left to the model's default
        inputs = _inputs(grpcclient, text_input=np.array([prompt], dtype=object), **extra)
    else:
        inputs = _llmapi_inputs(grpcclient, prompt=prompt, max_tokens=max_tokens, **extra)
    if decoupled:
        got: queue.Queue = queue.Queue()
        client = _grpc(s)
        client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), got))
        client.async_stream_infer("tensorrt_llm", inputs, request_id=request_id)
        client.stop_stream()
        return [got.get() for _ in range(got.qsize())]
    try:
        return [_grpc(s).infer("tensorrt_llm", inputs, request_id=request_id)]
    except InferenceServerException as exc:
        return [exc]


def _one(llmapi, **extra):
    items = _llmapi_ask(llmapi, **extra)
    assert _errors(items) == [] and len(items) == 1, items
    return items[0]


def _tokenizer(repo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(repo / ENGINE_REL)


def test_llmapi_sampling_defaults_and_greedy_rule(llmapi):
    """helpers.py passes only the sampling inputs a request carries to ``SamplingParams`` (max_tokens defaults to 32
    there), and ``SamplingParams.params_imply_greedy_decoding`` decodes greedily when none of temperature, top_k,
    top_p is given, or top_k is 1, top_p 0 or temperature 0; anything else samples (an unset temperature is 1)."""
    tok = _tokenizer(llmapi[2])
    excl = {"sampling_param_exclude_input_from_output": np.array([True])}
    default = _text(_one(llmapi, max_tokens=None, **excl))  # no sampling_param_max_tokens: 32 tokens
    assert default == _text(_one(llmapi, max_tokens=32, **excl)) != _text(_one(llmapi, max_tokens=31, **excl))
    assert len(tok.encode(default, add_special_tokens=False)) >= 30
    temp1, top_k50 = np.array([1.0], np.float32), np.array([50], np.int32)
    for greedy in ({"sampling_param_top_k": np.array([1], np.int32), "sampling_param_temperature": temp1},
                   {"sampling_param_top_p": np.array([0.0], np.float32), "sampling_param_temperature": temp1},
                   {"sampling_param_temperature": np.array([0.0], np.float32), "sampling_param_top_k": top_k50}):
        assert _text(_one(llmapi, max_tokens=32, **excl, **greedy)) == default, greedy
    # top_k alone is not greedy: it samples at temperature 1 (the control: some seed gives another text)
    sampled = {_text(_one(llmapi, max_tokens=32, **excl, sampling_param_top_k=np.array([50], np.int32),
                          sampling_param_seed=np.array([seed], np.uint64))) for seed in (1, 2, 3)}
    assert sampled - {default}
    bad = _llmapi_ask(llmapi, sampling_param_top_p=np.array([1.5], np.float32))
    assert _errors(bad) and "top_p" in _errors(bad)[0]


def test_llmapi_seed_reproduces_a_sampled_text(llmapi):
    """``sampling_param_seed`` goes to ``SamplingParams.seed``: the same seed and inputs sample the same text, another
    seed another one."""
    def text(seed):
        return _text(_one(llmapi, max_tokens=16, sampling_param_temperature=np.array([1.0], np.float32),
                          sampling_param_seed=np.array([seed], np.uint64)))

    a = text(11)
    assert a == text(11)
    assert {text(12), text(13)} - {a}


def test_llmapi_exclude_input_from_output(llmapi):
    """Upstream's helpers.py defaults ``sampling_param_exclude_input_from_output`` to False (the LLM API's own default
    is True): one response holds the prompt and the generated text (TensorRT-LLM llmRequest.h ``createResult``
    returns the prompt's tokens unless excluded); with it true only the generated text. Streamed responses never
    carry the prompt (only tokens not yet sent are returned when streaming)."""
    with_prompt = _text(_one(llmapi))
    without = _text(_one(llmapi, sampling_param_exclude_input_from_output=np.array([True])))
    assert with_prompt == PROMPT + without and without
    if llmapi[0]:
        items = _llmapi_ask(llmapi, streaming=np.array([True]))
        texts = [_text(r) for r in items]
        assert _errors(items) == [] and len(texts) > 1 and texts[-1] == without
        assert not any(t.startswith(PROMPT) for t in texts)


def test_llmapi_finish_and_stop_reasons(llmapi):
    """``return_finish_reason`` / ``return_stop_reason`` / ``return_cumulative_logprob`` add ``str()`` of the
    ``CompletionOutput`` fields (model.py ``_create_response``) as STRING tensors: ``length`` at max_tokens with stop
    reason ``None``; a ``sampling_param_stop`` string ends generation with finish reason ``stop``, stop reason the
    string, and the string cut from the text (result.py ``_handle_sequence``: the output's token ids ending with the
    stop word's ids, encoded without special tokens by ``SamplingParams._setup``). ``cumulative_logprob`` is ``None``:
    upstream never asks the LLM API for log probs."""
    flags = {k: np.array([True]) for k in ("return_finish_reason", "return_stop_reason", "return_cumulative_logprob",
                                           "sampling_param_exclude_input_from_output")}
    r = _one(llmapi, max_tokens=12, **flags)
    for name in ("finish_reason", "stop_reason", "cumulative_logprob"):
        assert r.as_numpy(name).dtype == object
    assert r.as_numpy("finish_reason").tolist() == [b"length"]
    assert r.as_numpy("stop_reason").tolist() == [b"None"]
    assert r.as_numpy("cumulative_logprob").tolist() == [b"None"]
    full = _text(r)
    tok = _tokenizer(llmapi[2])
    ids = tok.encode(full, add_special_tokens=False)
    # upstream matches a stop string's token ids against the generated ids, so a string fires only where the model
    # generated exactly that token: try one-token strings of the text (words first) until one ends generation
    words = [tok.decode([i]) for i in dict.fromkeys(ids[2:])]
    words = [w for w in words if w.strip() and len(tok.encode(w, add_special_tokens=False)) == 1]
    for stop in sorted(words, key=lambda w: not w.strip().isalpha()):
        s = _one(llmapi, max_tokens=12, sampling_param_stop=np.array([stop.encode()], dtype=object), **flags)
        if s.as_numpy("finish_reason").tolist() == [b"stop"]:
            break
    else:
        pytest.fail(f"no stop string of {words!r} ended the generation of {full!r}")
    assert s.as_numpy("stop_reason").tolist() == [stop.encode()]
    assert full.startswith(_text(s) + stop) and len(_text(s)) < len(full)
    if llmapi[0]:  # streamed: every response but the last has no reason yet
        items = _llmapi_ask(llmapi, max_tokens=6, streaming=np.array([True]), **flags)
        reasons = [r.as_numpy("finish_reason").tolist() for r in items]
        assert reasons[:-1] == [[b"None"]] * (len(items) - 1) and reasons[-1] == [b"length"]


PERF = ("kv_cache_reused_block", "kv_cache_missed_block", "kv_cache_alloc_new_blocks", "kv_cache_alloc_total_blocks",
        "kv_cache_hit_rate", "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
        "last_token_time_ns", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")


def test_llmapi_perf_metrics(llmapi):
    """``sampling_param_return_perf_metrics`` makes the LLM API fill ``request_perf_metrics``, which model.py's
    ``_create_response`` sends as the KV-cache, timing and speculative-decoding outputs, each as a tensor of the
    text_output's STRING type (TensorRT-LLM PR 5554 shows them as "76735247746000", "0.0"); without the flag none is
    sent. Times: arrival <= first scheduled <= first token <= last token; a new prompt reuses no block and misses
    its blocks; no speculative decoding, so no draft tokens."""
    plain = _one(llmapi)
    assert all(plain.as_numpy(n) is None for n in PERF)
    r = _one(llmapi, max_tokens=8, sampling_param_return_perf_metrics=np.array([True]))
    got = {}
    for n in PERF:
        a = r.as_numpy(n)
        assert a is not None and a.dtype == object and a.shape == (1,), n
        got[n] = float(a[0])
    assert 0 < got["arrival_time_ns"] <= got["first_scheduled_time_ns"] <= got["first_token_time_ns"]
    assert got["first_token_time_ns"] < got["last_token_time_ns"]
    assert got["kv_cache_reused_block"] == 0 and got["kv_cache_hit_rate"] == 0.0
    assert got["kv_cache_missed_block"] >= 1 and got["kv_cache_alloc_total_blocks"] >= got["kv_cache_missed_block"]
    assert got["kv_cache_alloc_new_blocks"] == got["kv_cache_alloc_total_blocks"]
    assert got["acceptance_rate"] == 0 and got["total_accepted_draft_tokens"] == got["total_draft_tokens"] == 0


def test_llmapi_stop_cancels_the_request_by_id(llmapi):
    """``stop`` true with a request's id (model.py ``handle_stop_request``) aborts the running request of that id and
    answers the stop request itself with a CANCELLED error "Request cancelled by client"; a stop request without an
    id fails. The aborted streaming request ends with the LLM API's last output: its text so far, finish reason
    ``cancelled``. (A non-streaming request so cancelled gets no response at all from upstream, whose client then
    waits forever; the reference ends it with the CANCELLED error instead.)"""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    decoupled, s, _ = llmapi
    long = dict(max_tokens=1500, return_finish_reason=np.array([True]))
    stop = _inputs(grpcclient, text_input=np.array([""], dtype=object), stop=np.array([True]))
    no_id = _errors(_llmapi_ask(llmapi, request_id="", prompt="", stop=np.array([True])))
    assert no_id and "A request id must be provided" in no_id[0]
    client = _grpc(s)
    got: queue.Queue = queue.Queue()
    if decoupled:
        client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), got))
        client.async_stream_infer("tensorrt_llm", _llmapi_inputs(grpcclient, **long, streaming=np.array([True])),
                                  request_id="cancel-me")
        first = got.get(timeout=120)
        assert not isinstance(first, InferenceServerException), first
        client.async_stream_infer("tensorrt_llm", stop, request_id="cancel-me")
        client.stop_stream()  # returns once the server has ended both requests
        items = [first] + [got.get() for _ in range(got.qsize())]
        errors = _errors(items)
        assert len(errors) == 1 and "Request cancelled by client" in errors[0]
        results = [r for r in items if not isinstance(r, InferenceServerException)]
        assert results[-1].as_numpy("finish_reason").tolist() == [b"cancelled"]
        assert all(r.get_response().id == "cancel-me" for r in results)
        assert len(results) < 1500
    else:
        # a prompt whose greedy text runs to the length limit: the tiny model's noise hits its end token early for
        # most prompts (which ones depends on the compute dtype), and a request that has ended cannot be stopped
        for prompt in (PROMPT, "x y z", "1 2 3", "Once upon a time", "def f():"):
            started = time.monotonic()
            probe = client.infer("tensorrt_llm", _llmapi_inputs(grpcclient, prompt, **long))
            if probe.as_numpy("finish_reason").tolist() == [b"length"]:
                break
        else:
            pytest.fail("no prompt ran the tiny model to its length limit; the stop test needs a long request")
        took = time.monotonic() - started
        client.async_infer("tensorrt_llm", _llmapi_inputs(grpcclient, prompt, **long), request_id="cancel-me",
                           callback=partial(lambda q, result, error: q.put(error or result), got))
        time.sleep(min(1.0, took / 4))
        with pytest.raises(InferenceServerException, match="Request cancelled by client"):
            client.infer("tensorrt_llm", stop, request_id="cancel-me")
        ended = got.get(timeout=60)
        assert isinstance(ended, InferenceServerException), f"ended by {ended.as_numpy('finish_reason')}, not the stop"
        assert "cancelled" in str(ended).lower()
    # a stop for an id nothing runs under is answered the same way
    if decoupled:
        items = _stream(client, "tensorrt_llm", stop)
        assert len(items) == 1 and "Request cancelled by client" in _errors(items)[0]
    else:
        with pytest.raises(InferenceServerException, match="Request cancelled by client"):
            client.infer("tensorrt_llm", stop, request_id="nothing-runs")


def test_temperature_alone_decodes_greedily(ifb):
    """TensorRT-LLM reads top-k 0 with top-p 0 (their defaults) as greedy decoding whatever the temperature
    (TensorRT-LLM cpp/tensorrt_llm/kernels/samplingTopKKernels.h ``regularizeTopKTopP``): the request of
    ``end_to_end_grpc_client.py`` (temperature 1.0, no top_k/top_p) answers what an explicit greedy request (top_k 1)
    does, while sampling the whole distribution (top_p 1) answers otherwise."""
    import tritonclient.grpc as grpcclient

    s = ifb[1]
    client = _grpc(s)

    def text(**extra):
        items = _stream(client, "ensemble", e2e_grpc_inputs([PROMPT], False, max_tokens=16)
                        + _inputs(grpcclient, **extra), outputs=[grpcclient.InferRequestedOutput("text_output")])
        assert _errors(items) == []
        return "".join(_text(r) for r in items if r.as_numpy("text_output") is not None)

    default = text()
    assert default == text(top_k=np.array([[1]], dtype=np.int32))
    assert default != text(top_p=np.array([[1.0]], dtype=np.float32))  # the control: sampling differs from greedy


def test_each_streamed_response_carries_what_tensorrt_llm_puts_in_it(ifb):
    """TensorRT-LLM fills every streamed response with the context logits and the log probs of every token so far,
    and with the generation logits of the tokens it carries (cpp/include/tensorrt_llm/batch_manager/llmRequest.h
    ``createResponse``): ``inflight_batcher_llm_client.py -S --return-context-logits --return-log-probs`` reads them
    from the last response."""
    import tritonclient.grpc as grpcclient

    decoupled, s, repo = ifb
    if not decoupled:
        pytest.skip("streaming needs the decoupled tensorrt_llm model")
    ids, inputs = _ibl_inputs(repo, True)
    flags = {k: np.array([[True]]) for k in ("return_context_logits", "return_log_probs", "return_generation_logits")}
    items = _stream(_grpc(s), "tensorrt_llm", inputs + _inputs(grpcclient, **flags), parameters={"Streaming": True})
    assert _errors(items) == []
    results = [r for r in items if r.as_numpy("output_ids") is not None]
    generated = 0
    for r in results:
        new = int(r.as_numpy("sequence_length")[0][0])
        generated += new
        assert r.as_numpy("context_logits").shape[:2] == (1, len(ids[0]))
        assert r.as_numpy("output_log_probs").shape == (1, 1, generated)
        assert r.as_numpy("generation_logits").shape[:3] == (1, 1, new)
    assert len(results) > 1 and generated > 1
