"""The load generator's own ceiling: the bench client against a trivial streaming Triton model, side by side.

    python -m benchmarks bench_overhead [--requests 2000] [--tokens 4] [--concurrency 1,8,32,64]

A decoupled python model answers every request at once with ``--tokens`` one-token responses and a final flag, so
what is measured is the generator (tritonclient gRPC streams, one per worker thread), the loopback network and
Triton's own path, not a model. Target: >= 500 streaming requests/s on 2 cores, client overhead < 1 ms at p50.
The request latency at concurrency 1 is an upper bound of the overhead the client adds to each request.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks._provenance import commit_label

TITLE = "Load-generator ceiling"

CONFIG = """name: "echo"
backend: "python"
max_batch_size: 8
model_transaction_policy { decoupled: true }
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] },
        { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
MODEL = """import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "max_tokens").as_numpy().reshape(-1)[0])
            sender = request.get_response_sender()
            for i in range(n):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.array([[b"x"]], dtype=object))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--concurrency", default="1,8,32,64")


def run(args) -> dict:
    from pipeline.triton import client, server

    rows = []
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        repo = Path(tmp) / "repo" / "echo"
        (repo / "1").mkdir(parents=True)
        (repo / "config.pbtxt").write_text(CONFIG)
        (repo / "1" / "model.py").write_text(MODEL)
        with server.local_server(repo.parent, host="127.0.0.1", server_bin=None, work_dir=Path(tmp) / "w",
                                 timeout_s=120) as s:
            prompts = ["hello"] * args.requests
            echo = client.entry_point(s.grpc_url, "echo", "inflight_batcher_llm")
            client.run_level(s.grpc_url, echo, prompts, list(range(200)), 8, args.tokens, 30)  # warm-up
            for conc in (int(c) for c in args.concurrency.split(",")):
                n = args.requests if conc > 1 else min(args.requests, 1000)
                records, wall = client.run_level(s.grpc_url, echo, prompts, list(range(n)), conc, args.tokens, 30)
                for r in records:  # the echo model streams one one-character token per response
                    r.output_tokens = len(r.chunk_times)
                summ = client.summarize(records, wall)
                lat = summ["request_latency"]
                rows.append({"concurrency": conc, "requests": n, "errors": summ["error_count"],
                             "requests_per_s": summ["request_throughput"]["avg"],
                             "responses_per_s": summ["request_throughput"]["avg"] * args.tokens,
                             "latency_ms": {q: lat[q] for q in ("p50", "p95", "p99")},
                             "ttft_p50_ms": summ["time_to_first_token"]["p50"]})
                print(f"c={conc}: {rows[-1]['requests_per_s']:.0f} req/s, p50 {lat['p50']:.2f} ms, errors "
                      f"{rows[-1]['errors']}", file=sys.stderr)
    return {"tokens": args.tokens, "levels": rows}


def render(record: dict) -> list[str]:
    tokens, rows = record["tokens"], record["levels"]
    lines = [f"{record['date'][:10]} · commit {commit_label(record)} · {record['machine']} · trivial decoupled python "
             f"model, {tokens} streamed responses per request, real tritonserver (nvidia-pytriton) on loopback; the "
             f"server shares the same cores", "",
             "| concurrency | requests | errors | requests/s | streamed responses/s | request latency p50 / p95 / p99 (ms) "
             "| TTFT p50 (ms) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lat = r["latency_ms"]
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['errors']} | {r['requests_per_s']:.0f} | "
                     f"{r.get('responses_per_s', r['requests_per_s'] * tokens):.0f} | {lat['p50']:.2f} / {lat['p95']:.2f} / {lat['p99']:.2f} | "
                     f"{r['ttft_p50_ms']:.2f} |")
    best = max(r["requests_per_s"] for r in rows)
    c1 = rows[0]["latency_ms"]["p50"]
    lines += ["", f"Ceiling: {best:.0f} streaming requests/s (target ≥ 500: {'met' if best >= 500 else 'NOT met'}). "
                  f"Round trip at concurrency {rows[0]['concurrency']}: {c1:.2f} ms at p50, an upper bound of the "
                  f"client's added latency (target < 1 ms: {'met' if c1 < 1 else 'NOT met'})."]
    return lines
