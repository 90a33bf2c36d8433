"""What ops see of the front end (pipeline.serving.observe): ``GET /metrics`` counts what was served and matches the
usage it answered, each request gets one access-log line with its id (the client's ``X-Request-Id``, returned and
passed to Triton as the request id) and never its prompt or the API key, the runtime's load is read from Triton's
TensorRT-LLM metrics, a server that is down is answered 503 with Retry-After and the reason, and the TTFT budget is
the bundle's. In process: a stand-in for the shared gRPC stream to Triton answers (tests/unit/test_serving.py's
``_TalkingMux``; the real server is in tests/e2e/test_metrics.py)."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from pipeline.serving import observe
from tests.unit.test_serving import _TalkingMux, _upstream_spec


def _front(tmp_path: Path | None = None, api_key: str | None = None):
    from pipeline.serving.driver import Driver
    from pipeline.serving.frontend import FrontEnd, Settings
    from pipeline.serving.model import ServedModel
    from pipeline.stages.fetch import train_tokenizer

    served = ServedModel(Path("."), "inflight_batcher_llm", "m", Path("."), 4096, True, tokenizer=train_tokenizer(512))
    driver = Driver("127.0.0.1:1", served)
    driver.entry = _upstream_spec("ensemble")
    mux = _TalkingMux(0.01)
    seen: list[str] = []  # the Triton request ids the stand-in was sent
    submit = mux.submit

    async def recording(request, after_send=None):
        seen.append(request.id)
        return await submit(request, after_send)

    mux.submit = recording
    driver.pool.muxes = [mux]
    log = observe.AccessLog(tmp_path / "access.jsonl" if tmp_path else None)
    fe = FrontEnd(served, driver, Settings(stream_status_wait_s=0.0, api_key=api_key), log)
    return fe, seen


async def _ask(app, calls: list[tuple[str, str, dict | None, dict]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=("10.1.2.3", 5555)),
                                 base_url="http://t") as c:
        out = []
        for method, path, body, headers in calls:
            out.append(await c.request(method, path, json=body, headers=headers))
        return out


def _values(text: str) -> dict[tuple, float]:
    """A scrape as {(sample name, frozenset of labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def scrape_problems(values: dict, requests: int, prompt_tokens: int, completion_tokens: int) -> list[str]:
    """What the scrape gets wrong about ``requests`` streamed chat completions whose usage summed to the tokens
    given (the model is ``m``)."""
    m = ("model_name", "m")
    want = {("pipeline_requests_total", frozenset({("endpoint", "/v1/chat/completions"), m, ("status", "200")})):
            requests,
            ("vllm:time_to_first_token_seconds_count", frozenset({m})): requests,
            ("vllm:e2e_request_latency_seconds_count", frozenset({m})): requests,
            ("vllm:prompt_tokens_total", frozenset({m})): prompt_tokens,
            ("vllm:generation_tokens_total", frozenset({m})): completion_tokens}
    return [f"{name}: {values.get((name, labels))}, expected {n}" for (name, labels), n in want.items()
            if values.get((name, labels)) != n]


def test_metrics_count_what_was_served_and_match_its_usage(tmp_path):
    fe, _ = _front()
    app = fe.app()
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}
    before, *answers, after = asyncio.run(_ask(app, [("GET", "/metrics", None, {})] +
                                                    [("POST", "/v1/chat/completions", body, {})] * 3 +
                                                    [("GET", "/metrics", None, {})]))
    usage = [json.loads(line[6:])["usage"] for r in answers for line in r.text.splitlines()
             if line.startswith("data: {") and json.loads(line[6:]).get("usage")]
    assert len(usage) == 3 and all(r.status_code == 200 for r in answers)
    prompt, completion = sum(u["prompt_tokens"] for u in usage), sum(u["completion_tokens"] for u in usage)
    assert after.headers["content-type"].startswith("text/plain; version=0.0.4")
    values = _values(after.text)
    assert scrape_problems(values, 3, prompt, completion) == []
    # two responses per prompt (the stand-in's two pieces): one inter-token gap each
    assert values[("vllm:inter_token_latency_seconds_count", frozenset({("model_name", "m")}))] == 3
    assert sum(v for (name, _), v in values.items() if name == "vllm:request_success_total") == 3
    # negative control: the scrape before the requests, a counter not incremented, is rejected
    problems = scrape_problems(_values(before.text), 3, prompt, completion)
    assert len(problems) == 5 and "pipeline_requests_total: 0.0, expected 3" in problems[0], problems
    # /metrics and /health are not requests of the API: the scrapes above were not counted
    assert not [k for k in values if k[0] == "pipeline_requests_total" and ("endpoint", "other") in k[1]]


def test_one_access_log_line_per_request_with_its_id_and_never_the_prompt_or_the_key(tmp_path, monkeypatch):
    fe, seen = _front(tmp_path, api_key="sk-secret-key-123")
    auth = {"Authorization": "Bearer sk-secret-key-123"}
    body = {"model": "m", "messages": [{"role": "user", "content": "a confidential prompt"}], "max_tokens": 8,
            "stream": True}
    calls = [("POST", "/v1/chat/completions", body, {**auth, "X-Request-Id": "req-0001"}),
             ("POST", "/v1/completions", {"model": "m", "prompt": ["one secret", "two secret"], "max_tokens": 4},
              {**auth, "X-Request-Id": "req-0002"}),
             ("POST", "/v1/chat/completions", {**body, "model": "other"}, {**auth, "X-Request-Id": "bad id!"}),
             ("GET", "/v1/models", None, {}),  # no key: 401
             ("GET", "/health", None, {}), ("GET", "/metrics", None, {})]
    answers = asyncio.run(_ask(fe.app(), calls))
    assert [r.status_code for r in answers[:4]] == [200, 200, 404, 401]
    assert answers[0].headers["x-request-id"] == "req-0001" and answers[1].headers["x-request-id"] == "req-0002"
    made = answers[2].headers["x-request-id"]
    assert made != "bad id!" and observe.REQUEST_ID.fullmatch(made)  # not a plain token: a new id instead
    # Triton gets the request id: the first prompt's is the id itself, the others numbered after it
    assert seen == ["req-0001", "req-0002", "req-0002-1"]
    text = (tmp_path / "access.jsonl").read_text()
    lines = [json.loads(x) for x in text.splitlines()]
    assert len(lines) == 4  # /health and /metrics are not logged
    first, second, third, fourth = lines
    assert {k: first[k] for k in ("request_id", "endpoint", "model", "status", "stream", "client")} == {
        "request_id": "req-0001", "endpoint": "/v1/chat/completions", "model": "m", "status": 200, "stream": True,
        "client": "10.1.2.3"}
    assert first["prompt_tokens"] > 0 and first["completion_tokens"] > 0 and first["ttft_s"] > 0
    assert first["duration_s"] >= first["ttft_s"] and first["finish_reason"] in (["stop"], ["length"])
    usage = answers[1].json()["usage"]
    assert (second["prompt_tokens"], second["completion_tokens"]) == (usage["prompt_tokens"],
                                                                      usage["completion_tokens"])
    assert second["ttft_s"] is None and second["triton_request_ids"] == ["req-0002", "req-0002-1"]
    assert (third["request_id"], third["status"], third["prompt_tokens"]) == (made, 404, None)
    assert (fourth["endpoint"], fourth["status"]) == ("/v1/models", 401)
    for secret in ("confidential", "secret", "sk-secret-key-123"):
        assert secret not in text, secret
    # negative control: the check above would see a prompt that reached the log
    assert "confidential" in json.dumps({**first, "prompt": body["messages"][0]["content"]})


def test_a_request_id_still_in_flight_gets_a_suffix_for_triton():
    fe, seen = _front()
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": True}

    async def both():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fe.app()), base_url="http://t") as c:
            return await asyncio.gather(*[c.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "dup"})
                                          for _ in range(2)])

    answers = asyncio.run(both())
    assert [r.headers["x-request-id"] for r in answers] == ["dup", "dup"]
    assert sorted(seen) == ["dup", "dup~1"]  # two requests on one stream to Triton never share an id


