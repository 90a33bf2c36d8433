"""The OpenAI-compatible front end, driven by unchanged clients (the official ``openai`` SDK, a plain aiohttp client
posting the serving guide's chat request, aiperf's chat endpoint) against ``pipeline serve`` of the shared tiny
build's published bundle (real Triton, the reference runtime behind upstream's tensors), and the same front end in
front of each layout and transaction policy.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import TINY, cli_env
from tests.helpers.serving import Serve

pytestmark = [pytest.mark.e2e]
MODEL = "tiny-qwen3"
PROMPT = "The capital of France is"


def _bundle(tiny_build: Path) -> Path:
    return next(tiny_build.glob("published/**/bundle.json")).parent


@pytest.fixture(scope="module")
def served(tiny_build, tmp_path_factory):
    """``pipeline serve`` of the published default bundle (inflight_batcher_llm, decoupled)."""
    cwd = tmp_path_factory.mktemp("openai-serve")
    s = Serve(_bundle(tiny_build), "serve.openai.port=0", cwd=cwd)
    try:
        yield s
    finally:
        assert s.stop() == 0


def _client(url: str, key: str = "none"):
    import openai

    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)


def _post(url: str, path: str, body, headers: dict | None = None, raw: bytes | None = None):
    import httpx

    r = httpx.post(url + path, content=raw if raw is not None else json.dumps(body).encode(),
                   headers={"Content-Type": "application/json", **(headers or {})}, timeout=120)
    return r.status_code, r.json()


def _repo(tiny_build: Path) -> Path:
    return _bundle(tiny_build) / "triton_repo"


# ----------------------------------------------------------------------------------------------- clients
def test_openai_sdk_streams_a_chat_answer_with_usage_from_pipeline_serve(served, tiny_build):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(_repo(tiny_build) / "tensorrt_llm" / "1" / "engine"))
    c = _client(served.url)
    assert [m.id for m in c.models.list()] == [MODEL]
    card = c.models.retrieve(MODEL).model_dump()
    assert card["metadata"]["quant"] == "fp8" and card["metadata"]["target"] == "cpu" and card["metadata"]["version"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and 0 < usage.completion_tokens <= 12
    # the prompt is the model's own chat template, counted as the layout's tokenizer step counts it
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == streamed  # greedy: the same answer, nothing lost in the stream
    assert whole.usage.prompt_tokens == usage.prompt_tokens and whole.usage.completion_tokens == usage.completion_tokens
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion" and whole.created > 1.7e9

    comp = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    parts = [ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                                               temperature=0, stream=True)]
    assert "".join(parts) == comp.choices[0].text and comp.choices[0].finish_reason in ("stop", "length")
    assert comp.usage.prompt_tokens == len(tok.encode(PROMPT, add_special_tokens=False))


def _loglik_pass_logits(model, ids: list[int], repo: Path):
    """The logits of prompt ``ids`` as the reference runtime computes every position's: in a pass of the shape its
    length sets (``BatchEngine.context_shape``: rows the engine batches, the width a multiple of
    ``CONTEXT_WIDTH_STEP``), the prompt at the start of row 0, on one torch thread (``serve.torch_threads``)."""
    import re

    import torch

    from pipeline.runtime import decode_engine as batching

    rows = int(re.search(r"^max_batch_size: (\d+)", (repo / "tensorrt_llm" / "config.pbtxt").read_text(), re.M)[1])
    step = batching.CONTEXT_WIDTH_STEP
    x = torch.zeros(rows, -(-len(ids) // step) * step, dtype=torch.long)
    x[0, :len(ids)] = torch.tensor(ids)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return model(x).logits[0, :len(ids)].float()
    finally:
        torch.set_num_threads(threads)


def test_completion_echo_with_logprobs_returns_the_prompt_log_probabilities(served, tiny_build):
    """The prompt's log probs as the model computes them: checked against the reference runtime run here on the
    bundle's checkpoint, with a planted off-by-one alignment that must not match."""
    import torch

    from pipeline.runtime import reference as rt

    c = _client(served.url)
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(PROMPT)
    from transformers import AutoTokenizer

    ckpt = _repo(tiny_build) / "tensorrt_llm" / "1" / "engine"
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    ids = tok.encode(PROMPT, add_special_tokens=False)
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[:len(ids)]) == PROMPT and lp.text_offset[1] == len(lp.tokens[0])
    model = rt.load(ckpt, dtype=rt.compute_dtype("auto", "cpu"))  # as served
    want = torch.log_softmax(_loglik_pass_logits(model, ids, _repo(tiny_build)), -1)
    expected = [float(want[i - 1, ids[i]]) for i in range(1, len(ids))]
    got = lp.token_logprobs[1:len(ids)]
    assert got == pytest.approx(expected, abs=0.05)
    shifted = [float(want[i, ids[i]]) for i in range(1, len(ids))]  # the planted misalignment
    assert got != pytest.approx(shifted, abs=0.05)
    # lm-eval's greedy check: the generated token is the top-1 of its own distribution (temperature 0)
    last = lp.top_logprobs[-1]
    assert lp.token_logprobs[-1] == max(last.values())
    # token-id prompts (what lm-eval's local-completions sends) are taken as given
    r2 = c.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert r2.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:1] + got + lp.token_logprobs[-1:],
                                                                  abs=1e-6) or \
        r2.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    # streamed: the prompt's entries on the echoed chunk, each generated token's once
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1,
                                       temperature=0, stream=True))
    streamed = [x for k in chunks if k.choices and k.choices[0].logprobs for x in k.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    # max_tokens=0 with echo: the prompt's log probs only
    r0 = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    assert r0.choices[0].text == PROMPT and r0.usage.completion_tokens == 0
    assert r0.choices[0].logprobs.token_logprobs[1:] == pytest.approx(got, abs=1e-6)


def test_echo_logprobs_keep_the_entry_of_an_end_token_generated_first(served, tiny_build):
    """A prompt whose greedy next token is the end token: echo + logprobs + max_tokens=1 (what lm-eval's
    local-completions sends for log-likelihoods) returns the prompt's entries and then the end token's, as vLLM and
    OpenAI do, so lm-eval's ``parse_logprobs`` (which drops the last entry, the generated one) sums exactly the
    continuation's log probs; streamed, the last chunk carries it."""
    import torch
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoTokenizer

    from pipeline.runtime import reference as rt

    ckpt = _repo(tiny_build) / "tensorrt_llm" / "1" / "engine"
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    eos = tok.eos_token_id
    model = rt.load(ckpt, dtype=rt.compute_dtype("auto", "cpu"))  # as served
    base = tok.encode(PROMPT, add_special_tokens=False)
    with torch.no_grad():  # PROMPT + one more token, every token at once: the one whose next token is surely eos
        cand = torch.tensor([base + [t] for t in range(len(tok))])
        logp = torch.log_softmax(model(cand).logits[:, -1].float(), -1)
    top2 = logp.topk(2, -1)
    margin = torch.where(top2.indices[:, 0] == eos, top2.values[:, 0] - top2.values[:, 1], torch.tensor(-1.0))
    assert float(margin.max()) > 0.05, "no one-token extension of the prompt has the end token as its clear top"
    t = int(margin.argmax())
    ids = base + [t]
    want = torch.log_softmax(_loglik_pass_logits(model, ids, _repo(tiny_build)), -1)

    c = _client(served.url)
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and ch.text == tok.decode(ids)  # the end token adds no text
    lp = ch.logprobs
    assert len(lp.token_logprobs) == len(ids) + 1, "the generated end token's entry is missing"
    assert lp.tokens[-1] == tok.decode([eos], skip_special_tokens=False)
    assert lp.token_logprobs[-1] == pytest.approx(float(want[-1, eos]), abs=0.05)
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())  # greedy: the top of its distribution
    assert lp.text_offset[-1] == len(ch.text)
    # lm-eval's own parser: the continuation (the last prompt token here) is summed, the end token dropped
    ctxlen = len(ids) - 1
    (ll, greedy), = LocalCompletionsAPI.parse_logprobs(r.model_dump(), tokens=[ids], ctxlens=[ctxlen])
    assert ll == pytest.approx(float(want[-2, t]), abs=0.05)
    assert ll == pytest.approx(lp.token_logprobs[ctxlen], abs=1e-9)
    # streamed: the same entries, the end token's on the last chunk
    chunks = list(c.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1,
                                       temperature=0, stream=True))
    streamed = [x for k in chunks if k.choices and k.choices[0].logprobs for x in k.choices[0].logprobs.token_logprobs]
    assert len(streamed) == len(ids) + 1 and streamed[0] is None
    assert streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].logprobs.tokens == [lp.tokens[-1]]
    # max_tokens=0: the prompt's entries only, the end token's too is left out
    r0 = c.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert len(r0.choices[0].logprobs.token_logprobs) == len(ids)


