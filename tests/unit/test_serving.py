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


def test_text_chunks_are_read_from_the_raw_tensors_as_tritonclient_reads_them():
    """The streamed text chunk's fast read (no InferResult) against tritonclient's own ``InferResult.as_numpy`` on
    the response protobuf Triton sends: multi-byte text, several elements, an empty string, INT32 and INT64 counts;
    a truncated or non-BYTES tensor falls back (None)."""
    from tritonclient.grpc import InferResult, service_pb2
    from tritonclient.utils import serialize_byte_tensor

    from pipeline.serving.driver import _text_delta

    def resp(texts, n, ntype="INT32", ttype="BYTES"):
        r = service_pb2.ModelInferResponse(model_name="ensemble", id="x")
        arr = np.array([t.encode() for t in texts], dtype=object).reshape(1, -1)
        o = r.outputs.add()
        o.name, o.datatype = "text_output", ttype
        o.shape.extend(arr.shape)
        r.raw_output_contents.append(serialize_byte_tensor(arr).item() if arr.size else b"")
        if n is not None:
            o = r.outputs.add()
            o.name, o.datatype = "num_output_tokens", ntype
            o.shape.extend([1, 1])
            r.raw_output_contents.append(np.array([[n]], dtype=np.int32 if ntype == "INT32" else np.int64).tobytes())
        return r

    for texts, n, ntype in ((["Paris é 東京"], 7, "INT32"), (["a", "bc"], 3, "INT64"), ([""], 0, "INT32"),
                            (["x"], None, "INT32")):
        r = resp(texts, n, ntype)
        got = _text_delta(r)
        ref = InferResult(r)
        want = "".join(x.decode() for x in ref.as_numpy("text_output").reshape(-1))
        assert got is not None and got.text == want == "".join(texts)
        assert got.num_output_tokens == (None if n is None else int(ref.as_numpy("num_output_tokens").reshape(-1)[0]))
    bad = resp(["hello"], 1)
    bad.raw_output_contents[0] = bad.raw_output_contents[0][:-2]  # a length prefix that runs past the buffer
    assert _text_delta(bad) is None
    assert _text_delta(resp(["hello"], 1, ttype="FP32")) is None


class _SilentMux:
    """A stand-in for one shared gRPC stream to Triton (a server that hangs cannot be arranged here): it accepts the
    request and delivers only what the test puts into the request's inbox."""

    def __init__(self):
        from pipeline.serving import driver

        self.routes, self.inbox, self.driver = {}, None, driver

    async def submit(self, request):
        import asyncio

        self.inbox = self.driver._Inbox(asyncio.get_running_loop())
        self.routes[request.id] = self.inbox
        return self.inbox

    def abandon(self, rid):
        self.routes.pop(rid, None)

    async def close(self):
        pass


def _driver(timeout_s):
    from types import SimpleNamespace

    from pipeline.serving.driver import Driver

    d = Driver("127.0.0.1:1", SimpleNamespace(layout="inflight_batcher_llm", name="m"), timeout_s=timeout_s)
    mux = _SilentMux()
    d._muxes = [mux]
    return d, mux


def _response(final: bool, text: bytes = b""):
    from tritonclient.grpc import service_pb2

    r = service_pb2.ModelStreamInferResponse()
    r.infer_response.id = "r1"
    if text:
        out = r.infer_response.outputs.add()
        out.name, out.datatype = "text_output", "BYTES"
        r.infer_response.raw_output_contents.append(len(text).to_bytes(4, "little") + text)
    r.infer_response.parameters["triton_final_response"].bool_param = final
    return r


def test_a_silent_stream_is_a_504_after_the_request_timeout_and_a_steady_one_is_not():
    import asyncio
    import time

    from tritonclient.grpc import service_pb2

    async def silent():
        d, _ = _driver(0.3)
        t0 = time.monotonic()
        with pytest.raises(P.APIError) as err:
            async for _ in d._stream("ensemble", service_pb2.ModelInferRequest(model_name="ensemble", id="r1")):
                pass
        await d.close()
        return err.value, time.monotonic() - t0

    err, waited = asyncio.run(asyncio.wait_for(silent(), 5))  # no watchdog: a TimeoutError here, not a hang
    assert err.status == 504 and "request_timeout_s" in err.message and 0.3 <= waited < 1.5

    async def steady():  # negative control: a response every 0.1 s for 0.8 s (longer than the timeout), then final
        d, mux = _driver(0.3)
        got = []

        async def feed():
            while mux.inbox is None:
                await asyncio.sleep(0.01)
            for _ in range(8):
                await asyncio.sleep(0.1)
                mux.inbox.put(_response(False, b"x"))
            mux.inbox.put(_response(True))

        task = asyncio.ensure_future(feed())
        async for out in d._stream("ensemble", service_pb2.ModelInferRequest(model_name="ensemble", id="r1")):
            got.append(out.raw_output_contents[0][4:])
        await task
        await d.close()
        return got

    assert asyncio.run(steady()) == [b"x"] * 8
