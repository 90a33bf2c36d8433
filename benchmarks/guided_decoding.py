"""What guided decoding costs: the same chat requests with a ``json_schema`` response format and without, side by side
in one run, through the OpenAI front end, on the tiny model on the reference runtime.

    python -m benchmarks guided_decoding [--repo TRITON_REPO] [--requests 4] [--rounds 10] [--max-tokens 160]

Without ``--repo`` the tiny-qwen3 build is made first (until the package stage) in a temporary root. One Triton
server serves the repository and the front end runs in a process of its own (``python -m pipeline.serving``), as
``pipeline serve`` deploys it. At each concurrency (1 and 8), rounds alternate plain requests and guided ones (the
same prompts, streamed chat, greedy; guided: ``response_format`` of type ``json_schema`` with :data:`SCHEMA`, so the
model's XGrammar matcher masks every step), each round ``--requests`` requests per concurrent worker. Output tokens
are the engine's own count (``usage.completion_tokens`` of the stream, ``stream_options.include_usage``): re-tokenizing
the returned text would undercount the guided answers, whose runs of whitespace tokens re-tokenize into fewer.
Reported: TTFT and inter-token latency (ITL) p50 of
both, their ratio (with a 95 % bootstrap interval over rounds), the guided answers that parse and validate against
the schema, and what compiling the schema cost: in the front end (its guide cache: the first compile, then a cached
lookup, also for a larger schema) and served (the TTFT of the run's first guided request, for which the front end
imports XGrammar, checks and compiles the schema and the model compiles it, against the later ones). Target: a guided token costs at most 10 % more ITL than an unguided one
(ratio of the ITL p50 ≤ 1.10) on the reference runtime. The raw per-request records are kept.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._provenance import commit_label

TITLE = "Guided decoding (json_schema) vs unguided"
TARGET = 1.10  # ITL p50, guided / unguided

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice", "Lille"]},
    "population": {"type": "integer", "minimum": 0, "maximum": 99999},
    "capital": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}},
    "required": ["city", "population", "capital", "tags"], "additionalProperties": False}
# a larger schema for the compile-time figure: the kind a tool-using application sends (nested objects, $defs)
LARGE = {"type": "object", "$defs": {"Address": {"type": "object", "properties": {
    "street": {"type": "string", "maxLength": 40}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    "country": {"type": "string", "enum": ["FR", "DE", "IT", "ES"]}},
    "required": ["street", "zip", "country"], "additionalProperties": False}},
    "properties": {"name": {"type": "string", "maxLength": 30}, "email": {"type": "string", "format": "email"},
                   "born": {"type": "string", "format": "date"}, "home": {"$ref": "#/$defs/Address"},
                   "work": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]},
                   "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1},
                              "minItems": 1, "maxItems": 8}},
    "required": ["name", "email", "born", "home", "work", "scores"], "additionalProperties": False}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repo", type=Path, help="a packaged inflight_batcher_llm repository (default: build tiny)")
    ap.add_argument("--requests", type=int, default=4, help="requests per round, kind and concurrent worker")
    ap.add_argument("--rounds", type=int, default=10, help="alternating rounds per level (each kind once a round)")
    ap.add_argument("--max-tokens", type=int, default=160,
                    help="enough for the schema's answers to close (the grammar allows whitespace between tokens)")
    ap.add_argument("--concurrency", default="1,8")


def _compile_times(served) -> dict:
    """The front end's guide cache on this model: the first compile of each schema, then a cached lookup (median of
    100), in ms."""
    from pipeline.serving import protocol as P
    from pipeline.serving.guide import Guides

    out = {}
    guides = Guides(served)
    guides.grammars()  # the tokenizer's info, built once per model (reported apart)
    for name, schema in (("bench", SCHEMA), ("large", LARGE)):
        rf = P.ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
        t = time.perf_counter()
        guides.response_format(rf)
        first = time.perf_counter() - t
        hits = []
        for _ in range(100):
            t = time.perf_counter()
            guides.response_format(rf)
            hits.append(time.perf_counter() - t)
        out[name] = {"first_ms": round(1e3 * first, 3), "xgrammar_compile_ms": round(1e3 * guides.last_compile_s, 3),
                     "cached_ms": round(1e3 * statistics.median(hits), 4)}
    t = time.perf_counter()
    Guides(served).grammars()
    out["tokenizer_info_ms"] = round(1e3 * (time.perf_counter() - t), 3)
    return out


def _ratio_interval(plain: list[list], guided: list[list]) -> list[float] | None:
    """95 % bootstrap interval of ITL p50 guided / plain, resampling rounds (a guided round with the plain one beside
    it)."""
    import numpy as np
    from scipy.stats import bootstrap

    def itls(rounds, idx):
        return np.concatenate([np.array([1e3 * r.itl for r in rounds[i] if r.error is None and r.itl is not None])
                               for i in idx])

    if len(plain) < 2:
        return None
    res = bootstrap((np.arange(len(plain)),),
                    lambda idx: np.percentile(itls(guided, idx.astype(int)), 50)
                    / np.percentile(itls(plain, idx.astype(int)), 50),
                    vectorized=False, n_resamples=2000, confidence_level=0.95, method="percentile",
                    random_state=np.random.default_rng(0))
    return [float(res.confidence_interval.low), float(res.confidence_interval.high)]


def run(args) -> dict:
    import jsonschema
    from transformers import AutoTokenizer

    from benchmarks.openai_overhead import _build
    from pipeline.config import compose
    from pipeline.serving import model as served_model, run as front
    from pipeline.stages.bench import openai_client as oa_client, triton_client as client
    from pipeline.triton import server

    load_before = os.getloadavg()
    prompts = [f"Question {i}: describe the French city number {i * 13} in a few words." for i in range(32)]
    usage = {"stream_options": {"include_usage": True}}
    guided_body = {**usage,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}}
    levels = []
    with tempfile.TemporaryDirectory(prefix="guided-decoding-") as tmp:
        tmp = Path(tmp)
        repo = args.repo.resolve() if args.repo else _build(tmp, "auto")
        served = served_model.load(repo)
        tok = AutoTokenizer.from_pretrained(str(served.tokenizer_dir))
        compile_ms = _compile_times(served)
        settings = front.write_settings(compose([]).serve.openai, tmp / "front.json", port=0, model_name=served.name)
        with server.local_server(repo, host="127.0.0.1", server_bin=None, work_dir=tmp / "w", timeout_s=600) as s, \
                front.child(repo, s.grpc_url, settings, tmp / "front.log") as url:
            plain_warm, _ = oa_client.run_level(url, served.name, prompts, [0, 1], 1, args.max_tokens, 120)
            # the first guided request of the run: the server compiles the schema (later ones find it compiled)
            first, _ = oa_client.run_level(url, served.name, prompts, [2], 1, args.max_tokens, 120,
                                           extra=guided_body)
            later, _ = oa_client.run_level(url, served.name, prompts, [2, 2, 2], 1, args.max_tokens, 120,
                                           extra=guided_body)
            server_compile = {"first_guided_ttft_ms": round(1e3 * first[0].ttft, 3),
                              "later_guided_ttft_p50_ms": round(1e3 * statistics.median(r.ttft for r in later), 3)}
            for conc in (int(c) for c in args.concurrency.split(",")):
                got = {"plain": ([], []), "guided": ([], [])}
                for rnd in range(args.rounds):
                    n = args.requests * conc
                    order = [(rnd * n + k) % len(prompts) for k in range(n)]
                    for kind in (("plain", "guided") if rnd % 2 == 0 else ("guided", "plain")):
                        recs, wall = oa_client.run_level(url, served.name, prompts, order, conc, args.max_tokens,
                                                         120, extra=guided_body if kind == "guided" else usage)
                        for r in recs:
                            r.output_tokens = r.usage_tokens
                        got[kind][0].append(recs)
                        got[kind][1].append(wall)
                summary = {k: client.summarize([r for rs in got[k][0] for r in rs], sum(got[k][1])) for k in got}
                valid = 0
                guided_recs = [r for rs in got["guided"][0] for r in rs if r.error is None]
                closed = [r for r in guided_recs if (r.usage_tokens or 0) < args.max_tokens]  # not cut by max_tokens
                for r in closed:
                    try:
                        jsonschema.validate(json.loads(r.text), SCHEMA)
                        valid += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
                itl_p, itl_g = (summary[k]["inter_token_latency"]["p50"] for k in ("plain", "guided"))
                ttft_p, ttft_g = (summary[k]["time_to_first_token"]["p50"] for k in ("plain", "guided"))
                level = {"concurrency": conc, "summary": summary,
                         "itl_p50_ratio": itl_g / itl_p, "itl_p50_ratio_interval_95":
                             _ratio_interval(got["plain"][0], got["guided"][0]),
                         "ttft_p50_ms_added": ttft_g - ttft_p, "target_met": itl_g / itl_p <= TARGET,
                         "guided_valid": valid, "guided_answers": len(guided_recs), "guided_closed": len(closed),
                         "requests": {k: [r.as_dict() | {"round": i} for i, rs in enumerate(got[k][0]) for r in rs]
                                      for k in got}}
                for k in level["requests"]:
                    for d in level["requests"][k]:
                        d.pop("inter_chunk_latencies_ms", None)
                levels.append(level)
                print(f"c={conc}: ITL p50 {itl_p:.2f} / {itl_g:.2f} ms ({itl_g / itl_p:.3f}x), TTFT p50 "
                      f"{ttft_p:.2f} / {ttft_g:.2f} ms, guided valid {valid} of {len(closed)} closed "
                      f"({len(guided_recs)} answers)", file=sys.stderr)
    load_after = os.getloadavg()
    return {"model": "tiny-qwen3 (reference runtime)", "schema": SCHEMA, "max_tokens": args.max_tokens,
            "requests_per_round_per_worker": args.requests, "rounds": args.rounds, "prompts": len(prompts),
            "endpoint": "/v1/chat/completions (stream)", "front_end_compile": compile_ms,
            "server_compile": server_compile, "load_avg_before": [round(x, 2) for x in load_before],
            "load_avg_after": [round(x, 2) for x in load_after], "levels": levels,
            "all_targets_met": all(lv["target_met"] for lv in levels)}


def render(record: dict) -> list[str]:
    fc, sc = record["front_end_compile"], record["server_compile"]
    lines = [f"{record['date'][:16].replace('T', ' ')} UTC · commit {commit_label(record)} · {record['machine']} · "
             f"{record['model']} on a real tritonserver, the front end in its own process; "
             f"{record['rounds']} alternating rounds per level of {record['requests_per_round_per_worker']} requests "
             f"per kind and concurrent worker, {record['max_tokens']} tokens max, greedy, streamed chat, the same "
             f"prompts; guided: `response_format` json_schema (a city: an enum, a bounded integer, a boolean, up to "
             f"4 short strings). Load average (1 min) {record['load_avg_before'][0]:.2f} → "
             f"{record['load_avg_after'][0]:.2f}.", "",
             "| concurrency | requests | TTFT p50 (ms) | ITL p50 (ms) | output tokens/s | guided answers: valid / "
             "closed by the grammar / all | errors |", "|---|---|---|---|---|---|---|"]
    for lv in record["levels"]:
        for kind in ("plain", "guided"):
            sm = lv["summary"][kind]
            valid = (f"{lv['guided_valid']} / {lv['guided_closed']} / {lv['guided_answers']}" if kind == "guided"
                     else "—")
            lines.append(f"| {lv['concurrency']} | {kind} | {sm['time_to_first_token']['p50']:.2f} | "
                         f"{sm['inter_token_latency']['p50']:.2f} | {sm['output_token_throughput']['avg']:.1f} | "
                         f"{valid} | {sm['error_count']} |")
    lines.append("")
    lines.append(f"An answer the grammar did not close within {record['max_tokens']} tokens was cut inside a run of "
                 f"whitespace (XGrammar's JSON grammar, as TensorRT-LLM compiles a json_schema guide, allows any between "
                 f"tokens, and the random model often picks it): as with OpenAI's JSON mode, such an answer "
                 f"(`finish_reason: \"length\"`) may be incomplete. "
                 + ("Every answer the grammar closed validates against the schema."
                    if all(lv["guided_valid"] == lv["guided_closed"] for lv in record["levels"])
                    else "NOT every answer the grammar closed validates: see the raw records."))
    lines.append("")
    for lv in record["levels"]:
        iv = lv.get("itl_p50_ratio_interval_95")
        within = f", 95 % interval {iv[0]:.3f} to {iv[1]:.3f}" if iv else ""
        lines.append(f"- concurrency {lv['concurrency']}: a guided token's ITL p50 is {lv['itl_p50_ratio']:.3f}× an "
                     f"unguided one's{within} (target ≤ {TARGET:.2f}×: {'met' if lv['target_met'] else 'NOT met'}); "
                     f"TTFT p50 {lv['ttft_p50_ms_added']:+.2f} ms.")
    lines.append(f"- Compiling a schema, in the front end (XGrammar 0.1.25; the guide cache keeps it): the benchmark's "
                 f"schema {fc['bench']['first_ms']:.2f} ms the first time (XGrammar's compile "
                 f"{fc['bench']['xgrammar_compile_ms']:.2f} ms), {1e3 * fc['bench']['cached_ms']:.0f} µs cached; a "
                 f"larger one (nested objects, $defs, formats, a pattern) {fc['large']['first_ms']:.2f} ms, then "
                 f"{1e3 * fc['large']['cached_ms']:.0f} µs; the tokenizer's info, once per model, "
                 f"{fc['tokenizer_info_ms']:.1f} ms. Served, the first guided request's TTFT "
                 f"{sc['first_guided_ttft_ms']:.2f} ms against {sc['later_guided_ttft_p50_ms']:.2f} ms for later ones: "
                 f"the front end imports XGrammar and jsonschema on its first guide, checks and compiles the schema, "
                 f"and the model compiles it too.")
    return lines