def test_plain_aiohttp_client_posts_the_guides_chat_request(served, tiny_build):
    import aiohttp
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(_repo(tiny_build) / "tensorrt_llm" / "1" / "engine"))

    async def go():
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
                    "stream": False}
            async with s.post(f"{served.url}/chat/completions", json=body) as r:
                assert r.status == 200
                return await r.json()

    out = asyncio.run(go())
    content = out["choices"][0]["message"]["content"]
    n = out["usage"]["completion_tokens"]
    assert isinstance(content, str) and 0 < n <= 16
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
    assert out["usage"]["total_tokens"] == n + out["usage"]["prompt_tokens"]
    assert len(tok.encode(content, add_special_tokens=False)) >= 1


def test_32_concurrent_streams_lose_and_mix_nothing(served):
    """32 streams at once, each its own prompt, echoed first: every stream gets its own prompt back, then exactly
    its 8 tokens (ignore_eos; each chunk lists its tokens with logprobs), one finish reason at the end and its own
    id on every chunk. (Greedy texts are not compared with unbatched answers: batched bf16 arithmetic may pick
    another argmax on a random model.)"""
    import openai

    prompts = [f"Request {i}: the number after {i * 7} is" for i in range(32)]

    async def go():
        ac = openai.AsyncOpenAI(base_url=served.url, api_key="none", max_retries=0, timeout=300)

        async def one(p):
            return [ch async for ch in await ac.completions.create(
                model=MODEL, prompt=p, max_tokens=8, temperature=0, echo=True, logprobs=0,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})]

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await ac.close()

    results = asyncio.run(go())
    ids = set()
    for p, chunks in zip(prompts, results):
        body = [ch for ch in chunks if ch.choices]
        assert len({ch.id for ch in chunks}) == 1
        ids.add(chunks[0].id)
        text = "".join(ch.choices[0].text for ch in body)
        assert text.startswith(p)
        generated = sum(len(ch.choices[0].logprobs.tokens) for ch in body[1:] if ch.choices[0].logprobs)
        assert generated == 8, (p, [ch.choices[0] for ch in body])
        assert [ch.choices[0].finish_reason for ch in body].count("length") == 1
        assert body[-1].choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 8
    assert len(ids) == 32


