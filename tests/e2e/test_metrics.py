"""`pipeline serve` as ops watch it, with Debian's real Prometheus (2.42; installed with apt-get where missing, as the
Slurm tests install Slurm: root only, else skipped with the reason): Prometheus scrapes serve's ``/metrics`` on
loopback while a load runs, and PromQL over its HTTP API finds what was served (the request count, the TTFT
histogram's observations, the prompt and generated tokens of the answers' ``usage``) and the reference runtime's load
under TensorRT-LLM's names. The same load's access log holds one line per request with the client's
``X-Request-Id``. The shipped alert rules pass ``promtool test rules`` on planted series, and a copy with a wrong
threshold fails it. Slow tier: Prometheus' install and a served model."""
from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers import prometheus
from tests.helpers.serving import Serve

pytestmark = pytest.mark.slow

RULES = REPO / "pipeline" / "serving" / "alert_rules.yml"
RULES_TEST = REPO / "tests" / "e2e" / "alert_rules_test.yml"


@pytest.fixture(scope="module")
def binaries() -> tuple[str, str]:
    """(prometheus, promtool)."""
    try:
        return prometheus.ensure_installed()
    except prometheus.Unavailable as exc:
        pytest.skip(f"no Prometheus here: {exc}")


@pytest.fixture(scope="module")
def repo(tiny_build) -> Path:
    return next(tiny_build.glob("triton_repo/*-package-*/manifest.json")).parent


def test_the_alert_rules_pass_promtool_and_a_wrong_threshold_fails_them(binaries, tmp_path):
    promtool = binaries[1]
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS: 7 rules found" in check.stdout, check.stdout + check.stderr
    ok = subprocess.run([promtool, "test", "rules", str(RULES_TEST)], capture_output=True, text=True)
    assert ok.returncode == 0 and "SUCCESS" in ok.stdout, ok.stdout + ok.stderr
    # planted: the error-rate alert at 50% instead of 5%; the planted series of 10% 5xx must catch it
    text = RULES.read_text()
    assert text.count("pipeline:request_error_ratio:rate5m > 0.05") == 1
    (tmp_path / "alert_rules.yml").write_text(text.replace("pipeline:request_error_ratio:rate5m > 0.05",
                                                           "pipeline:request_error_ratio:rate5m > 0.5"))
    (tmp_path / "rules_test.yml").write_text(RULES_TEST.read_text().replace("../../pipeline/serving/alert_rules.yml",
                                                                            "alert_rules.yml"))
    bad = subprocess.run([promtool, "test", "rules", str(tmp_path / "rules_test.yml")], capture_output=True,
                         text=True)
    out = bad.stdout + bad.stderr
    assert bad.returncode != 0 and "alertname: PipelineHighErrorRate" in out, out


def _ask(url: str, i: int) -> dict:
    """Streamed chat completion ``i`` (its own X-Request-Id and length) -> its id, status and usage."""
    import httpx

    body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": f"Count to {i}."}],
            "max_tokens": 120 + 10 * i, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", f"{url}/chat/completions", json=body, headers={"X-Request-Id": f"load-{i}"},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
        return {"id": r.headers.get("x-request-id"), "status": r.status_code, "usage": usage}


def scrape_problems(values: dict[str, float | None], requests: int, prompt: int, completion: int) -> list[str]:
    """What Prometheus' figures get wrong about ``requests`` chat completions whose usage summed to the tokens given."""
    want = {"requests": requests, "ttft_observations": requests, "prompt_tokens": prompt,
            "generation_tokens": completion}
    return [f"{k}: {values.get(k)}, expected {v}" for k, v in want.items() if values.get(k) != v]


QUERIES = {"requests": 'sum(pipeline_requests_total{endpoint="/v1/chat/completions",status="200"})',
           "ttft_observations": "sum(vllm:time_to_first_token_seconds_count)",
           "prompt_tokens": "sum(vllm:prompt_tokens_total)", "generation_tokens": "sum(vllm:generation_tokens_total)"}


