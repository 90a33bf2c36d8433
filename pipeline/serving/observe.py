"""What ops see of the OpenAI front end: Prometheus metrics (``GET /metrics``) and one access-log line per request.

:class:`Observer` is the ASGI middleware in front of the routes. For each request of the API (``/v1/...``) it takes
the request id (the client's ``X-Request-Id`` when it is a plain token of up to 128 characters, else a new one;
returned in ``X-Request-Id``), keeps a :class:`Record` of the request in a context variable that the endpoints and the
driver fill (the model, the prompts' jobs, the arrival of each Triton response), and when the request ends feeds
:class:`Metrics` and writes the access-log line (:class:`AccessLog`). ``GET /metrics`` and ``GET /health`` are not
requests of the API: neither counted nor logged. The Triton request id of a request's first prompt is its request
id (``-1``, ``-2``, ... for its other prompts; a suffix ``~N`` where a client reuses an id still in flight), so a
request can be followed from the access log into Triton's log and trace.

Metrics (``prometheus-client``, a registry of the front end's own): the vLLM names, buckets and ``model_name`` label
where the meaning is the same (vllm-project/vllm ``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``), so
dashboards built for vLLM read them; ``pipeline_*`` for the rest. TTFT and inter-token latency are observed for
streamed requests (a non-streamed answer arrives whole): the time from the request's arrival at the front end to
Triton's first response for it, and between two responses of one prompt. ``vllm:num_requests_running``,
``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` are the runtime's own figures, read from Triton's
``nv_trt_llm_request_metrics`` (``scheduled``, ``waiting``) and ``nv_trt_llm_kv_cache_block_metrics`` (``fraction``)
at each scrape; they are absent where Triton reports neither. Triton's own metrics follow the front end's in the
same response (its metrics port, read at each scrape): one scrape target for both. docs/operations.md lists every
metric.
"""
from __future__ import annotations

import asyncio
import contextvars
import datetime as dt
import json
import re
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# vLLM's buckets (vllm/v1/metrics/loggers.py): TTFT, inter-token latency, end-to-end request latency
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
GENERATION = ("/v1/chat/completions", "/v1/completions")
UNOBSERVED = ("/metrics", "/health")  # probes and scrapes: not requests of the API
REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
TRITON_METRICS_TIMEOUT_S = 2.0
READY_TIMEOUT_S = 2.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format

_CURRENT: contextvars.ContextVar["Record | None"] = contextvars.ContextVar("pipeline_serving_request", default=None)


def current() -> "Record | None":
    """The record of the request this task serves (None outside one)."""
    return _CURRENT.get()


def endpoint_of(path: str) -> str:
    """A request path as a metric label: the route it takes (bounded: any other path is ``other``)."""
    if path in GENERATION or path == "/v1/models":
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


def ttft_budget(repo: Path) -> tuple[float, str] | None:
    """The TTFT budget of a served repository, in seconds, and where it comes from: the performance model's
    prediction for the chosen configuration (``bundle.json`` ``capacity.serving.profile.chosen.ttft_ms``,
    ``predicted``), else the slowest TTFT p95 its bench measured (``bench.workloads.*[].ttft_p95_ms``,
    ``measured``), else the service limit it was planned for (``serve.slo.ttft_ms`` of its recipe or, for a package
    stage's output, of its manifest: ``slo``); None where the repository says none."""
    doc: dict[str, Any] = {}
    for path in (Path(repo).parent / "bundle.json", Path(repo) / "manifest.json"):
        try:
            doc = json.loads(path.read_text())
            break
        except (OSError, ValueError):
            continue
    try:
        chosen = (((doc.get("capacity") or {}).get("serving") or {}).get("profile") or {}).get("chosen") or {}
        if chosen.get("ttft_ms"):
            return float(chosen["ttft_ms"]) / 1000, "predicted"
        measured = [row["ttft_p95_ms"] for rows in ((doc.get("bench") or {}).get("workloads") or {}).values()
                    for row in rows if isinstance(row, dict) and row.get("ttft_p95_ms")]
        if measured:
            return float(max(measured)) / 1000, "measured"
        conf = ((doc.get("recipe") or {}).get("package") or doc.get("config") or {})
        slo = ((conf.get("serve") or {}).get("slo") or {}).get("ttft_ms")
        if slo:
            return float(slo) / 1000, "slo"
    except (AttributeError, TypeError, ValueError):
        pass
    return None