def _stubs_busy(served):
    """``busy(seconds)``: the CPU percent the served Triton's python stubs (the model) used over ``seconds``."""
    import psutil

    stubs = [p for p in psutil.Process(served.proc.pid).children(recursive=True)
             if "triton_python_backend_stub" in p.name() or "stub" in " ".join(p.cmdline()[:1])]
    assert stubs

    def busy(seconds: float) -> float:
        for p in stubs:
            p.cpu_percent(None)
        time.sleep(seconds)
        return sum(p.cpu_percent(None) for p in stubs)

    return busy


def test_a_client_that_disconnects_mid_stream_cancels_its_generation(served):
    """A long stream dropped after two chunks: the Triton side stops working (its python stubs go idle) instead
    of generating the remaining tokens; the same request kept open keeps them busy (the control)."""
    import httpx

    busy = _stubs_busy(served)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", f"{served.url}/completions", json=body) as r:  # the control: kept open
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            assert busy(1.0) > 20.0
        # leaving the block closes the connection mid-stream
    time.sleep(1.0)  # the front end sees the disconnect, Triton the cancellation
    assert busy(1.5) < 15.0
    # and the server still answers
    assert _client(served.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].text is not None


# ------------------------------------------------------------------------------ structured outputs and tools
# On the random tiny model only the grammar can make an answer valid: the controls send the same requests unguided.
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}]


