"""The OpenAI front end in front of every layout and transaction policy (``inflight_batcher_llm`` through
``ensemble`` and through ``tensorrt_llm_bls``, ``llmapi``; decoupled and unary), with the official ``openai`` SDK;
and 200 requests in a row leave no task, no Triton request and no memory behind."""
from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest

from pipeline import hardware
from pipeline.triton.repository import render_repository
from pipeline.triton.layouts import ENGINE_REL
from pipeline.triton import lint, server
from tests.conftest import TINY

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
MODEL = "tiny-qwen3"
PROMPT = "The capital of France is"


def _render(tiny_build: Path, dest: Path, layout: str, decoupled: bool) -> Path:
    src = next(tiny_build.glob("triton_repo/*-package-*/manifest.json")).parent / ENGINE_REL
    repo = dest / "repo"
    shutil.copytree(src, repo / ENGINE_REL)
    cfg = hardware.compose([*TINY, f"serve.layout={layout}", f"serve.decoupled={str(decoupled).lower()}"])
    render_repository(cfg, repo)
    assert lint.lint(repo) == []
    return repo


@pytest.fixture(scope="module", params=[("inflight_batcher_llm", True), ("inflight_batcher_llm", False),
                                        ("llmapi", True), ("llmapi", False)],
                ids=["ifb-decoupled", "ifb-unary", "llmapi-decoupled", "llmapi-unary"])
def layout(request, tiny_build, tmp_path_factory):
    """(layout, decoupled, repo, Triton server) for one rendered repository, served."""
    name, decoupled = request.param
    dest = tmp_path_factory.mktemp(f"oa-{name}-{decoupled}")
    repo = _render(tiny_build, dest, name, decoupled)
    with server.local_server(repo, host="127.0.0.1", server_bin=None, work_dir=dest / "w", timeout_s=600) as s:
        yield name, decoupled, repo, s


def _front(repo: Path, grpc: str, *overrides: str):
    from pipeline.serving import run

    cfg = hardware.compose([f"serve.openai.model_name={MODEL}", *overrides])
    return run.running(repo, grpc, cfg.serve.openai)


def _sdk(url):
    import openai

    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)


def _chat_both_ways(url: str, counted: bool = True) -> tuple[str, object]:
    """``counted``: the layout reports the engine's output token count (inflight_batcher_llm's
    num_output_tokens); otherwise usage counts the returned text re-tokenized, which may exceed max_tokens when a
    token decodes to text that re-tokenizes into more."""
    c = _sdk(url)
    msgs = [{"role": "user", "content": "Name a colour."}]
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].usage is not None and 0 < chunks[-1].usage.completion_tokens
    if counted:
        assert chunks[-1].usage.completion_tokens <= 8
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    whole = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert whole.choices[0].message.content == text
    return text, whole


def test_every_layout_and_transaction_policy_is_served(layout):
    name, decoupled, repo, s = layout
    with _front(repo, s.grpc_url) as url:
        _chat_both_ways(url, counted=name != "llmapi")
        c = _sdk(url)
        comp = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
        assert comp.choices[0].finish_reason in ("stop", "length")
        if name == "llmapi":
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(repo / ENGINE_REL))
            assert comp.usage.completion_tokens == len(tok.encode(comp.choices[0].text, add_special_tokens=False))
        else:
            assert comp.usage.completion_tokens <= 5
        # a stop string taken from the greedy answer cuts it there, and is not returned
        full = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
        cut = next((k for k in range(2, len(full)) if full[k].isalpha() and full[k] not in full[:k]), None)
        if cut is not None:
            stopped = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                           stop=[full[cut]])
            assert stopped.choices[0].text == full[:cut] and stopped.choices[0].finish_reason == "stop"
        import openai

        if name == "llmapi":
            # what the llmapi model cannot give is refused by name, never faked
            for kwargs, words in ((dict(echo=True, logprobs=1), "echo"), (dict(logprobs=0), "logprobs"),
                                  (dict(extra_body={"min_tokens": 3}), "min_tokens"),
                                  (dict(extra_body={"ignore_eos": True}), "ignore_eos")):
                with pytest.raises(openai.BadRequestError, match=words):
                    c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **kwargs)
            with pytest.raises(openai.BadRequestError, match="token ids"):
                c.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
        else:
            r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=2,
                                     temperature=0)
            lp = r.choices[0].logprobs
            assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
            assert all(len(t) >= 2 for t in lp.top_logprobs[1:])
            fixed = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True, "min_tokens": 6})
            assert fixed.usage.completion_tokens == 6 and fixed.choices[0].finish_reason == "length"


