"""The reference runtime behind upstream's interfaces, in a real Triton server: ``model=tiny-qwen3`` repositories of
both layouts rendered by the package stage (inflight_batcher_llm decoupled and not, llmapi as upstream's model.yaml
sets it: not decoupled, 1-D tensors). tests/e2e/test_clients.py sends NVIDIA's clients' requests to every layout.

The expected tokens come from the reference runtime run in this process on the same packaged checkpoint
(``pipeline.runtime.reference.generate``, one prompt at a time). A batch whose sequences have different lengths is
left-padded, and in bf16 with FP8 activations the masked attention rounds differently from a lone request's, which
can break a near tie the other way (tests/unit/test_decode_engine.py shows exact equality in fp32); so batched tokens are
checked to be the greedy choice given their own history, to a logit tolerance, with a negative control.
"""
from __future__ import annotations

import os
import queue
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TINY

pytestmark = pytest.mark.slow

ENGINE = "tensorrt_llm/1/engine"


def _render(tiny_build: Path, dest: Path, layout: str, decoupled: bool) -> Path:
    """A repository of ``layout`` around the shared tiny-qwen3 build's checkpoint (FP8 weights, FP8 KV cache),
    rendered by the package stage's own code."""
    import shutil

    from pipeline import hardware
    from pipeline.triton.repository import render_repository

    src = next(tiny_build.glob("triton_repo/*-package-*/manifest.json")).parent / ENGINE
    repo = dest / "repo"
    shutil.copytree(src, repo / ENGINE, copy_function=os.link)
    render_repository(hardware.compose([*TINY, f"serve.layout={layout}", f"serve.decoupled={str(decoupled).lower()}"]),
                      repo)
    return repo


@pytest.fixture(scope="module")
def served(tiny_build, tmp_path_factory):
    """One server at a time: ``served(layout, decoupled)`` -> (grpc url, repository)."""
    from pipeline.triton import server

    state = {"key": None, "cm": None, "value": None}

    def get(layout: str, decoupled: bool):
        key = (layout, decoupled)
        if state["key"] != key:
            if state["cm"] is not None:
                state["cm"].__exit__(None, None, None)
                state["cm"] = None
            dest = tmp_path_factory.mktemp(f"{layout}-{decoupled}")
            repo = _render(tiny_build, dest, layout, decoupled)
            cm = server.local_server(repo, host="127.0.0.1", server_bin=None, work_dir=dest / "triton", timeout_s=600)
            srv = cm.__enter__()
            state.update(key=key, cm=cm, value=(srv.grpc_url, repo))
        return state["value"]

    yield get
    if state["cm"] is not None:
        state["cm"].__exit__(None, None, None)


@pytest.fixture(scope="module")
def reference(served):
    """The packaged checkpoint loaded in this process: greedy tokens one prompt at a time, and its tokenizer."""
    import torch
    from transformers import AutoTokenizer

    from pipeline.runtime import reference as rt

    _url, repo = served("inflight_batcher_llm", True)
    model = rt.load(repo / ENGINE, dtype=rt.compute_dtype("auto", "cpu"))  # as served (runtime.dtype auto)
    tok = AutoTokenizer.from_pretrained(repo / ENGINE)
    eos = {model.generation_config.eos_token_id} - {None}

    def greedy(ids: list[int], n: int) -> list[int]:
        out = list(rt.generate(model, ids, n, eos))
        return out[:-1] if out and out[-1] in eos else out  # TensorRT-LLM's output stops before the end id

    def consistent(ids: list[int], tokens: list[int], tol: float = 1.0) -> bool:
        """Whether every token is the model's greedy choice given the prompt and the tokens before it, up to
        ``tol`` in logit (a bf16 batch with padding may break a near tie the other way than a lone request)."""
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids + tokens])).logits[0].float()
        rows = logits[len(ids) - 1: len(ids) - 1 + len(tokens)]
        chosen = rows.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        return bool((chosen >= rows.max(1).values - tol).all())

    greedy.consistent = consistent
    return greedy, tok


def _t(name, arr):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
    t.set_data_from_numpy(arr)
    return t


def _llm_inputs(ids: list[int], n: int, **extra) -> list:
    inputs = [_t("input_ids", np.array([ids], np.int32)), _t("input_lengths", np.array([[len(ids)]], np.int32)),
              _t("request_output_len", np.array([[n]], np.int32))]
    for name, value in extra.items():
        dtype = {bool: np.bool_, float: np.float32, int: np.int32}[type(value)]
        inputs.append(_t(name, np.array([[value]], dtype)))
    return inputs


