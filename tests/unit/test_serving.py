"""The OpenAI front end's request schema, stop-string scanner and log-prob math, in process (the served behaviour
is tested end to end in tests/e2e/test_openai*.py)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pipeline.serving import protocol as P
from pipeline.triton.layouts.contract import top as _top
from pipeline.serving.generation import StopScanner


def _chat(**kw):
    return P.ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def test_unknown_fields_are_refused_by_name():
    with pytest.raises(Exception) as err:
        _chat(temprature=0.5)
    e = P.from_validation(err.value)
    assert e.status == 400 and e.param == "temprature" and "unrecognized request argument: temprature" in e.message


@pytest.mark.parametrize("kw, words", [
    (dict(n=3), "n=3"), (dict(logit_bias={"1": 2.0}), "logit_bias"),
    (dict(functions=[{"name": "f"}]), "functions (deprecated by OpenAI: send tools)"),
    (dict(function_call={"name": "f"}), "function_call (deprecated by OpenAI: send tool_choice)"),
    (dict(reasoning_effort="low"), "reasoning_effort"), (dict(stream_options={"include_usage": True}), "stream_options"),
])
def test_output_changing_fields_that_cannot_be_honoured_are_400(kw, words):
    with pytest.raises(P.APIError) as err:
        P.unsupported(_chat(**kw))
    assert err.value.status == 400 and words in err.value.message


def test_harmless_and_default_values_pass():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for kw in (dict(n=1), dict(logit_bias={}), dict(tool_choice="none"), dict(response_format={"type": "text"}),
               dict(user="u", store=False, metadata={"a": 1}), dict(stream=True, stream_options={"include_usage": True}),
               # served by guided decoding and the tool-call parsers (tests/unit/test_structured.py)
               dict(tools=[tool], tool_choice="required"), dict(response_format={"type": "json_object"}),
               dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}})):
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

    from pipeline.triton.layouts.contract import text_delta as _text_delta

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
        from pipeline.serving import transport

        self.routes, self.inbox, self.transport = {}, None, transport
        self.writing, self.backlog = False, []  # nothing is ever in flight here

    async def submit(self, request, after_send=None):
        import asyncio

        self.inbox = self.transport.Inbox(asyncio.get_running_loop())
        self.routes[request.id] = self.inbox
        return self.inbox

    def abandon(self, rid):
        self.routes.pop(rid, None)

    def on_first_answer(self, rid, then):
        pass  # nothing more comes on this stand-in

    async def close(self):
        pass


def _driver(timeout_s):
    from types import SimpleNamespace

    from pipeline.serving.driver import Driver

    d = Driver("127.0.0.1:1", SimpleNamespace(layout="inflight_batcher_llm", name="m"), timeout_s=timeout_s)
    mux = _SilentMux()
    d.pool.muxes = [mux]
    return d, mux


def _response(final: bool, text: bytes = b"", rid: str = "r1"):
    from tritonclient.grpc import service_pb2

    r = service_pb2.ModelStreamInferResponse()
    r.infer_response.id = rid
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

    from pipeline.serving.driver import SENT

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
            if out is not SENT:  # the request is on its way
                got.append(out.raw_output_contents[0][4:])
        await task
        await d.close()
        return got

    assert asyncio.run(steady()) == [b"x"] * 8


# ------------------------------------------------------------------------------ requests as tritonclient makes them
def _upstream_spec(model: str, decoupled: bool = True):
    """The recorded upstream interface of one ``inflight_batcher_llm`` model, as the driver reads a served config."""
    from pipeline import upstream
    from pipeline.triton.layouts.contract import Spec

    rec = upstream.interface()[model]
    return Spec.from_config({"name": model, "max_batch_size": 8, "input": rec["inputs"], "output": rec["outputs"],
                             "model_transaction_policy": {"decoupled": decoupled}})


def _canonical(msg) -> dict:
    """A ``ModelInferRequest`` as what Triton reads from it: each input's type, shape and raw bytes by name (the
    order of the inputs is not part of the protocol), the outputs asked for, the parameters, the id."""
    inputs = {t.name: (t.datatype, list(t.shape), bytes(raw)) for t, raw in zip(msg.inputs, msg.raw_input_contents)}
    assert len(msg.inputs) == len(msg.raw_input_contents) == len(inputs)
    return {"model": msg.model_name, "id": msg.id, "inputs": inputs, "outputs": sorted(o.name for o in msg.outputs),
            "parameters": {k: v.bool_param for k, v in msg.parameters.items()}}


def _tritonclient_request(spec, inputs: dict, outputs: list[str], request_id: str):
    """The same request built by tritonclient's own gRPC client code (``InferInput`` and ``_get_inference_request``,
    with the empty final response asked for as its ``async_stream_infer`` asks)."""
    from tritonclient.grpc import InferInput, InferRequestedOutput
    from tritonclient.grpc._utils import _get_inference_request

    from pipeline.serving.driver import NP

    objs = []
    for name, value in inputs.items():
        np_type, triton_type = NP[spec.inputs[name][0]]
        vals = value if isinstance(value, list) else [value]
        arr = np.array([v.encode() if isinstance(v, str) else v for v in vals], dtype=np_type).reshape(1, -1)
        obj = InferInput(name, list(arr.shape), triton_type)
        obj.set_data_from_numpy(arr)
        objs.append(obj)
    req = _get_inference_request(spec.name, objs, "", request_id, [InferRequestedOutput(o) for o in outputs], 0,
                                 False, False, 0, None, None)
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    return req


def test_request_protobufs_are_what_tritonclient_builds_also_after_other_requests_reused_their_parts():
    """The driver copies a kept protobuf of a request's scalar inputs; every request must still be exactly the one
    tritonclient builds, whatever was sent before it."""
    from types import SimpleNamespace

    from pipeline.triton.layouts.contract import GenRequest
    from pipeline.serving.driver import Driver

    d = Driver("127.0.0.1:1", SimpleNamespace(layout="inflight_batcher_llm", name="m"))
    spec = _upstream_spec("ensemble")
    outputs = ["text_output", "num_output_tokens"]
    greedy = {"temperature": 0.0}
    asks = [GenRequest("Hello there", None, 32, True, greedy),
            GenRequest("Hello there", None, 32, True, greedy),  # the same parts again: a copy
            GenRequest("Another prompt", None, 7, True,
                       {"temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n", "END"]}),
            GenRequest("Hello there", None, 32, True, {**greedy, "min_tokens": 4}, ignore_eos=True),
            GenRequest("Ünïcode ✓", None, 32, False, greedy)]
    seen = []
    for k, g in enumerate(asks):
        inputs = d.codec.text_inputs(spec, g)
        inputs["stream"] = g.stream
        ours = _canonical(d._request(spec, inputs, outputs, f"r{k}"))
        assert ours == _canonical(_tritonclient_request(spec, inputs, outputs, f"r{k}")), g
        seen.append(ours)
    # the comparison tells requests apart: the same prompt with other scalars, and the same scalars again
    assert seen[0]["inputs"] != seen[3]["inputs"] and seen[0]["inputs"] == seen[1]["inputs"]
    assert seen[3]["inputs"]["end_id"][2] == np.array([-1], dtype=np.int32).tobytes()
    assert "top_p" not in seen[3]["inputs"] and "seed" in seen[2]["inputs"]


def test_a_planted_wrong_part_in_a_kept_request_is_seen_by_the_comparison():
    """Negative control for the test above: a kept protobuf changed behind the driver's back makes its next
    request differ from tritonclient's."""
    from types import SimpleNamespace

    from pipeline.triton.layouts.contract import GenRequest
    from pipeline.serving.driver import Driver

    d = Driver("127.0.0.1:1", SimpleNamespace(layout="inflight_batcher_llm", name="m"))
    spec = _upstream_spec("ensemble")
    g = GenRequest("Hello there", None, 32, True, {"temperature": 0.0})
    inputs = d.codec.text_inputs(spec, g)
    d._request(spec, inputs, ["text_output"], "r0")
    (template,) = d._templates.values()
    template.raw_input_contents[0] = (999).to_bytes(4, "little", signed=True)  # max_tokens 999, planted
    assert _canonical(d._request(spec, inputs, ["text_output"], "r1")) != \
        _canonical(_tritonclient_request(spec, inputs, ["text_output"], "r1"))