class Metrics:
    """The front end's metrics, in a registry of its own (two front ends in one process do not share counters)."""

    def __init__(self, model_name: str, budget: tuple[float, str] | None = None):
        import prometheus_client
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        prometheus_client.disable_created_metrics()  # no *_created series (as vLLM and TensorRT-LLM serve them)
        self.model_name = model_name
        r = self.registry = CollectorRegistry(auto_describe=True)
        m = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token of streamed requests in "
                              "seconds: from the request's arrival to Triton's first response", m,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two Triton responses of one prompt of "
                             "a streamed request, in seconds", m, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end latency of generation requests in "
                             "seconds (arrival to the last byte sent)", m, buckets=E2E_BUCKETS,
                             registry=r).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of generation requests (their usage)", m,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens of generation requests (their "
                                         "usage; the tokens produced so far for one that ended early)", m,
                                         registry=r).labels(model_name)
        self.success = Counter("vllm:request_success", "Generation requests answered in full, by finish reason", [
            *m, "finished_reason"], registry=r)
        self.requests = Counter("pipeline_requests", "Requests of the OpenAI API by endpoint and status (a stream "
                                "that ended with an error event counts with that error's status)",
                                ["endpoint", "model_name", "status"], registry=r)
        self.in_flight = Gauge("pipeline_requests_in_flight", "Requests of the OpenAI API the front end is "
                               "answering now", m, registry=r).labels(model_name)
        self.draining = Gauge("pipeline_serve_draining", "1 while pipeline serve drains (SIGTERM/SIGINT)",
                              registry=r)
        self.restarting = Gauge("pipeline_triton_restarting", "1 while Triton is down and being restarted "
                                "(serve.restart=on-failure)", registry=r)
        self.restarts = Counter("pipeline_triton_restarts", "Times Triton was restarted after it died", registry=r)
        self.ready = Gauge("pipeline_triton_ready", "1 when Triton serves the entry point (probed at each scrape, "
                           f"within {READY_TIMEOUT_S:g} s)", registry=r)
        self.triton_scrape_ok = Gauge("pipeline_triton_metrics_up", "1 when Triton's metrics were read for this "
                                      "scrape", registry=r)
        if budget is not None:
            Gauge("pipeline_ttft_budget_seconds", "The served bundle's TTFT budget: predicted, measured or its "
                  "service limit (label source)", [*m, "source"], registry=r).labels(model_name, budget[1]).set(
                budget[0])
        self._runtime = _RuntimeLoad(model_name)
        r.register(self._runtime)
        for path in GENERATION:  # present from the start, so that increase() sees the first request
            self.requests.labels(path, model_name, "200")
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)

    def render(self, triton_text: str | None) -> bytes:
        """The scrape: the front end's metrics, then Triton's (``triton_text``) as Triton wrote them."""
        from prometheus_client import generate_latest

        self._runtime.read(triton_text)
        self.triton_scrape_ok.set(1 if triton_text is not None else 0)
        own = generate_latest(self.registry)
        return own + (triton_text.encode() if triton_text else b"")