def _stream(url: str, model: str, requests: list[list], timeout: float = 120.0) -> list[list]:
    """Send every request on one gRPC stream at once; -> each request's responses (or its error), in order."""
    import tritonclient.grpc as grpcclient

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((time.perf_counter(), result, error)))
    results: dict[str, list] = {str(i): [] for i in range(len(requests))}
    open_ = set(results)
    try:
        for i, inputs in enumerate(requests):
            client.async_stream_infer(model, inputs, request_id=str(i), enable_empty_final_response=True)
        deadline = time.monotonic() + timeout
        while open_:
            t, result, error = q.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                raise AssertionError(f"stream error: {error}")
            resp = result.get_response()
            results[resp.id].append((t, result))
            if resp.parameters["triton_final_response"].bool_param:
                open_.discard(resp.id)
    finally:
        client.stop_stream()
        client.close()
    return [results[str(i)] for i in range(len(requests))]


PROMPTS = ["The capital of France is", "Write a haiku about the sea", "1, 2, 3, 4,", "Tell me a story about a cat"]


def test_concurrent_streaming_requests_get_their_own_greedy_tokens(served, reference):
    greedy, tok = reference
    url, _ = served("inflight_batcher_llm", True)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    responses = _stream(url, "tensorrt_llm", [_llm_inputs(x, 12, streaming=True) for x in ids])
    outputs = []
    for prompt_ids, resp in zip(ids, responses):
        tokens = []
        for _t_, r in resp:
            out = r.as_numpy("output_ids")
            if out is not None and out.size:
                assert out.shape == (1, 1, 1)  # one token per streamed response
                tokens += out.reshape(-1).tolist()
        ref = greedy(prompt_ids, 12)
        assert tokens[0] == ref[0]  # the prefill runs alone: exact
        assert tokens and greedy.consistent(prompt_ids, tokens)
        outputs.append(tokens)
    # Negative control: one request's tokens are not another prompt's greedy continuation.
    assert not greedy.consistent(ids[0], outputs[1])
    # They ran concurrently: each request streamed a token before another one's last token.
    firsts = [resp[0][0] for resp in responses]
    lasts = [resp[-1][0] for resp in responses]
    assert max(firsts) < min(lasts)


def test_unsupported_features_are_refused_by_name(served, reference):
    greedy, tok = reference
    url, _ = served("inflight_batcher_llm", True)
    ids = tok(PROMPTS[0])["input_ids"]
    import tritonclient.grpc as grpcclient

    for extra, name in ((dict(beam_width=2), "beam_width"), (dict(lora_task_id=3), "LoRA")):
        q: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(url)
        client.start_stream(callback=lambda result, error: q.put(error))
        try:
            inputs = _llm_inputs(ids, 4)
            for k, v in extra.items():
                inputs.append(_t(k, np.array([[v]], np.uint64 if k == "lora_task_id" else np.int32)))
            client.async_stream_infer("tensorrt_llm", inputs, request_id="x")
            err = q.get(timeout=60)
        finally:
            client.stop_stream()
            client.close()
        assert err is not None and name in str(err), err
    # Negative control: beam_width 1 is what the reference does, and is served.
    [resp] = _stream(url, "tensorrt_llm", [_llm_inputs(ids, 4, beam_width=1)])
    assert resp[-1][1].as_numpy("output_ids").reshape(-1).tolist() == greedy(ids, 4)


def test_stop_words_and_log_probs_in_upstream_format(served, reference):
    greedy, tok = reference
    url, _ = served("inflight_batcher_llm", True)
    ids = tok(PROMPTS[2])["input_ids"]
    ref = greedy(ids, 10)
    stop = ref[2:4]
    words = np.array([[[*stop, 0], [len(stop), -1, -1]]], np.int32)  # flat ids, cumulative offsets, -1 padding
    inputs = _llm_inputs(ids, 10, return_log_probs=True) + [_t("stop_words_list", words)]
    [resp] = _stream(url, "tensorrt_llm", [inputs])
    result = resp[-1][1]
    assert result.as_numpy("output_ids").reshape(-1).tolist() == ref[:4]  # up to and with the stop word
    lp = result.as_numpy("output_log_probs")
    assert lp.shape == (1, 1, 4) and (lp <= 0).all()
    assert result.as_numpy("cum_log_probs")[0, 0] == pytest.approx(float(lp.sum()), abs=1e-4)
    # Negative control: a stop word that never completes leaves the output whole.
    words = np.array([[[ref[0], 3], [2, -1]]], np.int32)
    [resp] = _stream(url, "tensorrt_llm", [_llm_inputs(ids, 10) + [_t("stop_words_list", words)]])
    assert resp[-1][1].as_numpy("output_ids").reshape(-1).tolist() == ref


