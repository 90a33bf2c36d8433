"""bench: serve the packaged repository on a real Triton server, check answers, measure streaming load, gate.

The only stage (with ``pipeline.triton``) that talks to Triton. The server comes from ``serve.launcher``: a local
binary, an NGC container, or an external URL; before measuring, the server's models and their configs (names,
inputs, outputs) must match the packaged repository. The load goes through the layout's own entry point, recorded by
the package stage: ``ensemble`` (or ``tensorrt_llm_bls``, ``bench.model``) for ``inflight_batcher_llm``, the
``tensorrt_llm`` model with its LLM-API tensor names for ``llmapi``. Two workloads (``chat``: short prompts, long
outputs; ``rag``: long prompts, short outputs) are drawn reproducibly from the shipped corpus (``bench.seed``),
rendered with the chat template when ``model.chat_template`` is on, and swept over ``bench.concurrency`` after
``bench.warmup_requests`` warm-up requests (sent once, before the first workload). The default sweep depends on the
target device (``bench.sweep``): a short smoke on CPU, the full sweep on GPUs.

Output tokens are counted by re-tokenizing each response's returned text with the model's tokenizer (no special
tokens), as genai-perf and aiperf do: a response without text adds nothing. Inter-token latency is (request latency -
TTFT) / (output tokens - 1) per request, aiperf's definition.

- ``bench.json`` keeps genai-perf/aiperf profile-export field names (``time_to_first_token``,
  ``inter_token_latency``, ``request_latency``, ``output_token_throughput``, ``request_throughput``; ms).
- ``aiperf/<workload>/concurrency_<N>/`` holds aiperf's own export of each level (``profile_export_aiperf.json``,
  ``profile_export.jsonl``, and the prompts sent), which ``aiperf plot`` reads.
- ``requests.jsonl`` holds one line per request sent (answer checks, warm-up and every measured level).

Gates (``bench.json["gates"]``): absolute limits (``bench.gates``) and the regression against the previous bundle of
the same model/quant/target/runtime (output tokens/s, and the p95 of TTFT, inter-token and request latency, each
within ``bench.gates.regression_pct``). The verdict is ``fail`` on a breach (the stage fails, naming the number and
by how much), ``no-baseline`` when the regression gate applies but the previous bundle cannot be read (an
unreachable ``publish.dest``, a corrupt ``bundle.json``), else ``pass``. Only "nothing published yet" is an empty
baseline.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pipeline import calib, results
from pipeline.errors import StageFailed, UserError
from pipeline.identity import ArtifactKey
from pipeline.results import BenchResult
from pipeline.runner import Context, Stage
from pipeline.triton import server as srv
from pipeline.triton.layouts import ENGINE_REL, ENTRY_POINTS  # the tokenizer lives with the engine in every layout
from pipeline.ui import progress, status

COUNTING = ("output tokens: each response's returned text re-tokenized with the model's tokenizer (no special "
            "tokens), as genai-perf/aiperf count them, so responses without text add none; inter-token latency: "
            "(request latency - TTFT) / (output tokens - 1) per request")


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    """``n`` prompts of about ``words`` words, consecutive corpus text from a seeded position."""
    texts = calib.load("builtin")
    stream = " ".join(texts.calib + texts.heldout).split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(0, max(1, len(stream) - words))
        body = " ".join((stream * (1 + words // len(stream) + 1))[start:start + words])
        out.append("Continue this text: " + body)
    return out


def _render(tok, prompt: str, chat: bool) -> str:
    if chat and getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
    return prompt


def choose_entry(choice: str, layout: str, entry_points: list[str] | tuple[str, ...] | None = None) -> str:
    """The model the load goes through: ``bench.model`` (``auto``: the layout's first entry point). A choice the
    layout lacks is a :class:`UserError` naming the ones it has."""
    have = list(entry_points or ENTRY_POINTS.get(layout, ()))
    if layout not in ENTRY_POINTS or not have:
        raise UserError(f"the packaged repository has layout '{layout}', which the bench cannot drive "
                        f"(it drives: {', '.join(ENTRY_POINTS)})")
    if choice == "auto":
        return have[0]
    if choice not in have:
        raise UserError(f"bench.model={choice}: the {layout} layout has no such entry point (it has: "
                        f"{', '.join(have)}); set bench.model=auto")
    return choice


def _layout_of(cfg) -> str | None:
    from pipeline.stages import package

    try:
        return package.layout(cfg)
    except UserError:  # package reports a layout that cannot serve the runtime itself
        return None


def packaged_configs(repo: Path) -> dict[str, Any]:
    """{model name: its parsed config.pbtxt} for every model of the packaged repository."""
    from pipeline.triton.render import parse_model_config

    return {p.parent.name: parse_model_config(p.read_text(), name=f"{p.parent.name}/config.pbtxt")
            for p in sorted(repo.glob("*/config.pbtxt"))}


def run(ctx: Context) -> BenchResult:
    from transformers import AutoTokenizer

    from pipeline.triton import client

    cfg = ctx.cfg
    repo = ctx.inputs["package"]
    pkg = results.load("package", ctx.manifests["package"]["result"])
    layout = pkg.layout
    entry_model = choose_entry(cfg.bench.model.value, layout, pkg.entry_points)
    tok = AutoTokenizer.from_pretrained(repo / ENGINE_REL)
    packaged = packaged_configs(repo)
    baseline = previous_bench(ctx)
    result: dict[str, Any] = {"model": entry_model, "layout": layout, "launcher": cfg.serve.launcher.value,
                              "counting": COUNTING, "workloads": {}, "answers": []}
    requests: list[dict[str, Any]] = []
    levels: list[dict[str, Any]] = []  # what the aiperf export needs of each measured level
    started = time.perf_counter()
    log_path = None
    writer = ThreadPoolExecutor(1, thread_name_prefix="bench-reports")
    reports = None
    try:
        with contextlib.ExitStack() as stack:  # the server is stopped on every exit path
            with status(f"starting tritonserver ({cfg.serve.launcher.value}; loading models)"):
                server = stack.enter_context(srv.launched(cfg.serve, repo, ctx.paths["store"] / "servers"))
            log_path = server.log_path
            result["server_start_s"] = round(time.perf_counter() - started, 2)
            mismatches = client.server_model_mismatches(server.grpc_url, packaged)
            if mismatches:
                more = f" (+{len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
                what = (f"the server at {server.grpc_url} does not serve this package's repository: "
                        f"{mismatches[0]}{more}")
                if cfg.serve.launcher.value == "external":
                    raise UserError(f"{what}; point serve.url at a server of {repo}")
                raise StageFailed(what)
            try:
                entry = client.entry_point(server.grpc_url, entry_model, layout)
            except ValueError as exc:
                raise StageFailed(str(exc)) from exc
            result["decoupled"] = entry.decoupled
            _bench(ctx, server, entry, tok, result, requests, levels)
            # measured: the reports that need only the measurements are written while the server shuts down
            reports = writer.submit(_measurement_reports, ctx.out, result, levels, tok, bool(cfg.bench.plot))
    except srv.ServerError as exc:
        (ctx.out / "server-error.txt").write_text(str(exc) + "\n")
        raise StageFailed(str(exc).splitlines()[0] + " (server log tail: server-error.txt)") from exc
    finally:
        writer.shutdown(wait=True)
        if log_path is not None and log_path.is_file():
            shutil.copy2(log_path, ctx.out / "server.log")
    reports.result()  # raises what the writer raised

    result["gates"] = gates(cfg, result, baseline)
    (ctx.out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (ctx.out / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    (ctx.out / "bench.md").write_text(markdown(cfg.model.name, result))
    failed = [a for a in result["answers"] if not a["pass"]]
    why = [f"answer check failed: {a['prompt']!r} -> {a['text']!r} (expected {a['expect']})" for a in failed]
    why += result["gates"]["breaches"]
    if why:
        raise StageFailed("; ".join(why))
    return bench_result(result)


def _measurement_reports(out: Path, result: dict[str, Any], levels: list[dict[str, Any]], tok, with_plot: bool) -> None:
    """aiperf's export of every measured level and the plot: they read the measurements only."""
    for lv in levels:
        aiperf_export(out / "aiperf" / lv["workload"] / f"concurrency_{lv['concurrency']}", lv, tok)
    if with_plot:
        plot(result, out / "bench.png")


GATE_KEYS = ("verdict", "breaches", "regressions", "regressions_gated", "compared_with_previous_levels", "baseline")


def bench_result(result: dict[str, Any]) -> BenchResult:
    """The stage's typed result from bench.json's content: the rows of every level and the gates (without checks)."""
    return BenchResult(
        model=result["model"], layout=result["layout"],
        workloads={w: [summary_row(lv) for lv in r["levels"]] for w, r in result["workloads"].items()},
        answers_passed=len(result["answers"]), answers=len(result["answers"]),
        gates={k: result["gates"][k] for k in GATE_KEYS})


def summary_row(lv: dict[str, Any]) -> dict[str, Any]:
    return {"concurrency": lv["concurrency"], "request_count": lv["request_count"], "error_count": lv["error_count"],
            "ttft_p50_ms": lv["time_to_first_token"]["p50"], "ttft_p95_ms": lv["time_to_first_token"]["p95"],
            "itl_p50_ms": lv["inter_token_latency"]["p50"], "itl_p95_ms": lv["inter_token_latency"]["p95"],
            "latency_p95_ms": lv["request_latency"]["p95"], "latency_p99_ms": lv["request_latency"]["p99"],
            "output_tokens_per_s": lv["output_token_throughput"]["avg"],
            "requests_per_s": lv["request_throughput"]["avg"]}


def _bench(ctx: Context, server, entry, tok, result: dict[str, Any], requests: list[dict[str, Any]],
           levels: list[dict[str, Any]]) -> None:
    """Answer checks, the warm-up (once, before the first workload), then each workload's concurrency levels; every
    request sent is appended to ``requests`` (the lines of requests.jsonl), every measured level to ``levels``."""
    from pipeline.triton import client

    cfg, b = ctx.cfg, ctx.cfg.bench
    url, chat = server.grpc_url, bool(cfg.model.chat_template)

    def keep(records, phase: str, workload: str | None, concurrency: int) -> None:
        client.count_output_tokens(records, tok)
        requests.extend({"phase": phase, "workload": workload, "concurrency": concurrency, **r.as_dict()}
                        for r in records)

    if cfg.model.checks:  # fixed prompts, greedy, through the same entry point as the load
        w = client.StreamWorker(url, entry, b.request_timeout_s)
        try:
            for chk in cfg.model.checks:
                rec = w.request(-1, _render(tok, chk.prompt, chat), b.answer_max_tokens)
                keep([rec], "check", None, 1)
                ok = rec.error is None and any(e.lower() in rec.text.lower() for e in chk.expect)
                result["answers"].append({"prompt": chk.prompt, "expect": list(chk.expect), "text": rec.text,
                                          "error": rec.error, "pass": ok})
        finally:
            w.close()
    for wi, wname in enumerate(b.workloads):
        spec = b[wname]
        plan = [(int(c), max(int(c), b.requests_per_level)) for c in b.concurrency]
        total = b.warmup_requests + sum(n for _, n in plan)
        prompts = [_render(tok, p, chat) for p in make_prompts(total, spec.prompt_words, b.seed + wi)]
        if b.warmup_requests and wi == 0:  # the later workloads find the server warm
            records, _ = client.run_level(url, entry, prompts, list(range(b.warmup_requests)), 1, spec.max_tokens,
                                          b.request_timeout_s)
            keep(records, "warmup", wname, 1)
        offset, out = b.warmup_requests, []
        for conc, n in plan:
            order = list(range(offset, offset + n))
            offset += n
            with progress(f"bench {wname}: concurrency {conc}", n) as bar:
                records, wall = client.run_level(url, entry, prompts, order, conc, spec.max_tokens,
                                                 b.request_timeout_s, bar.advance)
            keep(records, "measure", wname, conc)
            if not server.alive():
                raise srv.ServerError(f"tritonserver died during {wname} at concurrency {conc}:\n"
                                      f"{server.log_tail()}")
            if any(r.error for r in records) and not server.responsive():
                raise srv.ServerError(f"tritonserver stopped answering during {wname} at concurrency {conc} (hung: "
                                      f"its process is alive, its readiness probe times out):\n{server.log_tail()}")
            summary = client.summarize(records, wall)
            out.append({"concurrency": conc, **summary})
            levels.append({"workload": wname, "concurrency": conc, "records": records, "wall_s": wall,
                           "summary": summary, "prompts": prompts, "max_tokens": spec.max_tokens,
                           "entry": entry,  # an external server's HTTP port is unknown: Triton's default
                           "http_url": server.http_url if server.http_port else f"http://{server.host}:8000"})
        result["workloads"][wname] = {"prompt_words": spec.prompt_words, "max_tokens": spec.max_tokens,
                                      "levels": out}


# ------------------------------------------------------------------------------------------------- aiperf export
AIPERF_SCHEMA_VERSION = "1.4"  # aiperf 0.13 JsonExportData.SCHEMA_VERSION


def _request_body(entry, max_tokens: int) -> str:
    """The request the generator sent, as the JSON body of Triton's HTTP generate extension (a Jinja2 template)."""
    from pipeline.triton.client import EXCLUDE_INPUT

    text, max_name, stream = entry.tensors
    exclude = f', "{EXCLUDE_INPUT[entry.layout]}": true' if entry.exclude_input else ""
    return (f'{{"{text}": {{{{ text|tojson }}}}, "{max_name}": {max_tokens}, "{stream}": '
            f'{str(entry.decoupled).lower()}{exclude}}}')


def aiperf_export(out: Path, level: dict[str, Any], tok) -> None:
    """aiperf's export of one measured level, in the schema of aiperf 0.13 (``JsonExportData`` in
    ``aiperf/common/models/export_models.py``, ``MetricRecordInfo`` in ``record_models.py``): per-request records in
    ``profile_export.jsonl`` (display units: ms, tokens), the level's statistics in ``profile_export_aiperf.json``.
    Its ``input_config`` is the aiperf configuration that replays the level through Triton's HTTP
    ``generate_stream`` endpoint (a ``template`` endpoint over ``prompts.jsonl``); ``metadata`` says what measured
    it."""
    from pipeline import __version__
    from pipeline.triton import client

    out.mkdir(parents=True, exist_ok=True)
    entry, recs, wname, conc = level["entry"], level["records"], level["workload"], level["concurrency"]
    sent = [r for r in recs if r.sent_ns]
    order = sorted(sent, key=lambda r: r.sent_ns)
    isl = {r.prompt_index: len(tok.encode(level["prompts"][r.prompt_index], add_special_tokens=False)) for r in sent}
    (out / "prompts.jsonl").write_text("".join(json.dumps({"text": level["prompts"][r.prompt_index]}) + "\n"
                                               for r in order))

    def ns(r) -> int:
        return r.sent_ns + int(1e9 * (r.latency or 0.0))

    def value(v, unit):
        return {"value": v, "unit": unit}

    lines = []
    for i, r in enumerate(order):
        metrics: dict[str, Any] = {"request_latency": value(round(1000 * r.latency, 3), "ms")} if r.latency else {}
        metrics["input_sequence_length"] = value(isl[r.prompt_index], "tokens")
        if r.error is None:
            if r.ttft is not None:
                metrics["time_to_first_token"] = value(round(1000 * r.ttft, 3), "ms")
            metrics["output_sequence_length"] = value(r.output_tokens, "tokens")
            if r.itl:
                metrics["inter_token_latency"] = value(round(1000 * r.itl, 3), "ms")
                metrics["output_token_throughput_per_user"] = value(round(1.0 / r.itl, 3), "tokens/sec/user")
            if r.chunk_gaps:
                metrics["inter_chunk_latency"] = value([round(1000 * g, 3) for g in r.chunk_gaps], "ms")
        line = {"metadata": {"session_num": i, "x_request_id": f"{wname}-c{conc}-{i}", "request_start_ns": r.sent_ns,
                             "request_end_ns": ns(r), "worker_id": f"worker_{r.worker}",
                             "record_processor_id": "llm-pipeline", "benchmark_phase": "profiling"},
                "metrics": metrics,
                "error": None if r.error is None else {"code": None, "type": "RequestError", "message": r.error}}
        lines.append(json.dumps(line) + "\n")
    (out / "profile_export.jsonl").write_text("".join(lines))

    s = level["summary"]
    ok = [r for r in recs if r.error is None]
    gaps = [g for r in ok for g in r.chunk_gaps]
    start = min((r.sent_ns for r in sent), default=time.time_ns())
    end = max((ns(r) for r in sent), default=start)
    errors: dict[str, int] = {}
    for r in recs:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    http = level.get("http_url") or "http://127.0.0.1:8000"
    doc = {
        "schema_version": AIPERF_SCHEMA_VERSION,
        "request_throughput": {"unit": "requests/sec", "avg": s["request_throughput"]["avg"]},
        "request_latency": {**s["request_latency"], "count": len(ok)},
        "request_count": {"unit": "requests", "avg": float(len(ok))},
        "time_to_first_token": s["time_to_first_token"],
        "inter_token_latency": s["inter_token_latency"],
        "inter_chunk_latency": client.stats(gaps),
        "output_token_throughput": {"unit": "tokens/sec", "avg": s["output_token_throughput"]["avg"]},
        "output_token_throughput_per_user": client.stats([1.0 / r.itl for r in ok if r.itl], "tokens/sec/user", 1.0),
        "output_sequence_length": s["output_sequence_length"],
        "input_sequence_length": client.stats([isl[r.prompt_index] for r in ok], "tokens", 1.0),
        "total_output_tokens": {"unit": "tokens", "avg": float(sum(r.output_tokens or 0 for r in ok))},
        "total_isl": {"unit": "tokens", "avg": float(sum(isl[r.prompt_index] for r in ok))},
        "benchmark_duration": {"unit": "sec", "avg": level["wall_s"]},
        "error_request_count": {"unit": "requests", "avg": float(len(recs) - len(ok))},
        "input_config": {
            "models": {"items": [{"name": entry.model}]},
            "endpoint": {"urls": [http if "://" in http else f"http://{http}"], "type": "template",
                         "path": f"/v2/models/{entry.model}/generate_stream", "streaming": True,
                         "template": {"body": _request_body(entry, level["max_tokens"]),
                                      "response_field": "text_output"}},
            "datasets": [{"name": "main", "type": "file", "path": "prompts.jsonl", "format": "single_turn"}],
            "phases": [{"name": "profiling", "type": "concurrency", "concurrency": conc, "requests": len(recs)}],
        },
        "was_cancelled": False,
        "is_complete": True,
        "error_summary": [{"error_details": {"message": m}, "count": n} for m, n in sorted(errors.items())] or None,
        "start_time": _dt.datetime.fromtimestamp(start / 1e9).isoformat(),
        "end_time": _dt.datetime.fromtimestamp(end / 1e9).isoformat(),
        "metadata": {"producer": f"llm-pipeline {__version__}", "workload": wname, "layout": entry.layout,
                     "load_generator": "tritonclient gRPC bidirectional stream, one per concurrent worker",
                     "counting": COUNTING},
    }
    (out / "profile_export_aiperf.json").write_text(json.dumps(doc, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------- regression gate
def _bench_rows_ok(bench: Any) -> bool:
    if not isinstance(bench, dict) or not isinstance(bench.get("workloads"), dict):
        return False
    return all(isinstance(rows, list) and all(isinstance(r, dict) and "concurrency" in r for r in rows)
               for rows in bench["workloads"].values())


def _read_baseline(raw: bytes, where: str, version: str | None) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return {"status": "corrupt", "source": where, "version": version,
                "detail": f"bundle.json is not JSON ({str(exc).splitlines()[0]})"}
    bench = doc.get("bench") if isinstance(doc, dict) else None
    if not _bench_rows_ok(bench):
        return {"status": "corrupt", "source": where, "version": version,
                "detail": "bundle.json has no bench results with per-level rows"}
    return {"status": "found", "source": where, "version": version, "detail": None, "bench": bench}


def previous_bench(ctx: Context) -> dict[str, Any]:
    """The regression baseline: the bench results of the previous bundle of the same model/quant/target/runtime, the
    ``latest`` one at ``publish.dest`` (what a scheduled rebuild on a fresh runner sees), else, when nothing is
    published there yet, the newest local bundle. ``{"status", "source", "version", "detail"}`` plus ``bench`` when
    found; ``status`` is ``found``, ``none`` (nothing published yet: an empty baseline), ``unreachable``
    (``publish.dest`` cannot be listed or read), ``corrupt`` (its ``bundle.json`` is unreadable or lacks bench
    rows), or ``disabled`` (``bench.gates.regression_pct`` is null)."""
    from pipeline.bundle import read_published

    cfg = ctx.cfg
    if cfg.bench.gates.regression_pct is None:
        return {"status": "disabled", "source": None, "version": None, "detail": None}
    dest = str(cfg.publish.dest)
    try:
        base, version, raw = read_published(cfg)
        if version is not None:
            return _read_baseline(raw, f"{base}/{version}", version)
    except Exception as exc:  # noqa: BLE001 - any failure to read the destination is reported, never a "pass"
        msg = (str(exc).splitlines() or [""])[0][:200]
        return {"status": "unreachable", "source": dest, "version": None,
                "detail": f"publish.dest={dest}: {type(exc).__name__}: {msg}"}
    label = ArtifactKey.of(ctx.cfg).label  # the publish stage's outputs carry the same label
    local = sorted(ctx.paths["bundles"].glob(f"{label}-publish-*/bundle.json"), key=lambda p: p.stat().st_mtime)
    if not local:
        return {"status": "none", "source": dest, "version": None, "detail": "no bundle published yet"}
    try:
        raw = local[-1].read_bytes()
    except OSError as exc:
        return {"status": "unreachable", "source": str(local[-1]), "version": None, "detail": str(exc)}
    return _read_baseline(raw, str(local[-1].parent), None)


# summary_row keys compared with the previous bundle: (key, label, a rise is the regression)
REGRESSION_METRICS = (("output_tokens_per_s", "output tokens/s", False), ("ttft_p95_ms", "TTFT p95", True),
                      ("itl_p95_ms", "inter-token latency p95", True), ("latency_p95_ms", "request latency p95", True))


def gates(cfg, result: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """Every check with its value, limit and outcome (``checks``), the breaches that fail the stage, the
    regressions against ``baseline`` (:func:`previous_bench`), and the verdict: ``fail``, ``no-baseline`` or
    ``pass``."""
    g = cfg.bench.gates
    checks: list[dict[str, Any]] = []
    breaches: list[str] = []
    limits = (("ttft_p95_ms", "TTFT p95", "time_to_first_token", "p95"),
              ("itl_p95_ms", "inter-token latency p95", "inter_token_latency", "p95"),
              ("request_latency_p95_ms", "request latency p95", "request_latency", "p95"))
    for wname, w in result["workloads"].items():
        for lv in w["levels"]:
            where = f"{wname} at concurrency {lv['concurrency']}"
            rate = lv["error_count"] / max(1, lv["request_count"])
            ok = rate <= g.max_error_rate
            checks.append({"check": "error rate", "where": where, "value": rate, "limit": g.max_error_rate,
                           "pass": ok})
            if not ok:
                breaches.append(f"{where}: error rate {rate:.1%} > {g.max_error_rate:.1%} ({lv['errors'][:1]})")
            for key, label, field, p in limits:
                limit, value = g[key], lv[field][p]
                if limit is None:
                    continue
                ok = value is not None and value <= limit
                checks.append({"check": label, "where": where, "value": value, "limit": limit, "pass": ok})
                if value is None:
                    breaches.append(f"{where}: {label} not measured (limit {limit} ms)")
                elif not ok:
                    breaches.append(f"{where}: {label} {value:.1f} ms > {limit} ms (+{100 * (value / limit - 1):.0f}%)")
            tps = lv["output_token_throughput"]["avg"]
            if g.min_output_tokens_per_s is not None:
                ok = tps >= g.min_output_tokens_per_s
                checks.append({"check": "output tokens/s", "where": where, "value": tps,
                               "limit": g.min_output_tokens_per_s, "pass": ok})
                if not ok:
                    breaches.append(f"{where}: output {tps:.1f} tokens/s < {g.min_output_tokens_per_s} "
                                    f"(-{100 * (1 - tps / g.min_output_tokens_per_s):.0f}%)")
    compared, regressions = 0, []
    previous = baseline.get("bench") if baseline.get("status") == "found" else None
    if previous and g.regression_pct is not None:
        for wname, rows in (previous.get("workloads") or {}).items():
            cur = {lv["concurrency"]: summary_row(lv) for lv in result["workloads"].get(wname, {}).get("levels", [])}
            for old in rows:
                new = cur.get(old["concurrency"])
                if not new:
                    continue
                compared += 1
                where = f"{wname} at concurrency {old['concurrency']}"
                for key, label, worse_if_higher in REGRESSION_METRICS:
                    o, n = old.get(key), new.get(key)
                    if not o or n is None:
                        continue
                    change = 100 * (n / o - 1)
                    ok = not ((change > g.regression_pct) if worse_if_higher else (-change > g.regression_pct))
                    checks.append({"check": f"regression: {label}", "where": where, "value": n, "previous": o,
                                   "change_pct": round(change, 2), "limit": g.regression_pct, "pass": ok})
                    if not ok:
                        regressions.append(f"{where}: {label} {n:.1f} vs {o:.1f} in the previous bundle "
                                           f"({change:+.0f}%, allowed {g.regression_pct:g}%)")
    gated = g.regression_pct is not None and (cfg.target.device.value == "cuda" or bool(g.regression_on_cpu))
    if gated:
        breaches += regressions
    unreadable = baseline.get("status") in ("unreachable", "corrupt")
    verdict = "fail" if breaches else "no-baseline" if gated and unreadable else "pass"
    return {"verdict": verdict, "checks": checks, "breaches": breaches, "regressions": regressions,
            "regressions_gated": gated, "compared_with_previous_levels": compared,
            "baseline": {k: baseline.get(k) for k in ("status", "source", "version", "detail")}}


def baseline_line(g: dict[str, Any]) -> str:
    """One line on the regression baseline, for bench.md and the build summary."""
    b = g.get("baseline") or {}
    st = b.get("status")
    if st == "found":
        levels = g.get("compared_with_previous_levels", 0)
        return (f"Regression baseline: {b.get('version') or b.get('source')} ({levels} levels compared"
                f"{'' if g.get('regressions_gated') else '; reported only'}).")
    if st == "none":
        return "Regression baseline: none (no bundle published yet); nothing compared."
    if st == "disabled":
        return "Regression baseline: not compared (bench.gates.regression_pct is null)."
    what = "unreachable" if st == "unreachable" else "unreadable"
    return f"Regression baseline: **{what}**: {b.get('detail')}; nothing compared."


def markdown(model: str, r: dict[str, Any]) -> str:
    g = r["gates"]
    lines = [f"# bench: {model}", "", f"Entry point `{r['model']}` ({r.get('layout')} layout), launcher "
             f"{r['launcher']}, server start {r.get('server_start_s')} s. Gate: **{g['verdict']}**", "",
             baseline_line(g), "", f"Counting: {r.get('counting', COUNTING)}."]
    if g["breaches"]:
        lines.append("")
    lines += [f"- {b}" for b in g["breaches"]]
    if g.get("regressions") and not g.get("regressions_gated"):
        lines += ["", "Slower than the previous bundle (reported only: on target=cpu, set "
                  "bench.gates.regression_on_cpu=true to fail on it):", ""]
        lines += [f"- {x}" for x in g["regressions"]]
    if r["answers"]:
        lines += ["", "| answer check | expected | output | result |", "|---|---|---|---|"]
        for a in r["answers"]:
            out = (a["error"] or a["text"]).replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {a['prompt']} | {', '.join(a['expect'])} | {out} | {'pass' if a['pass'] else 'FAIL'} |")
    for wname, w in r["workloads"].items():
        lines += ["", f"## {wname}: ~{w['prompt_words']} prompt words, {w['max_tokens']} output tokens", "",
                  "| concurrency | requests | errors | TTFT p50/p95/p99 ms | ITL p50/p95/p99 ms | "
                  "latency p50/p95/p99 ms | output tok/s | req/s |", "|---|---|---|---|---|---|---|---|"]
        for lv in w["levels"]:
            def f(key):
                return "/".join("-" if lv[key][p] is None else f"{lv[key][p]:.1f}" for p in ("p50", "p95", "p99"))
            lines.append(f"| {lv['concurrency']} | {lv['request_count']} | {lv['error_count']} | "
                         f"{f('time_to_first_token')} | {f('inter_token_latency')} | {f('request_latency')} | "
                         f"{lv['output_token_throughput']['avg']:.1f} | {lv['request_throughput']['avg']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    """Latency (p50/p95) and output throughput against concurrency, one row per workload."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, so any thread may draw

    names = list(r["workloads"])
    fig = Figure(figsize=(10, 3.2 * len(names)))
    axes = fig.subplots(len(names), 2, squeeze=False)
    for row, name in enumerate(names):
        levels = r["workloads"][name]["levels"]
        conc = [lv["concurrency"] for lv in levels]
        ax = axes[row][0]
        for key, label in (("time_to_first_token", "TTFT"), ("request_latency", "request latency")):
            for p, style in (("p50", "-o"), ("p95", "--o")):
                ax.plot(conc, [lv[key][p] or 0 for lv in levels], style, label=f"{label} {p}")
        ax.set(title=f"{name}: latency", xlabel="concurrency", ylabel="ms", xscale="log")
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.minorticks_off()
        ax.legend(fontsize=7)
        ax = axes[row][1]
        ax.plot(conc, [lv["output_token_throughput"]["avg"] for lv in levels], "-o")
        ax.set(title=f"{name}: output throughput", xlabel="concurrency", ylabel="tokens/s", xscale="log")
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.minorticks_off()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def env_check(cfg) -> list[str]:
    """Before any work starts: the entry point must exist in the layout the package stage will write, and the
    server binary must exist here (serve.launcher=local)."""
    problems = []
    lay = _layout_of(cfg)
    if lay is not None:
        try:
            choose_entry(cfg.bench.model.value, lay)
        except UserError as exc:
            problems.append(str(exc))
    if cfg.serve.launcher.value == "local":
        try:
            srv.find_server(cfg.serve.server_bin)
        except UserError as exc:
            problems.append(str(exc))
    return problems


STAGE = Stage(
    env_check=env_check,
    volatile=("bench.json", "bench.md", "bench.png", "server.log", "requests.jsonl"),
    name="bench",
    run=run,
    reads=("bench", "model.name", "model.checks", "model.chat_template", "quant.format", "quant.kv_cache",
           "target.name", "target.device", "runtime.name", "serve.host", "serve.server_bin",
           "serve.startup_timeout_s", "serve.launcher", "serve.image", "serve.url", "serve.repo_mount"),
    unhashed_reads=("publish.dest",),  # the regression baseline: the bundle published there (bench.json, volatile)
    inputs=("package",),
    libs=("tritonclient", "nvidia-pytriton", "transformers"),
    root="store",
    label=lambda cfg: ArtifactKey.of(cfg).label,
)