# ------------------------------------------------------------------------------------------- prompt token counts
def test_served_encode_is_the_tokenizers_own_encode_and_falls_back_where_the_backend_is_set_otherwise():
    from pathlib import Path

    from pipeline.serving.model import ServedModel
    from pipeline.stages.fetch import train_tokenizer

    tok = train_tokenizer(512)
    served = ServedModel(Path("."), "inflight_batcher_llm", "m", Path("."), 64, True, tokenizer=tok)
    texts = ["", "Hello there, general Kenobi.", "<|im_start|>user\nhi<|im_end|>\n", "héllo 世界 \n\n  x" * 3,
             "   leading and trailing   "]
    for text in texts:
        for special in (True, False):
            assert served.encode(text, special) == tok.encode(text, add_special_tokens=special), (text, special)
    long_text = "one two three four five six seven eight"
    # a backend left truncating (by another caller's tokenizer(..., truncation=True)): the wrapper's own encode
    # resets it, so the count must not be cut
    tok._tokenizer.enable_truncation(max_length=3)
    assert len(tok._tokenizer.encode(long_text).ids) == 3  # the planted state cuts a direct call
    assert served.encode(long_text, False) == tok.encode(long_text, add_special_tokens=False)
    assert len(served.encode(long_text, False)) > 3
    tok.split_special_tokens = True  # special tokens split as text: the wrapper's rule, followed
    assert served.encode("<|im_start|>", False) == tok.encode("<|im_start|>", add_special_tokens=False)
    assert len(served.encode("<|im_start|>", False)) > 1