def test_ensemble_returns_the_text(served, reference):
    greedy, tok = reference
    url, _ = served("inflight_batcher_llm", True)
    inputs = [_t("text_input", np.array([[PROMPTS[0].encode()]], dtype=object)),
              _t("max_tokens", np.array([[8]], np.int32)), _t("stream", np.array([[False]], np.bool_))]
    [resp] = _stream(url, "ensemble", [inputs])
    got = "".join(r.as_numpy("text_output").reshape(-1)[0].decode() for _t_, r in resp
                  if r.as_numpy("text_output") is not None and r.as_numpy("text_output").size)
    assert got == tok.decode(greedy(tok(PROMPTS[0])["input_ids"], 8), skip_special_tokens=True)


def test_unary_batch_of_prompts_on_a_non_decoupled_model(served, reference):
    import tritonclient.grpc as grpcclient

    greedy, tok = reference
    url, _ = served("inflight_batcher_llm", False)
    ids = [tok(p)["input_ids"] for p in PROMPTS[:2]]
    width = max(map(len, ids))
    batch = np.zeros((2, width), np.int32)
    for i, x in enumerate(ids):
        batch[i, :len(x)] = x
    inputs = [_t("input_ids", batch), _t("input_lengths", np.array([[len(x)] for x in ids], np.int32)),
              _t("request_output_len", np.array([[6], [6]], np.int32))]
    client = grpcclient.InferenceServerClient(url)
    try:
        result = client.infer("tensorrt_llm", inputs)
        out, lengths = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
        assert result.as_numpy("batch_index").reshape(-1).tolist() == [0, 1]
        for i, x in enumerate(ids):  # exclude_input_in_output: true
            assert greedy.consistent(x, out[i, 0, :lengths[i, 0]].tolist())
        # Negative control: streaming on a non-decoupled model is refused, naming the reason.
        with pytest.raises(Exception, match="decoupled"):
            client.infer("tensorrt_llm", _llm_inputs(ids[0], 4, streaming=True))
    finally:
        client.close()


def test_llmapi_unary_request_with_1d_tensors(served, reference):
    """As upstream's llmapi_client.py: text_input and sampling_param_max_tokens as 1-D tensors, a unary call."""
    import tritonclient.grpc as grpcclient

    greedy, tok = reference
    url, repo = served("llmapi", False)
    client = grpcclient.InferenceServerClient(url)
    try:
        cfg = client.get_model_config("tensorrt_llm", as_json=True)["config"]
        assert int(cfg.get("max_batch_size", 0) or 0) == 0  # from model.yaml's triton_config
        inputs = [_t("text_input", np.array([PROMPTS[0].encode()], dtype=object)),
                  _t("sampling_param_max_tokens", np.array([8], np.int32)),
                  _t("sampling_param_exclude_input_from_output", np.array([True])),
                  _t("return_finish_reason", np.array([True]))]
        result = client.infer("tensorrt_llm", inputs)
        expected = tok.decode(greedy(tok(PROMPTS[0])["input_ids"], 8), skip_special_tokens=True)
        assert result.as_numpy("text_output")[0].decode() == expected
        assert result.as_numpy("finish_reason")[0].decode() in ("length", "stop")
        # Negative control: best_of > 1 is refused by name.
        with pytest.raises(Exception, match="best_of"):
            client.infer("tensorrt_llm", inputs + [_t("sampling_param_best_of", np.array([2], np.int32))])
    finally:
        client.close()