def test_openai_sdk_parse_with_a_pydantic_model_gets_a_valid_object_streamed_or_not(served):
    from typing import Literal

    import openai
    import pydantic
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: Literal["Paris", "Lyon", "Nice"]
        population: int = Field(ge=0, le=999)
        capital: bool

    c = _client(served.url)
    msgs = [{"role": "user", "content": "Describe a French city."}]
    got = c.chat.completions.parse(model=MODEL, messages=msgs, response_format=City, max_tokens=300, temperature=0)
    assert isinstance(got.choices[0].message.parsed, City) and got.choices[0].finish_reason == "stop"
    with c.chat.completions.stream(model=MODEL, messages=msgs, response_format=City, max_tokens=300,
                                   temperature=0) as stream:  # the SDK's own streaming parse (the token path here)
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == got.choices[0].message.parsed
    # the control: the same request without the schema is noise that the model class refuses
    plain = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=0)
    with pytest.raises(pydantic.ValidationError):
        City.model_validate_json(plain.choices[0].message.content)
    # json_object on /v1/completions, vLLM's extension: JSON once the grammar closed it
    body = {"model": MODEL, "prompt": "JSON:", "max_tokens": 200, "temperature": 0,
            "response_format": {"type": "json_object"}}
    code, out = _post(served.url, "/completions", body)
    assert code == 200 and out["choices"][0]["finish_reason"] == "stop", out
    json.loads(out["choices"][0]["text"])
    with pytest.raises(openai.BadRequestError, match=r"unsupported format 'binary' at \$\.properties\.f\.format"):
        c.chat.completions.create(model=MODEL, messages=msgs, stream=True, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"f": {"type": "string", "format": "binary"}}}}})


def test_tool_calls_stream_as_openai_deltas_and_a_two_turn_tool_conversation_follows(served, tiny_build):
    from transformers import AutoTokenizer

    from pipeline.serving import protocol as P, tools

    c = _client(served.url)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=100, temperature=0, stream=True))
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert deltas[0].function.name == "get_weather"
    args = json.loads("".join(d.function.arguments or "" for d in deltas))
    assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("C", "F")
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and {d.index for d in deltas} == {0}
    # the same answer whole (the ensemble's path), then the tool's result in a second turn
    first = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=100, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments) == args
    follow = [*msgs, first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"}]
    second = c.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=6, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the second turn was rendered with the call and its result through the model's own template
    tok = AutoTokenizer.from_pretrained(str(_repo(tiny_build) / "tensorrt_llm" / "1" / "engine"))
    req = P.ChatRequest.model_validate({"model": MODEL, "messages": [
        *msgs, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}, follow[-1]]})

    def count(messages):
        text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        return len(tok.encode(text, add_special_tokens=False))

    rendered = tools.template_messages(req)
    assert second.usage.prompt_tokens == count(rendered) != count(rendered[:1])  # the control: without the turns