def log_problems(lines: dict[str, dict], answers: list[dict]) -> list[str]:
    """What the access log (request id -> its line) gets wrong about the ``answers``."""
    out = []
    for a in answers:
        line = lines.get(a["id"])
        if line is None:
            out.append(f"{a['id']}: no line")
            continue
        got = (line["status"], line["prompt_tokens"], line["completion_tokens"])
        want = (a["status"], a["usage"]["prompt_tokens"], a["usage"]["completion_tokens"])
        if got != want or not (0 < line["ttft_s"] <= line["duration_s"]):
            out.append(f"{a['id']}: {got}, ttft {line['ttft_s']}, duration {line['duration_s']}; expected {want}")
    return out


def test_prometheus_scrapes_what_serve_served(binaries, repo, tmp_path):
    n = 12
    access = tmp_path / "access.jsonl"
    with Serve(repo, "serve.openai.port=0", f"serve.openai.access_log.path={access}", cwd=tmp_path) as s:
        metrics = next(x.split()[1] for x in s.lines if x.startswith("metrics "))
        target = metrics.removeprefix("http://").removesuffix("/metrics")
        with prometheus.Prometheus(binaries[0], tmp_path / "prometheus", [target], interval_s=1.0) as prom:
            prom.wait_scraped(after=time.time())
            before = time.time()  # Prometheus holds the series, and nothing was served yet
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda i: _ask(s.url, i), range(n)))
            prom.wait_scraped(after=time.time())
            values = {k: prom.value(q) for k, q in QUERIES.items()}
            stale = {k: prom.value(q, at=before) for k, q in QUERIES.items()}
            # the reference runtime's own load, under TensorRT-LLM's names, moved while the load ran
            kv = prom.value('max_over_time(nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}[5m])')
            scheduled = prom.value('max_over_time(nv_trt_llm_request_metrics{request_type="scheduled"}[5m])')
            derived = prom.value("max_over_time(vllm:kv_cache_usage_perc[5m])")
            ready = prom.value("pipeline_triton_ready")
            budget = prom.query("pipeline_ttft_budget_seconds")
        assert s.stop() == 0
    assert all(a["status"] == 200 and a["usage"] for a in answers), answers
    assert [a["id"] for a in answers] == [f"load-{i}" for i in range(n)]  # X-Request-Id honoured and returned
    prompt = sum(a["usage"]["prompt_tokens"] for a in answers)
    completion = sum(a["usage"]["completion_tokens"] for a in answers)
    assert scrape_problems(values, n, prompt, completion) == [], values
    # planted failure: the same queries at a time before the load, when no counter had been incremented, are caught
    assert len(scrape_problems(stale, n, prompt, completion)) == 4, stale
    assert kv is not None and 0 < kv <= 1 and scheduled is not None and scheduled >= 1, (kv, scheduled)
    assert derived is not None and derived > 0 and ready == 1
    assert budget and budget[0]["metric"]["source"] in ("predicted", "measured", "slo")
    # one access-log line per request, with the client's id, status, tokens and timings
    lines = [json.loads(x) for x in access.read_text().splitlines()]
    assert len(lines) == n, lines
    by_id = {line["request_id"]: line for line in lines}
    assert log_problems(by_id, answers) == []
    # planted failure: another request's line for the first request (its tokens differ) is caught
    swapped = {**by_id, "load-0": by_id["load-1"]}
    assert log_problems(swapped, answers) and log_problems(swapped, answers)[0].startswith("load-0:")
    assert "Count to" not in access.read_text()  # never the prompt


def test_the_helper_reads_prometheus_times():
    """Prometheus writes nanoseconds and a zone; the scrape wait compares them with time.time()."""
    assert prometheus._unix("2026-12-07T03:55:50.123456789Z") == pytest.approx(1796615750.123456789, abs=1e-6)
    assert prometheus._unix("2026-12-07T04:55:50+01:00") == pytest.approx(1796615750.0, abs=1e-6)
