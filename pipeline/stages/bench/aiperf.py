"""aiperf's export of each measured level, which ``aiperf plot`` reads."""
from __future__ import annotations

import datetime as _dt
import json
import time
from pathlib import Path
from typing import Any

from pipeline.stages.bench.load import COUNTING

AIPERF_SCHEMA_VERSION = "1.4"  # aiperf 0.13 JsonExportData.SCHEMA_VERSION


def _request_body(entry, max_tokens: int) -> str:
    """The request the generator sent, as the JSON body of Triton's HTTP generate extension (a Jinja2 template)."""
    from pipeline.triton import layouts

    lay = layouts.get(entry.layout)
    text, max_name, stream = lay.text_tensors
    exclude = f', "{lay.exclude_input}": true' if entry.exclude_input else ""
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
    from pipeline.triton import client, layouts

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
                                      "response_field": layouts.get(entry.layout).output}},
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