# ------------------------------------------------------------------------ a stream's status line and Triton's verdict
class _RefusingMux(_SilentMux):
    """A stand-in for one shared gRPC stream to Triton whose model refuses the request ``after_s`` after it was
    written (a refusal at a chosen moment cannot be arranged on a real server: the front end checks every field the
    models refuse before it sends). Like the driver's own stream, it runs the request's ``after_send`` first."""

    def __init__(self, after_s: float):
        super().__init__()
        self.after_s = after_s

    async def submit(self, request, after_send=None):
        import asyncio

        from tritonclient.grpc import service_pb2

        inbox = await super().submit(request)

        async def later():
            problem = after_send() if after_send is not None else None
            if problem is not None:
                inbox.put(problem)
                return
            await asyncio.sleep(self.after_s)
            resp = service_pb2.ModelStreamInferResponse(error_message="RequestError: planted refusal")
            resp.infer_response.id = request.id
            inbox.put(resp)

        self.task = asyncio.ensure_future(later())
        return inbox


def _refusing_app(after_s: float, wait_s: float, max_seq_len: int = 4096):
    from pathlib import Path

    from pipeline.serving.driver import Driver
    from pipeline.serving.frontend import FrontEnd, Settings
    from pipeline.serving.model import ServedModel
    from pipeline.stages.fetch import train_tokenizer

    served = ServedModel(Path("."), "inflight_batcher_llm", "m", Path("."), max_seq_len, True,
                         tokenizer=train_tokenizer(512))
    driver = Driver("127.0.0.1:1", served)
    driver.entry = _upstream_spec("ensemble")
    driver.pool.muxes = [_RefusingMux(after_s)]
    return FrontEnd(served, driver, Settings(stream_status_wait_s=wait_s)).app()


def _post_stream(app, body: dict) -> tuple[int, str]:
    import asyncio

    import httpx

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/completions", json=body)
            return r.status_code, r.text

    return asyncio.run(go())