# ----------------------------------------------------------------------------------------------- errors
def test_each_kind_of_bad_request_gets_its_status_and_names_the_problem(served):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        ({**chat, "foo": 1}, 400, "foo"),
        ({**chat, "n": 2}, 400, "n=2"),
        ({**chat, "logit_bias": {"5": 3}}, 400, "logit_bias"),
        ({**chat, "functions": [{"name": "f"}]}, 400, "functions (deprecated by OpenAI: send tools)"),
        ({**chat, "tool_choice": "required"}, 400, "tool_choice needs tools"),
        ({**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}}, 400,
         "unsupported keyword 'uniqueItems' at $.properties.tags.uniqueItems"),
        ({**chat, "temperature": 5}, 400, "temperature"),
        ({**chat, "messages": []}, 400, "messages"),
        ({k: v for k, v in chat.items() if k != "messages"}, 400, "messages is required"),
        ({**chat, "max_tokens": 10 ** 6}, 400, "maximum context length"),
        ({**chat, "top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
        ({**chat, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({**chat, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         400, "text only"),
        ({**chat, "model": "gpt-4"}, 404, "gpt-4"),
    ]
    for body, status, words in cases:
        code, out = _post(served.url, "/chat/completions", body)
        assert (code, out["error"]["type"] if code == 400 else code) == (status, "invalid_request_error"
                                                                         if status == 400 else status), (body, out)
        assert words in out["error"]["message"], (body, out)
    comp = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    for body, status, words in [({**comp, "best_of": 3}, 400, "best_of"), ({**comp, "suffix": "x"}, 400, "suffix"),
                                ({**comp, "prompt": [10 ** 9]}, 400, "outside the vocabulary"),
                                ({**comp, "max_tokens": 0}, 400, "max_tokens=0"),
                                ({**comp, "logprobs": 50}, 400, "logprobs")]:
        code, out = _post(served.url, "/completions", body)
        assert code == status and words in out["error"]["message"], (body, out)
    code, out = _post(served.url, "/completions", None, raw=b"{not json")
    assert code == 400 and "not valid JSON" in out["error"]["message"]
    code, out = _post(served.url, "/completions", None, raw=b'{"prompt": "' + b"x" * (9 << 20) + b'"}')
    assert code == 413 and "limit" in out["error"]["message"]
    import httpx

    r = httpx.get(served.url + "/nowhere")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    assert httpx.get(served.url.removesuffix("/v1") + "/health").status_code == 200


def test_a_prompt_too_long_for_the_context_is_a_400_also_when_counted_while_triton_works(served, tiny_build):
    """With ``max_tokens`` given, the front end counts the prompt once its request is on its way to Triton. A
    prompt that does not fit is still refused before anything is returned, streamed or not, naming the counts;
    and its generation is stopped on the server."""
    import httpx
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(_repo(tiny_build) / "tensorrt_llm" / "1" / "engine"))
    ctx = httpx.get(served.url + "/models").json()["data"][0]["max_model_len"]
    assert isinstance(ctx, int) and ctx > 16
    words = " ".join(f"w{i % 50}" for i in range(4 * ctx))
    ids = tok.encode(words, add_special_tokens=False)
    over = tok.decode(ids[:ctx + 5])  # more tokens than the context holds
    near = tok.decode(ids[:ctx - 8])  # fits alone, not with 32 more
    n_over, n_near = (len(tok.encode(t, add_special_tokens=False)) for t in (over, near))
    assert n_over >= ctx and n_near + 32 > ctx >= n_near + 1
    for stream in (False, True):
        code, out = _post(served.url, "/completions", {"model": MODEL, "prompt": over, "max_tokens": 4,
                                                       "stream": stream})
        assert code == 400 and out["error"]["code"] == "context_length_exceeded", (stream, out)
        assert f"maximum context length is {ctx} tokens; the prompt has {n_over} tokens" in out["error"]["message"]
        code, out = _post(served.url, "/completions", {"model": MODEL, "prompt": near, "max_tokens": 32,
                                                       "ignore_eos": True, "stream": stream})
        assert code == 400 and out["error"]["param"] == "max_tokens", (stream, out)
        assert f"you requested {n_near + 32} tokens ({n_near} in the prompt, 32 in the completion)" in \
            out["error"]["message"]
    # a prompt the engine takes (max_input_len) with more new tokens than the context leaves: the refusal comes
    # from the count, not from Triton
    short = tok.decode(ids[:200])
    n_short = len(tok.encode(short, add_special_tokens=False))
    code, out = _post(served.url, "/completions", {"model": MODEL, "prompt": short, "max_tokens": ctx - n_short + 1,
                                                   "ignore_eos": True})
    assert code == 400 and f"you requested {ctx + 1} tokens ({n_short} in the prompt" in out["error"]["message"], out
    time.sleep(0.5)  # the stop reaches the model; left running, it would generate for seconds
    assert _stubs_busy(served)(1.0) < 15.0
    # the server goes on answering: a prompt that fits is served, and its usage counts it exactly
    fits = short
    code, out = _post(served.url, "/completions", {"model": MODEL, "prompt": fits, "max_tokens": 8})
    assert code == 200 and out["usage"]["prompt_tokens"] == len(tok.encode(fits, add_special_tokens=False)), out


def _front(repo: Path, grpc: str, *overrides: str):
    from pipeline import hardware
    from pipeline.serving import run

    cfg = hardware.compose(list(overrides))
    return run.running(repo, grpc, cfg.serve.openai)


def test_api_key_missing_server_and_model_without_chat_template(served, tiny_build, tmp_path, monkeypatch):
    """401 for a missing or wrong key (serve.openai.api_key_env); 503 while Triton does not answer; a 400 on chat for
    a tokenizer without a chat template, while completions still work."""
    from pipeline.errors import UserError
    from pipeline.triton.server import free_ports

    repo = _repo(tiny_build)
    monkeypatch.setenv("PIPELINE_TEST_KEY", "s3cret")
    with _front(repo, served.grpc, "serve.openai.api_key_env=PIPELINE_TEST_KEY") as url:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        assert _post(url, "/completions", body)[0] == 401
        code, out = _post(url, "/completions", body, {"Authorization": "Bearer wrong"})
        assert code == 401 and out["error"]["type"] == "authentication_error"
        assert _post(url, "/completions", body, {"Authorization": "Bearer s3cret"})[0] == 200
        assert _client(url, "s3cret").models.list().data[0].id == MODEL
    monkeypatch.delenv("PIPELINE_TEST_KEY")
    with pytest.raises(UserError, match="PIPELINE_TEST_KEY"):
        with _front(repo, served.grpc, "serve.openai.api_key_env=PIPELINE_TEST_KEY"):
            pass
    dead = f"127.0.0.1:{free_ports('127.0.0.1', 1)[0]}"
    with _front(repo, dead) as url:
        code, out = _post(url, "/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert code == 503 and out["error"]["type"] == "service_unavailable"
        import httpx

        assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 503
    # the same repository with its chat template removed
    copy = tmp_path / "triton_repo"
    shutil.copytree(repo, copy, symlinks=True, ignore=shutil.ignore_patterns("model.safetensors"))
    eng = copy / "tensorrt_llm" / "1" / "engine"
    eng.chmod(0o755)
    (eng / "chat_template.jinja").unlink(missing_ok=True)
    (eng / "tokenizer_config.json").chmod(0o644)
    cfg = json.loads((eng / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (eng / "tokenizer_config.json").write_text(json.dumps(cfg))
    with _front(copy, served.grpc, f"serve.openai.model_name={MODEL}") as url:
        code, out = _post(url, "/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        assert code == 400 and "no chat template" in out["error"]["message"]
        assert _post(url, "/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})[0] == 200


def _observe(url: str, key: str | None) -> dict:
    """What a front end answers with no Triton behind it (nothing here reaches a generation): its model's id, the
    status of a request without the key, and the status and message of a 4 KB body."""
    import httpx

    auth = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{url}/models", headers=auth, timeout=30)
    name = r.json()["data"][0]["id"]
    big = {"model": name, "prompt": "word " * 800, "max_tokens": 2}
    r2 = httpx.post(f"{url}/completions", json=big, headers=auth, timeout=60)
    return {"id": name, "without_key": httpx.get(f"{url}/models", timeout=30).status_code,
            "big": (r2.status_code, r2.json()["error"]["message"])}


def test_the_bench_and_eval_front_ends_run_the_builds_own_openai_settings(tiny_build, tmp_path, monkeypatch):
    """The front ends the bench (a process of its own) and the task evaluation start are the build's own
    ``serve.openai``: its model name, its API key (which the bench's load generator then sends) and its body limit
    reach both, read through each stage's declared config; the shipped defaults (the negative control) give the
    model's own name, no key and no 413."""
    from types import SimpleNamespace

    from pipeline import hardware

    from pipeline.runner import executor as runner
    from pipeline.eval import endpoint
    from pipeline.stages.bench import openai_client as oa_client
    from pipeline.runner import leases as shared
    from pipeline.stages import evaluate
    from pipeline.stages.bench import load
    from pipeline.stages.bench import stage as bench

    repo = next(tiny_build.glob("triton_repo/*-package-*/manifest.json")).parent
    monkeypatch.setenv("PIPELINE_TEST_OPENAI_KEY", "s3cret-own")
    own = ["serve.openai.model_name=renamed", "serve.openai.api_key_env=PIPELINE_TEST_OPENAI_KEY",
           "serve.openai.limits.max_body_bytes=2048"]
    server = SimpleNamespace(grpc_url="127.0.0.1:9")  # no Triton: everything observed is answered before it
    seen: dict = {}
    for label, overrides in (("own", own), ("shipped", [])):
        cfg = hardware.compose([*TINY, *overrides])
        out = tmp_path / label
        out.mkdir()
        front = load._Front(SimpleNamespace(cfg=runner.stage_config(cfg, bench.STAGE), inputs={"package": repo},
                                            out=out, shared=None, paths={"store": tmp_path / "store"}),
                            SimpleNamespace(value=server))
        try:
            seen["bench", label] = _observe(front.url, front.api_key)
            records, _ = front.level(["Hello"], [0], 1, 2, chat=False)  # its load generator, with its key
            seen["bench load", label] = records[0].error
            records, _ = oa_client.run_level(front.url, front.name, ["Hello"], [0], 1, 2, 30, chat=False)
            seen["keyless load", label] = records[0].error
        finally:
            front.close()
        serve = runner.stage_config(cfg, evaluate.STAGE).serve  # the evaluation's front end, as it starts it
        with shared.front_end(None, SimpleNamespace(value=server), shared.front_settings(serve.openai, repo), repo,
                              tmp_path / "w", "evaluate") as lease:
            seen["eval", label] = _observe(lease.value, endpoint.api_key(serve))
    for where in ("bench", "eval"):
        got = seen[where, "own"]
        assert got["id"] == "renamed" and got["without_key"] == 401, (where, got)
        assert got["big"][0] == 413 and "2048" in got["big"][1], (where, got)
        shipped = seen[where, "shipped"]
        assert shipped["id"] == MODEL and shipped["without_key"] == 200, (where, shipped)
        assert shipped["big"][0] == 503, (where, shipped)  # past every check of the front end's own: no Triton
    assert seen["bench load", "own"].startswith("HTTP 503"), seen  # the key sent: refused only for the server
    assert seen["keyless load", "own"].startswith("HTTP 401"), seen  # control: the same requests without it
    assert seen["bench load", "shipped"].startswith("HTTP 503") and seen["keyless load", "shipped"].startswith(
        "HTTP 503"), seen
    settings = json.loads((tmp_path / "own" / "openai-front-end.json").read_text())
    assert settings["model_name"] == "renamed" and settings["port"] == 0 and "s3cret" not in json.dumps(settings)


@pytest.mark.slow
def test_aiperf_chat_endpoint_profiles_it_natively(served, tiny_build, tmp_path):
    """aiperf's own OpenAI chat endpoint type, streaming, no request template: every request completes, the server's
    usage says each made exactly the requested tokens (ignore_eos through --extra-inputs, as aiperf advises)."""
    out = tmp_path / "aiperf"
    tok = _repo(tiny_build) / "tensorrt_llm" / "1" / "engine"
    aiperf = Path(sys.executable).with_name("aiperf")
    # aiperf's unix sockets live in TMPDIR and cannot bind past 107 bytes (it then exits 0 without an export):
    # a short scratch directory, not the test's deep temporary one
    scratch = Path(tempfile.mkdtemp(prefix="aiperf-", dir="/tmp"))
    env = cli_env(scratch)
    env.pop("HF_HUB_OFFLINE")  # aiperf 0.13's offline mode looks a local tokenizer directory up as a Hub repo id
    proc = subprocess.run([str(aiperf), "profile", "--endpoint-type", "chat", "--streaming", "-u",
                           served.url.removesuffix("/v1"), "-m", MODEL, "--tokenizer", str(tok),
                           "--request-count", "8", "--concurrency", "2", "--synthetic-input-tokens-mean", "16",
                           "--output-tokens-mean", "8", "--extra-inputs", "ignore_eos:true", "--artifact-dir",
                           str(out), "--ui-type", "none", "--random-seed", "1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    shutil.rmtree(scratch, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "profile_export_aiperf.json").read_text())
    assert doc["request_count"]["avg"] == 8 and not doc.get("error_summary")
    assert doc["usage_completion_tokens"]["avg"] == 8
    assert doc["time_to_first_token"]["avg"] > 0 and doc["inter_token_latency"]["avg"] > 0
    sent = json.loads((out / "inputs.json").read_text())["data"][0]["payloads"][0]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