def test_llmapi_stop_perf_metrics_and_reasons_behave_as_upstreams_model(served, reference):
    """Upstream's llmapi model.py @ 044a90d (TensorRT-LLM triton_backend/all_models/llmapi/tensorrt_llm/1/model.py):
    ``stop=true`` with a request's id aborts it (the aborted streaming request ends with its final response) and
    answers the stop request with "Request cancelled by client" (CANCELLED); without an id,
    "A request id must be provided for request cancellation"; ``sampling_param_return_perf_metrics`` adds the KV-cache
    and timing outputs, absent otherwise; ``return_finish_reason``/``return_stop_reason`` are strings (``str()`` of
    the LLM API's values: "length", "None")."""
    import tritonclient.grpc as grpcclient

    url, _repo = served("llmapi", True)
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        long = [_t("text_input", np.array([PROMPTS[1].encode()], dtype=object)),
                _t("sampling_param_max_tokens", np.array([400], np.int32)), _t("streaming", np.array([True]))]
        client.async_stream_infer("tensorrt_llm", long, request_id="victim", enable_empty_final_response=True)
        first = q.get(timeout=120)  # generation is under way
        assert first[1] is None
        client.async_stream_infer("tensorrt_llm", [_t("text_input", np.array([b""], dtype=object)),
                                                   _t("stop", np.array([True]))], request_id="victim")
        errors, ended = [], False
        deadline = time.monotonic() + 120
        while not (errors and ended) and time.monotonic() < deadline:
            result, error = q.get(timeout=120)
            if error is not None:
                errors.append(str(error))
            elif result.get_response().parameters["triton_final_response"].bool_param:
                ended = True
        assert ended and len(errors) == 1 and "Request cancelled by client" in errors[0], errors
        # negative control: a stop without a request id names what is missing
        client.async_stream_infer("tensorrt_llm", [_t("text_input", np.array([b""], dtype=object)),
                                                   _t("stop", np.array([True]))])
        _result, error = q.get(timeout=60)
        assert error is not None and "A request id must be provided for request cancellation" in str(error)
    finally:
        client.stop_stream()
        client.close()

    def ask(perf: bool):
        inputs = [_t("text_input", np.array([PROMPTS[0].encode()], dtype=object)),
                  _t("sampling_param_max_tokens", np.array([4], np.int32)),
                  _t("sampling_param_return_perf_metrics", np.array([perf])),
                  _t("return_finish_reason", np.array([True])), _t("return_stop_reason", np.array([True]))]
        return _stream(url, "tensorrt_llm", [inputs])[0][-1][1]

    with_perf, without = ask(True), ask(False)
    assert with_perf.as_numpy("finish_reason")[0].decode() == "length"
    assert with_perf.as_numpy("stop_reason")[0].decode() == "None"
    for name in ("kv_cache_reused_block", "kv_cache_hit_rate", "arrival_time_ns", "first_token_time_ns",
                 "last_token_time_ns"):
        assert with_perf.as_numpy(name) is not None, name
        assert without.as_numpy(name) is None, name  # control: only when asked for
    arrival, first_tok, last_tok = (int(with_perf.as_numpy(n)[0]) for n in
                                    ("arrival_time_ns", "first_token_time_ns", "last_token_time_ns"))
    assert 0 < arrival <= first_tok <= last_tok


def test_serving_writes_no_byte_code_into_the_repository(served):
    """The python stubs import every model.py (and the reference runtime beside it) when the server starts: the
    repository stays as the package stage wrote it, with no ``__pycache__`` directory."""
    _, repo = served("inflight_batcher_llm", True)
    blocks = sorted(p.relative_to(repo).as_posix() for p in repo.rglob("__pycache__") if p.is_file())
    assert "preprocessing/1/__pycache__" in blocks and "tensorrt_llm/1/__pycache__" in blocks, blocks
    assert not [p for p in repo.rglob("__pycache__") if p.is_dir()], "the server wrote byte code into the repository"
    assert not list(repo.rglob("*.pyc"))


def test_the_byte_code_block_is_what_keeps_the_cache_out(tmp_path):
    """Negative control, with Python's own import system: a module imported from a directory without the block gets
    a ``__pycache__`` directory; with the package stage's empty ``__pycache__`` file beside it, nothing is written."""
    import importlib.util
    import sys

    from pipeline.triton.repository import BYTECODE_BLOCK

    def load(where: Path) -> None:
        (where / "mod.py").write_text("X = 1\n")
        spec = importlib.util.spec_from_file_location(f"probe_{where.name}", where / "mod.py")
        before, sys.dont_write_bytecode = sys.dont_write_bytecode, False
        try:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        finally:
            sys.dont_write_bytecode = before

    open_dir, blocked = tmp_path / "open", tmp_path / "blocked"
    open_dir.mkdir()
    blocked.mkdir()
    (blocked / BYTECODE_BLOCK).write_bytes(b"")
    load(open_dir)
    load(blocked)
    assert (open_dir / "__pycache__").is_dir() and list((open_dir / "__pycache__").glob("*.pyc"))
    assert (blocked / "__pycache__").is_file() and (blocked / "__pycache__").stat().st_size == 0
