"""Where the OpenAI front end's added time to first token goes: one request at a time, each hop timed from
monotonic timestamps in the client and in the front end (``benchmarks/_hops_front.py``), beside a direct gRPC
request to the same Triton after each one; then bursts of 8 requests sent at once, timed from the first one's
arrival to the last one handed to gRPC.

    python -m benchmarks openai_hops [--repo TRITON_REPO] [--requests 100] [--bursts 30] [--max-tokens 32]

Without ``--repo`` the tiny-qwen3 build is made first (as ``openai_overhead`` does). A diagnostic: the front end
runs with a few of uvicorn's and its own functions wrapped, which costs a little time of its own; the overhead
figures that count are ``openai_overhead``'s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._instrument import REPO
from benchmarks._provenance import commit_label
from benchmarks.openai_overhead import _build

TITLE = "OpenAI front end, hop by hop"

HOPS = [("post→recv", "client sends → front end parses the request's first bytes"),
        ("recv→parsed", "HTTP parse, routing, body read, JSON and schema validation"),
        ("parsed→jobs", "the request's jobs (prompt, budget)"),
        ("jobs→submit", "the driver's request built and handed to a gRPC stream"),
        ("submit→resp", "Triton's first response back at the front end"),
        ("resp→chunk", "the first text chunk written to the client"),
        ("chunk→client", "the client reads it")]


def _front(repo: Path, grpc_url: str, marks: Path, log: Path):
    """The traced front end in a process of its own under the Triton server's supervisor; its URL once it listens."""
    from pipeline.triton.server import supervised

    cmd = supervised([sys.executable, "-m", "benchmarks._hops_front", str(repo), grpc_url,
                      "serve.openai.port=0", "serve.openai.model_name=m"])
    out = open(log, "w+b")
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                            env=dict(os.environ, HOPS_OUT=str(marks)), start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        out.seek(0)
        for line in out.read().decode(errors="replace").splitlines():
            if line.startswith("OpenAI "):
                return proc, line.split()[1]
        time.sleep(0.2)
    proc.kill()
    out.seek(0)
    raise SystemExit(f"the traced front end did not start:\n{out.read().decode(errors='replace')[-2000:]}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repo", type=Path, help="a packaged inflight_batcher_llm repository (default: build tiny)")
    ap.add_argument("--requests", type=int, default=100, help="one-at-a-time requests per path")
    ap.add_argument("--bursts", type=int, default=30, help="bursts of 8 requests sent at once")
    ap.add_argument("--max-tokens", type=int, default=32)