def test_structured_output_and_a_required_tool_call_on_every_layout(layout):
    """The guide reaches the model on every layout and transaction policy (inflight_batcher_llm: the ensemble's and
    tensorrt_llm's guide inputs; llmapi: this project's two inputs, read into the reference's grammar as model.py
    reads them into GuidedDecodingParams): on the random tiny model only the grammar makes these answers valid."""
    import json

    import jsonschema

    name, decoupled, repo, s = layout
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["city", "n"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}}}
    msgs = [{"role": "user", "content": "A city, as JSON."}]
    with _front(repo, s.grpc_url) as url:
        c = _sdk(url)
        rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
        whole = c.chat.completions.create(model=MODEL, messages=msgs, response_format=rf, max_tokens=300,
                                          temperature=0)
        jsonschema.validate(json.loads(whole.choices[0].message.content), schema)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=MODEL, messages=msgs, response_format=rf, max_tokens=300, temperature=0, stream=True)
            if ch.choices)
        jsonschema.validate(json.loads(streamed), schema)
        called = c.chat.completions.create(model=MODEL, messages=msgs, tools=[tool], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)
        args = json.loads(called.choices[0].message.tool_calls[0].function.arguments)
        assert called.choices[0].finish_reason == "tool_calls" and 0 <= args["x"] <= 9


def test_bls_entry_point(layout):
    name, decoupled, repo, s = layout
    if name != "inflight_batcher_llm":
        pytest.skip("tensorrt_llm_bls is an inflight_batcher_llm entry point")
    with _front(repo, s.grpc_url) as plain, _front(repo, s.grpc_url, "serve.openai.entry_point=tensorrt_llm_bls") \
            as bls:
        assert _chat_both_ways(bls)[0] == _chat_both_ways(plain)[0]


def test_200_requests_in_a_row_leave_nothing_behind(layout):
    """After 200 requests (streamed and not, one cut short by a stop string), the front end's event loop holds the
    tasks it held before, its memory has not grown, and Triton counted each request as finished."""
    import gc
    import resource
    import tracemalloc

    import httpx
    import tritonclient.grpc as grpcclient

    name, decoupled, repo, s = layout
    if (name, decoupled) != ("inflight_batcher_llm", True):
        pytest.skip("run once, on the default layout")
    from pipeline.serving import run
    from pipeline.serving.frontend import FrontEnd

    cfg = hardware.compose([f"serve.openai.model_name={MODEL}"])
    app = FrontEnd.from_config(cfg.serve.openai, repo, s.grpc_url).app()
    sock = run.bind("127.0.0.1", 0)
    srv = run._server(app, sock)
    import threading

    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not srv.started:
        asyncio.run(asyncio.sleep(0.05))
    url = run.url_of(sock)
    loop = app.state.loop

    def tasks() -> int:
        async def count():
            return len(asyncio.all_tasks())
        return asyncio.run_coroutine_threadsafe(count(), loop).result(10)

    grpc = grpcclient.InferenceServerClient(s.grpc_url)

    def finished() -> tuple[int, int, int, int]:
        """Requests finished and failed by the ensemble (the unary ones) and by tensorrt_llm (each request: the
        ensemble's, and the streamed ones sent to it directly, which the front end detokenizes itself)."""
        out = []
        for model in ("ensemble", "tensorrt_llm"):
            st = grpc.get_inference_statistics(model, as_json=True)["model_stats"][0]["inference_stats"]
            out += [int(st.get("success", {}).get("count", 0)), int(st.get("fail", {}).get("count", 0))]
        return tuple(out)

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    try:
        with httpx.Client(base_url=url, timeout=60) as h:
            def one(i):
                b = {**body, "stream": i % 2 == 0}
                r = h.post("/completions", json=b)
                assert r.status_code == 200
            for i in range(20):  # warm-up: lazy imports, caches, the gRPC channel
                one(i)
            gc.collect()
            tracemalloc.start()
            before_tasks, before_mem = tasks(), tracemalloc.take_snapshot()
            before_stats = finished()
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            for i in range(200):
                one(i)
            gc.collect()
            # the stream watchdog ends on its own within its period (1 s) once no request is open, and a stop
            # request may still be on its way: wait for those; a task left behind stays and fails the check
            deadline = time.monotonic() + 5
            while tasks() > before_tasks and time.monotonic() < deadline:
                time.sleep(0.1)
            after_tasks = tasks()
            grown = sum(st.size_diff for st in tracemalloc.take_snapshot().compare_to(before_mem, "filename"))
            tracemalloc.stop()
            after_stats = finished()
            rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert after_tasks <= before_tasks
        assert grown < 2 << 20, f"{grown} bytes more after 200 requests"
        assert (rss1 - rss0) < 64 << 10  # KiB
        assert after_stats[0] - before_stats[0] == 100 and after_stats[1] == before_stats[1]  # the unary half
        assert after_stats[2] - before_stats[2] == 200 and after_stats[3] == before_stats[3]
    finally:
        grpc.close()
        srv.should_exit = True
        t.join(15)
        sock.close()