class _RuntimeLoad:
    """``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` / ``vllm:kv_cache_usage_perc`` from Triton's
    TensorRT-LLM load metrics of the same scrape (the Kubernetes Gateway API Inference Extension reads the latter for
    a Triton server, the former for vLLM: FACTS §11). Upstream's meaning (TensorRT-LLM triton_backend
    ``model_instance_state.cc`` ``WaitForStats`` @ c8c6df08bd): ``scheduled`` the requests of the current
    iteration, ``waiting`` the active ones not scheduled, ``fraction`` used KV blocks over the maximum."""

    SOURCES = {"vllm:num_requests_running": ("nv_trt_llm_request_metrics", "request_type", "scheduled", sum,
                                             "Requests in the runtime's batch (nv_trt_llm_request_metrics "
                                             "scheduled)"),
               "vllm:num_requests_waiting": ("nv_trt_llm_request_metrics", "request_type", "waiting", sum,
                                             "Requests waiting for the runtime's batch (nv_trt_llm_request_metrics "
                                             "waiting)"),
               "vllm:kv_cache_usage_perc": ("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", "fraction",
                                            max, "KV-cache usage, 1 = full (nv_trt_llm_kv_cache_block_metrics "
                                                 "fraction)")}

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.values: dict[str, float] = {}

    def read(self, text: str | None) -> None:
        values: dict[str, float] = {}
        if text:
            from prometheus_client.parser import text_string_to_metric_families

            found: dict[tuple[str, str, str], list[float]] = {}
            try:
                for fam in text_string_to_metric_families(text):
                    if fam.name.startswith("nv_trt_llm_"):
                        for s in fam.samples:
                            for key, value in s.labels.items():
                                found.setdefault((s.name, key, value), []).append(s.value)
            except ValueError:  # not the text format: nothing derived
                found = {}
            for name, (family, key, value, agg, _) in self.SOURCES.items():
                got = found.get((family, key, value))
                if got:
                    values[name] = float(agg(got))
        self.values = values

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        for name, value in self.values.items():
            g = GaugeMetricFamily(name, self.SOURCES[name][4], labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g


class AccessLog:
    """One JSON line per request: to ``path`` (appended, a line at a time) and/or stderr. Never the prompt, the
    answer or a header's value (the API key)."""

    def __init__(self, path: str | Path | None = None, stderr: bool = False):
        from pipeline.errors import UserError

        self.file = None
        self.stderr = bool(stderr)
        if path:
            p = Path(path).expanduser()
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
                self.file = open(p, "a", buffering=1, encoding="utf-8")
            except OSError as exc:
                raise UserError(f"serve.openai.access_log.path={path}: cannot append to it ({exc.strerror}); give "
                                f"a writable file or leave it null") from None
        self.enabled = self.file is not None or self.stderr

    def write(self, entry: dict[str, Any]) -> None:
        line = json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n"
        if self.file is not None:
            self.file.write(line)
        if self.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()


@dataclass(eq=False)
class Record:
    """One request of the API as it goes: filled by :class:`Observer` (id, client, status), the endpoint (the model,
    whether it streams, its jobs) and the driver (:meth:`response` for each Triton response)."""

    observer: "Observer"
    request_id: str
    method: str
    path: str
    client: str | None
    start: float = field(default_factory=time.perf_counter)
    status: int = 0
    error_status: int | None = None  # an error after the status line went out (an error event, a cut, a client gone)
    model: str | None = None
    stream: bool = False
    jobs: list = field(default_factory=list)
    first: float | None = None  # Triton's first response for the request (perf_counter)
    last: dict = field(default_factory=dict)  # Triton request id -> its last response
    triton_ids: list = field(default_factory=list)

    def next_triton_id(self) -> str:
        """The Triton request id of the request's next prompt: its request id, then ``-1``, ``-2``, ...; one still
        in flight for another request gets a suffix ``~N``."""
        base = self.request_id if not self.triton_ids else f"{self.request_id}-{len(self.triton_ids)}"
        taken, rid, n = self.observer.triton_ids, base, 1
        while rid in taken:
            rid, n = f"{base}~{n}", n + 1
        taken.add(rid)
        self.triton_ids.append(rid)
        return rid

    def response(self, triton_id: str) -> None:
        """A response from Triton for one of the request's prompts arrived (the driver calls this)."""
        now = time.perf_counter()
        metrics = self.observer.metrics
        if self.first is None:
            self.first = now
            if self.stream:
                metrics.ttft.observe(now - self.start)
        prev = self.last.get(triton_id)
        self.last[triton_id] = now
        if prev is not None and self.stream:
            metrics.itl.observe(now - prev)

    def failed(self, status: int) -> None:
        """The request ended with an error after its status line (kept: the first one)."""
        if self.error_status is None:
            self.error_status = int(status)


def next_triton_id() -> str:
    """The Triton request id for the next prompt of the current request (a new one outside a request)."""
    rec = _CURRENT.get()
    return rec.next_triton_id() if rec is not None else uuid.uuid4().hex[:16]


def started(model: str, stream: bool, jobs: list) -> None:
    """The current request was accepted: its model, whether it streams, its prompts' jobs (no-op outside one)."""
    rec = _CURRENT.get()
    if rec is not None:
        rec.model, rec.stream, rec.jobs = model, bool(stream), jobs


def failed(status: int) -> None:
    """Mark the current request as ended by an error of ``status`` after its status line (no-op outside one)."""
    rec = _CURRENT.get()
    if rec is not None:
        rec.failed(status)


class Observer:
    """The ASGI middleware of :mod:`pipeline.serving.observe` (``front``: the FrontEnd, for its model, metrics and
    access log)."""

    def __init__(self, app, front):
        self.app, self.front = app, front
        self.metrics: Metrics = front.metrics
        self.log: AccessLog = front.access_log
        self.triton_ids: set[str] = set()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNOBSERVED:
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers", []) if k == b"x-request-id"), b"").decode("latin-1")
        rid = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        client = scope.get("client")
        rec = Record(self, rid, scope.get("method", ""), scope["path"], client[0] if client else None)
        header = (b"x-request-id", rid.encode())

        async def tell(msg):
            if msg["type"] == "http.response.start":
                rec.status = msg["status"]
                msg = {**msg, "headers": [*msg.get("headers", []), header]}
            await send(msg)

        token = _CURRENT.set(rec)
        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, tell)
        except asyncio.CancelledError:
            rec.failed(499)
            raise
        except BaseException:
            rec.failed(500)
            raise
        finally:
            _CURRENT.reset(token)
            self.metrics.in_flight.dec()
            self.triton_ids.difference_update(rec.triton_ids)
            self.finish(rec)

    def finish(self, rec: Record) -> None:
        """The request ended: its metrics and its access-log line."""
        now = time.perf_counter()
        m, served = self.metrics, self.front.served
        status = rec.error_status or rec.status or 500
        m.requests.labels(endpoint_of(rec.path), m.model_name, str(status)).inc()
        prompt = completion = 0
        reasons = []
        for job in rec.jobs:
            if getattr(job, "agen", None) is None or job.problem is not None:
                continue  # never started, or refused for its count
            prompt += job.prompt_tokens or 0
            if job.finish is not None:
                completion += job.completion_tokens
            elif job.text:
                completion += served.count(job.text)
            reasons.append(job.finish or "abort")
        if reasons:
            m.prompt_tokens.inc(prompt)
            m.generation_tokens.inc(completion)
            m.e2e.observe(now - rec.start)
            if status == 200:
                for reason in reasons:
                    m.success.labels(m.model_name, reason).inc()
        if self.log.enabled:
            self.log.write({
                "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                "request_id": rec.request_id, "client": rec.client, "method": rec.method, "endpoint": rec.path,
                "model": rec.model, "status": status, "stream": rec.stream,
                "prompt_tokens": prompt if reasons else None, "completion_tokens": completion if reasons else None,
                "finish_reason": reasons or None,
                "ttft_s": round(rec.first - rec.start, 6) if rec.first is not None and rec.stream else None,
                "duration_s": round(now - rec.start, 6),
                **({"triton_request_ids": rec.triton_ids} if rec.triton_ids and rec.triton_ids != [rec.request_id]
                   else {})})


async def triton_metrics(url: str | None) -> str | None:
    """Triton's metrics (``GET url``, its metrics port), or None where it does not answer in time."""
    if not url:
        return None

    def read() -> str:
        with urllib.request.urlopen(url, timeout=TRITON_METRICS_TIMEOUT_S) as r:
            return r.read().decode("utf-8", errors="replace")

    try:
        return await asyncio.to_thread(read)
    except Exception:  # noqa: BLE001 - a server that is down or stalled: its metrics are left out of this scrape
        return None