def run(args) -> dict:
    import aiohttp

    from pipeline.triton import client, server

    prompts = [f"Question {i}: write one sentence about the number {i * 13} and the colour of the sky."
               for i in range(64)]
    warm = 5
    with tempfile.TemporaryDirectory(prefix="openai-hops-") as tmp:
        tmp = Path(tmp)
        repo = args.repo.resolve() if args.repo else _build(tmp)
        marks_file = tmp / "marks.json"
        with server.local_server(repo, host="127.0.0.1", server_bin=None, work_dir=tmp / "w", timeout_s=600) as s:
            proc, url = _front(repo, s.grpc_url, marks_file, tmp / "front.log")
            try:
                entry = client.entry_point(s.grpc_url, "ensemble", "inflight_batcher_llm")
                worker = client.StreamWorker(s.grpc_url, entry, 120)

                async def one(session, i: int) -> tuple[int, int | None]:
                    body = {"model": "m", "prompt": prompts[i % 64], "max_tokens": args.max_tokens, "stream": True,
                            "temperature": 0}
                    t0, first = time.monotonic_ns(), None
                    async with session.post(f"{url}/completions", json=body) as r:
                        async for line in r.content:
                            if first is None and line.startswith(b"data: {") and b'"text":""' not in line:
                                first = time.monotonic_ns()
                    return t0, first

                async def run():
                    single, direct, bursts = [], [], []
                    async with aiohttp.ClientSession() as session:
                        for i in range(warm + args.requests):
                            single.append(await one(session, i))
                            direct.append(worker.request(i, prompts[i % 64], args.max_tokens).ttft)  # blocks: alone
                        for b in range(args.bursts + 1):  # the first opens the client's 8 connections: not counted
                            got = await asyncio.gather(*(one(session, b * 8 + k) for k in range(8)))
                            if b:
                                bursts.append(got)
                            await asyncio.sleep(0.05)
                    return single, direct, bursts

                try:
                    import uvloop
                    single, direct, bursts = uvloop.run(run())
                except ImportError:
                    single, direct, bursts = asyncio.run(run())
                worker.close()
            finally:
                os.killpg(proc.pid, signal.SIGTERM)  # the whole group: the front end writes its marks and ends
                proc.wait(30)
        marks = json.loads(marks_file.read_text())

    # one request at a time: each 'recv' starts the next request; the first mark of each kind after it is its own
    per: list[dict] = []
    for name, t in marks:
        if name == "recv":
            per.append({})
        if per and name not in per[-1]:
            per[-1][name] = t
    n_single = warm + args.requests
    rows = []
    for (t0, first), m in list(zip(single, per[:n_single]))[warm:]:
        stamps = {"post": t0, **m, "client": first}
        rows.append({hop: (stamps[hop.split("→")[1]] - stamps[hop.split("→")[0]]) / 1e3 for hop, _ in HOPS}
                    | {"ttft": (first - t0) / 1e3})
    hops = {hop: statistics.median(r[hop] for r in rows) for hop, _ in HOPS}
    ttft_oa = statistics.median(r["ttft"] for r in rows)
    ttft_direct = statistics.median(d * 1e6 for d in direct[warm:])
    # bursts: their requests interleave, so the k-th arrival and the k-th hand-off to gRPC are taken in order (each
    # request is handed over once)
    arrivals = [t for name, t in marks if name == "recv"][n_single + 8:]
    handoffs = [t for name, t in marks if name == "submit"][n_single + 8:]
    spreads = [(max(handoffs[8 * b: 8 * b + 8]) - min(arrivals[8 * b: 8 * b + 8])) / 1e3
               for b in range(args.bursts) if len(handoffs) >= 8 * b + 8 and len(arrivals) >= 8 * b + 8]
    spread = statistics.median(spreads) if spreads else None
    burst_ttft = statistics.median((f - t0) / 1e6 for burst in bursts for t0, f in burst if f is not None)

    return {"requests": args.requests, "bursts": args.bursts, "max_tokens": args.max_tokens,
            "hop_p50_us": hops, "ttft_p50_us": {"openai": ttft_oa, "direct_grpc": ttft_direct},
            "burst_admission_p50_us": spread, "burst_ttft_p50_ms": burst_ttft, "per_request_us": rows,
            "burst_admission_us": spreads}


def render(record: dict) -> list[str]:
    hops, spread, burst_ttft = record["hop_p50_us"], record["burst_admission_p50_us"], record["burst_ttft_p50_ms"]
    ttft_oa, ttft_direct = record["ttft_p50_us"]["openai"], record["ttft_p50_us"]["direct_grpc"]
    lines = [f"{record['date'][:16].replace('T', ' ')} UTC · commit {commit_label(record)} · {record['machine']} · "
             f"tiny-qwen3 (reference runtime) on a real tritonserver, the front end (with its hops timed) in its own "
             f"process. {record['requests']} streamed `/v1/completions` one at a time, each followed by the same "
             f"prompt to `ensemble` over gRPC; then {record['bursts']} bursts of 8 sent at once. "
             f"{record['max_tokens']} tokens max, greedy. p50 of each hop:", "",
             "| hop | what | p50 (µs) |", "|---|---|---|"]
    lines += [f"| {hop} | {what} | {hops[hop]:.0f} |" for hop, what in HOPS]
    lines += ["", f"- TTFT p50: OpenAI {ttft_oa / 1e3:.2f} ms, direct gRPC {ttft_direct / 1e3:.2f} ms "
                  f"({(ttft_oa - ttft_direct) / 1e3:+.2f} ms; the traced front end pays for its own timestamps).",
              f"- Bursts of 8: the last request handed to gRPC {spread / 1e3:.2f} ms (p50) after the first one's "
              f"bytes arrived; their TTFT p50 {burst_ttft:.2f} ms." if spread is not None else
              "- Bursts of 8: no complete burst in the marks."]
    return lines