def test_a_refusal_within_the_status_wait_is_its_status_and_a_later_one_an_error_event():
    body = {"model": "m", "prompt": "Hello there", "max_tokens": 8, "stream": True}
    code, text = _post_stream(_refusing_app(after_s=0.01, wait_s=0.3), body)
    assert code == 400 and "planted refusal" in json.loads(text)["error"]["message"], (code, text)
    # refused after the wait: the headers (200) are out, the refusal is the stream's error event, then [DONE]
    code, text = _post_stream(_refusing_app(after_s=0.3, wait_s=0.01), body)
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert code == 200 and "planted refusal" in json.loads(events[0])["error"]["message"], (code, text)
    assert events[-1] == "[DONE]"
    # control: the same late refusal within a longer wait keeps its status
    code, text = _post_stream(_refusing_app(after_s=0.3, wait_s=2.0), body)
    assert code == 400 and "planted refusal" in text, (code, text)


def test_the_front_ends_own_checks_keep_their_status_without_any_wait():
    """The prompt's count (made once the request is on its way) is waited for even with no wait at all: a prompt
    that does not fit the context is a 400, never an error event."""
    body = {"model": "m", "prompt": "one two three four five six seven eight nine ten " * 4, "max_tokens": 4,
            "stream": True}
    code, text = _post_stream(_refusing_app(after_s=5.0, wait_s=0.0, max_seq_len=16), body)
    assert code == 400 and json.loads(text)["error"]["code"] == "context_length_exceeded", (code, text)
    # control: the same prompt in a context it fits streams (the refusal planted 5 s later is not waited for)
    code, text = _post_stream(_refusing_app(after_s=0.05, wait_s=0.0, max_seq_len=4096), body)
    assert code == 200 and "planted refusal" in text, (code, text)


class _TalkingMux(_SilentMux):
    """A stand-in for one shared gRPC stream to Triton whose model answers each request with two text pieces, the
    first ``after_s`` after the request was written, then its final response (the order and timing across several
    prompts of one request are what the test needs; a real server's would vary)."""

    def __init__(self, after_s: float):
        super().__init__()
        self.after_s = after_s

    async def submit(self, request, after_send=None):
        import asyncio

        from tritonclient.grpc import service_pb2

        inbox = await super().submit(request)
        prompt = request.raw_input_contents[[t.name for t in request.inputs].index("text_input")][4:].decode()

        def resp(final: bool, text: str = ""):
            r = service_pb2.ModelStreamInferResponse()
            r.infer_response.id = request.id
            if text:
                out = r.infer_response.outputs.add()
                out.name, out.datatype = "text_output", "BYTES"
                r.infer_response.raw_output_contents.append(len(text.encode()).to_bytes(4, "little") + text.encode())
            r.infer_response.parameters["triton_final_response"].bool_param = final
            return r

        async def later():
            if after_send is not None:
                after_send()
            await asyncio.sleep(self.after_s)
            for piece in (f" <{prompt}>", " end"):
                inbox.put(resp(False, piece))
                await asyncio.sleep(0.01)
            inbox.put(resp(True))

        self.task = asyncio.ensure_future(later())
        return inbox


def test_several_prompts_stream_each_its_own_text_whether_the_first_pieces_came_before_the_headers_or_after():
    from pathlib import Path

    from pipeline.serving.driver import Driver
    from pipeline.serving.frontend import FrontEnd, Settings
    from pipeline.serving.model import ServedModel
    from pipeline.stages.fetch import train_tokenizer

    served = ServedModel(Path("."), "inflight_batcher_llm", "m", Path("."), 4096, True, tokenizer=train_tokenizer(512))
    prompts = ["alpha", "beta", "gamma"]
    got = {}
    for wait_s in (0.0, 1.0):  # headers before any first piece / after all of them
        driver = Driver("127.0.0.1:1", served)
        driver.entry = _upstream_spec("ensemble")
        driver.pool.muxes = [_TalkingMux(0.05)]
        app = FrontEnd(served, driver, Settings(stream_status_wait_s=wait_s)).app()
        code, text = _post_stream(app, {"model": "m", "prompt": prompts, "max_tokens": 8, "stream": True})
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert code == 200 and events[-1] == "[DONE]", (code, text)
        texts = {i: "" for i in range(len(prompts))}
        for e in events[:-1]:
            for ch in json.loads(e)["choices"]:
                texts[ch["index"]] += ch["text"]
        got[wait_s] = texts
    assert got[0.0] == got[1.0] == {i: f" <{p}> end" for i, p in enumerate(prompts)}