def test_a_server_that_is_down_is_answered_503_with_retry_after_and_the_reason():
    fe, seen = _front()
    fe.driver.down = "Triton was killed by SIGKILL; pipeline serve restarts it in 1 s (restart 1 of 3)"
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    gen, health, models, scrape = asyncio.run(_ask(fe.app(), [("POST", "/v1/chat/completions", body, {}),
                                                              ("GET", "/health", None, {}),
                                                              ("GET", "/v1/models", None, {}),
                                                              ("GET", "/metrics", None, {})]))
    for r in (gen, health):
        assert r.status_code == 503 and r.headers["retry-after"] == "5", (r.status_code, r.headers)
        assert "is down: Triton was killed by SIGKILL; pipeline serve restarts it" in r.json()["error"]["message"]
    assert seen == []  # nothing was sent to the server that is gone
    assert models.status_code == 200  # what needs no server is still answered
    assert _values(scrape.text)[("pipeline_triton_ready", frozenset())] == 0
    fe.driver.down = None  # control: the same request once the server is back
    assert asyncio.run(_ask(fe.app(), [("POST", "/v1/chat/completions", body, {})]))[0].status_code == 200


TRITON = """# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 3
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 5
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 8
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="tensorrt_llm",version="1"} 0.25
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 16
"""