class _RecordingCall:
    """Stands in for gRPC's ``ModelStreamInfer`` call (what the test needs is the order of the writes against the
    front end's own work, which a real server's timing would blur): it logs each write and answers the request with
    one text piece and its final response."""

    def __init__(self, log: list):
        import asyncio

        self.log, self.answers = log, asyncio.Queue()

    async def write(self, msg) -> None:
        import asyncio

        self.log.append(("write", msg.id))
        await asyncio.sleep(0)  # gRPC's write completes later
        self.answers.put_nowait(_response(False, b"ok", msg.id))
        self.answers.put_nowait(_response(True, rid=msg.id))

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.answers.get()

    def cancel(self) -> None:
        pass


def _burst_order(mux_cls) -> list[tuple[str, int]]:
    """Four streamed completions posted at once to an app whose streams are ``mux_cls`` on recording calls: the log
    of each request's parse (its jobs made) and each write, in order."""
    import asyncio
    from pathlib import Path

    import httpx

    from pipeline.serving.driver import Driver
    from pipeline.serving.frontend import FrontEnd, Settings
    from pipeline.serving.model import ServedModel
    from pipeline.stages.fetch import train_tokenizer

    served = ServedModel(Path("."), "inflight_batcher_llm", "m", Path("."), 4096, True, tokenizer=train_tokenizer(512))
    log: list = []
    driver = Driver("127.0.0.1:1", served)
    driver.entry = _upstream_spec("ensemble")
    driver._stub = lambda: type("Stub", (), {"ModelStreamInfer": lambda self: _RecordingCall(log)})()
    driver.pool.streams = 1  # one stream: a write in flight makes the others wait for it
    driver.pool.muxes = [mux_cls(driver._stub)]
    app = FrontEnd(served, driver, Settings(stream_status_wait_s=0.0)).app()
    endpoint = app.state.front_end.completions
    jobs = endpoint.jobs

    def logged(req):
        log.append(("parsed", int(req.prompt.split()[-1])))
        return jobs(req)

    endpoint.jobs = logged

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json={
                "model": "m", "prompt": f"request {i}", "max_tokens": 4, "stream": True}) for i in range(4)))
        assert all(r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") for r in rs), [r.text for r in rs]

    asyncio.run(go())
    return [(kind, x if kind == "parsed" else -1) for kind, x in log]


def test_a_burst_s_first_request_is_written_before_the_next_one_is_parsed():
    """Requests arriving together: each is written to gRPC by the task that parsed it, before the next request is
    parsed (a write in flight on the one stream makes the next wait for it, not for the whole burst)."""
    from pipeline.serving import transport as D

    order = _burst_order(D.Mux)
    assert order[:3] == [("parsed", 0), ("write", -1), ("parsed", 1)], order
    assert order.count(("write", -1)) == 4

    class _WriterTask(D.Mux):  # negative control: the writes handed to a task of their own, as a request iterator
        async def submit(self, request, after_send=None):
            import asyncio

            if self.reader is None or self.reader.done():
                self.call = self.stub_factory().ModelStreamInfer()
                self.reader = asyncio.ensure_future(self._read(self.call))
            inbox = D.Inbox(asyncio.get_running_loop())
            self.routes[request.id] = inbox
            asyncio.ensure_future(self.call.write(request))
            return inbox

    late = _burst_order(_WriterTask)
    assert late[:4] == [("parsed", i) for i in range(4)], late


# ------------------------------------------------------------------------ hand-built chunks against the typed models
TEXTS = ["Paris", "", ' a "quote" and a \\ backslash', "line\nbreak\ttab\r", "é 東京 😀", "\x00\x1f\x7f", "\u2028/"]


def _endpoints(cls_chat=None, cls_completions=None):
    from pathlib import Path

    from pipeline.serving.driver import Driver
    from pipeline.serving.frontend import FrontEnd
    from pipeline.serving.model import ServedModel

    served = ServedModel(Path("."), "inflight_batcher_llm", 'mödel "x"', Path("."), 4096, True)
    fe = FrontEnd(served, Driver("127.0.0.1:1", served))
    chat = cls_chat(fe) if cls_chat else fe.chat
    completions = cls_completions(fe) if cls_completions else fe.completions
    return chat, completions


def _streamed(endpoint, include_usage: bool, index: int, pieces: list[str]) -> list[bytes]:
    """The events :meth:`Endpoint.job_events` writes for one job whose generation yields ``pieces`` (the first one
    as the piece that came before the status line), as the stream sends them."""
    import asyncio
    from types import SimpleNamespace

    from pipeline.triton.layouts.contract import GenRequest
    from pipeline.serving.generation import Job, Stream

    async def gen():
        for p in pieces[1:]:
            yield p

    async def go():
        s = Stream("cmpl-0123abc", 1700000000, SimpleNamespace(echo=False), include_usage, False)
        job = Job(index, GenRequest("p", None, 8, True), 3, "")
        job.finish = "length"
        return [bytes(e) async for e in endpoint.job_events(s, job, gen(), pieces[0])], s, job

    return asyncio.run(go())


def _typed_chunks(endpoint, s, job, pieces: list[str], chat: bool) -> list[bytes]:
    """The same events built from the typed models (:meth:`Endpoint.chunk`, written by ``protocol.dump``)."""
    out = [endpoint.chunk(s, job, "", None, role=True)] if chat else []
    out += [endpoint.chunk(s, job, p, None, None) for p in pieces]
    return out + [endpoint.chunk(s, job, None if chat else "", "length", None)]


def _check_hand_built(chat_ep, completions_ep) -> list[str]:
    """Every difference between the streamed bytes and the typed models' bytes, for chat and completions, with and
    without ``include_usage``, at two choice indexes; each event also parses as its typed model."""
    diffs = []
    for chat, ep in ((True, chat_ep), (False, completions_ep)):
        for include_usage in (False, True):
            for index in (0, 3):
                got, s, job = _streamed(ep, include_usage, index, TEXTS)
                want = _typed_chunks(ep, s, job, TEXTS, chat)
                if got != want:
                    diffs += [f"chat={chat} usage={include_usage} index={index}: {g!r} != {w!r}"
                              for g, w in zip(got, want) if g != w] or [f"{len(got)} events, {len(want)} typed"]
                for event in got:
                    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
                    ep.chunk_model.model_validate_json(event[6:-2])
    return diffs


def test_hand_built_stream_chunks_are_the_typed_models_bytes():
    """The per-token chunk (and the chat stream's first chunk) are written as bytes around the text; they must be
    exactly what the typed response models give, whatever the text holds (quotes, control characters, non-ASCII,
    line separators) and whatever the model's name."""
    assert _check_hand_built(*_endpoints()) == []


def test_a_planted_difference_in_the_hand_built_chunk_is_seen():
    """Negative control: the per-token chunk with two keys in another order (the same JSON object, other bytes), and
    the chat's first chunk without its empty content, each differ from the typed models' bytes."""
    from pipeline.serving.chat import ChatEndpoint
    from pipeline.serving.completions import CompletionsEndpoint

    class SwappedKeys(CompletionsEndpoint):
        fast_close = b',"finish_reason":null,"logprobs":null}]'

    class NoContent(ChatEndpoint):
        def role_chunk(self, s, index):
            return super().role_chunk(s, index).replace(b',"content":""', b"")

    diffs = _check_hand_built(*_endpoints(NoContent, SwappedKeys))
    assert any(d.startswith("chat=False") for d in diffs) and any(d.startswith("chat=True") for d in diffs), diffs
    assert all("finish_reason" in d for d in diffs if d.startswith("chat=False"))


UPSTREAM_ADD_SPECIAL_TOKENS = [  # tensorrtllm_backend preprocessing/1/model.py @ c2e65b8, initialize()
    ("true", True), ("True", True), ("1", True), ("t", True), ("Y", True), ("yes", True),
    ("false", False), ("FALSE", False), ("0", False), ("f", False), ("n", False), ("No", False),
    (None, True), ("", True), ("maybe", True), ("${add_special_tokens}", True)]


def _preprocessing_flag():
    """``flag`` of the self-contained preprocessing model (Triton imports that file on its own), read from source."""
    import ast

    from pipeline.triton import layouts

    src = (layouts.get("inflight_batcher_llm").template_dir("preprocessing") / "1" / "model.py").read_text()
    tree = ast.parse(src)
    keep = [n for n in tree.body if (isinstance(n, ast.Assign) and n.targets[0].id in ("TRUE", "FALSE"))
            or (isinstance(n, ast.FunctionDef) and n.name == "flag")]
    ns: dict = {}
    exec(compile(ast.Module(keep, []), "preprocessing", "exec"), ns)
    return ns["flag"]


@pytest.mark.parametrize("value, expected", UPSTREAM_ADD_SPECIAL_TOKENS)
def test_add_special_tokens_is_read_as_upstreams_preprocessing_reads_it(value, expected):
    from pipeline.triton.layouts.contract import special_tokens_flag

    assert special_tokens_flag(value) is expected
    assert _preprocessing_flag()(value) is expected


def test_a_parse_that_defaults_to_false_fails_the_upstream_table():
    """Negative control: the parse both places used before (``in TRUE``, false otherwise) disagrees with upstream on
    values outside its words."""
    from pipeline.triton.layouts.contract import TRUE

    old = lambda v: (v or "true").lower() in TRUE  # noqa: E731
    assert any(old(v) is not want for v, want in UPSTREAM_ADD_SPECIAL_TOKENS)


def _post(app, path: str, body: dict) -> tuple[int, dict | str]:
    import asyncio

    import httpx

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post(path, json=body)
            return r.status_code, r.text

    code, text = asyncio.run(go())
    try:
        return code, json.loads(text)
    except ValueError:
        return code, text


_CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello there"}]}
_COMPLETION = {"model": "m", "prompt": "Hello there"}


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {**_CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": -3}, "max_tokens"),
    ("/v1/chat/completions", {**_CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": 5, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/completions", {**_COMPLETION, "max_tokens": 0}, "max_tokens"),  # 0 is for echo only
    ("/v1/completions", {**_COMPLETION, "max_tokens": -1}, "max_tokens"),
])
def test_a_token_budget_below_one_is_a_400_whose_body_names_the_field(path, body, field):
    """As OpenAI's API and vLLM answer: ``max_tokens`` (and ``max_completion_tokens``) below 1 is a 400 whose error
    body names the field, in its ``param`` and its message. Negative control: the same request with the field at 1
    passes the front end's checks and is answered by the stand-in for Triton (200)."""
    code, doc = _post(_talking_app(), path, body)
    assert code == 400 and isinstance(doc, dict), (code, doc)
    assert doc["error"]["param"] == field and field in doc["error"]["message"], doc
    assert doc["error"]["type"] == "invalid_request_error", doc
    code, doc = _post(_talking_app(), path, {**body, field: 1})
    assert code == 200 and doc["usage"]["completion_tokens"] >= 1, (code, doc)


def _talking_app():
    """The front end's app for a served model whose Triton (a stand-in: ``_TalkingMux``) answers every request."""
    from pathlib import Path

    from pipeline.serving.driver import Driver
    from pipeline.serving.frontend import FrontEnd, Settings
    from pipeline.serving.model import ServedModel
    from pipeline.stages.fetch import train_tokenizer

    tok = train_tokenizer(512)
    tok.chat_template = tok.chat_template or "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    served = ServedModel(Path("."), "inflight_batcher_llm", "m", Path("."), 4096, True, tokenizer=tok)
    driver = Driver("127.0.0.1:1", served)
    driver.entry = _upstream_spec("ensemble")
    driver.pool.muxes = [_TalkingMux(0.0)]
    return FrontEnd(served, driver, Settings(stream_status_wait_s=0.0)).app()