def test_the_runtime_load_is_read_from_tritons_tensorrt_llm_metrics():
    m = observe.Metrics("m")
    values = _values(m.render(TRITON).decode())
    key = frozenset({("model_name", "m")})
    assert (values[("vllm:num_requests_waiting", key)], values[("vllm:num_requests_running", key)],
            values[("vllm:kv_cache_usage_perc", key)]) == (3, 5, 0.25)
    # Triton's own lines follow, as Triton wrote them: one scrape target for both
    assert values[("nv_trt_llm_request_metrics", frozenset({("model", "tensorrt_llm"), ("request_type", "active"),
                                                             ("version", "1")}))] == 8
    # control: a Triton without them (or none at all) gives none, rather than zeros that mean "idle"
    for text in ("nv_inference_request_success{model=\"x\",version=\"1\"} 1\n", None):
        values = _values(m.render(text).decode())
        assert not [k for k in values if k[0].startswith(("vllm:num_requests", "vllm:kv_cache"))]


def test_the_ttft_budget_is_the_bundles_prediction_else_its_measurement_else_its_service_limit(tmp_path):
    repo = tmp_path / "triton_repo"
    repo.mkdir()
    assert observe.ttft_budget(repo) is None
    doc = {"recipe": {"package": {"serve": {"slo": {"ttft_ms": 2000}}}}}
    (tmp_path / "bundle.json").write_text(json.dumps(doc))
    assert observe.ttft_budget(repo) == (2.0, "slo")
    doc["bench"] = {"workloads": {"chat": [{"ttft_p95_ms": 22.0}, {"ttft_p95_ms": 28.5}], "rag": [{"ttft_p95_ms": 3}]}}
    (tmp_path / "bundle.json").write_text(json.dumps(doc))
    assert observe.ttft_budget(repo) == (0.0285, "measured")
    doc["capacity"] = {"serving": {"profile": {"chosen": {"ttft_ms": 282.0}}}}
    (tmp_path / "bundle.json").write_text(json.dumps(doc))
    assert observe.ttft_budget(repo) == (0.282, "predicted")
    assert _values(observe.Metrics("m", (0.282, "predicted")).render(None).decode())[
        ("pipeline_ttft_budget_seconds", frozenset({("model_name", "m"), ("source", "predicted")}))] == 0.282


def test_an_access_log_that_cannot_be_written_is_one_clear_error(tmp_path):
    from pipeline.errors import UserError

    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"serve\.openai\.access_log\.path=.*cannot append to it"):
        observe.AccessLog(tmp_path / "file" / "access.jsonl")


def test_the_operations_page_shows_the_shipped_alert_rules_and_every_alert():
    import yaml

    from tests.conftest import REPO

    rules = (REPO / "pipeline" / "serving" / "alert_rules.yml").read_text()
    page = (REPO / "docs" / "operations.md").read_text()
    assert page.split("```yaml\n", 1)[1].split("```", 1)[0] == rules
    alerts = [r["alert"] for g in yaml.safe_load(rules)["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) == 5 and all(f"| `{a}` |" in page for a in alerts), alerts


def test_the_access_log_goes_to_stderr_by_its_flag(capsys):
    observe.AccessLog(stderr=True).write({"request_id": "r1", "status": 200})
    observe.AccessLog().write({"request_id": "r2", "status": 200})  # control: neither file nor flag, no line
    assert [json.loads(x)["request_id"] for x in capsys.readouterr().err.splitlines()] == ["r1"]


def test_during_a_drain_metrics_are_still_scraped_and_show_it_while_requests_get_503():
    from pipeline.serving.drain import Drain

    fe, seen = _front()
    drain = Drain(30)
    drain.started = True
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    refused, scrape = asyncio.run(_ask(fe.app(drain), [("POST", "/v1/chat/completions", body, {}),
                                                       ("GET", "/metrics", None, {})]))
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5" and seen == []
    assert "shutting down" in refused.json()["error"]["message"] and refused.headers["x-request-id"]
    values = _values(scrape.text)
    assert scrape.status_code == 200 and values[("pipeline_serve_draining", frozenset())] == 1
    assert values[("pipeline_requests_total", frozenset({("endpoint", "/v1/chat/completions"),
                                                         ("model_name", "m"), ("status", "503")}))] == 1
