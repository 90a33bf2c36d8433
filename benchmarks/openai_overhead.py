"""The OpenAI front end's overhead: the same requests, side by side in one run, through the OpenAI endpoint and
directly to Triton over gRPC, on the tiny model (so the model's own compute is small).

    python -m benchmarks openai_overhead [--repo TRITON_REPO] [--requests 24] [--rounds 20] [--max-tokens 32]

Without ``--repo`` the tiny-qwen3 build is made first (until the package stage) in a temporary root. One Triton
server serves the repository; the front end runs in a process of its own (``python -m pipeline.serving``), as
``pipeline serve`` deploys it. At each concurrency (1 and 8), rounds alternate direct gRPC (``ensemble`` over
tritonclient gRPC streams: the bench's own generator) and OpenAI (``/v1/completions``, streamed, the same prompt
text, greedy on both paths), so drift on the shared 2 cores hits both alike. A round holds ``--requests`` requests
per concurrent worker (24 at concurrency 1, 192 at 8), so a level's figures are mostly those of its steady state:
each round's opening burst (its first ``concurrency`` requests, sent at once to an idle server) is a small share
of them, and its figures are reported apart (opening vs the rest). Output tokens are counted from each
returned text with the model's tokenizer on both paths. The first token of some prompts holds only part of a
character (the random tiny model, a byte-level vocabulary): a streamed OpenAI answer holds it back until the
character is whole, the direct path answers with the fragment, so TTFT and ITL are compared on the other prompts'
requests (found once per prompt by a one-token request through the ensemble) and also reported over all prompts.
Targets: TTFT p50 within 2 ms or 5 % (whichever is larger)
of the direct path, inter-token latency p50 within 5 %, output tokens/s at least 0.95x the direct path. Each
figure comes with a 95 % bootstrap interval over rounds (scipy's ``bootstrap``; a round and the direct round beside
it are drawn together), so run-to-run noise on a shared machine is on the page beside the verdict.
Each path's CPU time is recorded by process (the Triton server with its python stubs, the front end, this process's
load generators) per output token, with the load average before and after. The page keeps one current record per
machine size (CPU count).
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._provenance import commit_label

TITLE = "OpenAI front end vs direct gRPC"

TINY = ["model=tiny-qwen3", "quant.gate=warn", "until=package"]


def _build(root: Path, dtype: str) -> Path:
    proc = subprocess.run([sys.executable, "-m", "pipeline", "build", *TINY, f"runtime.dtype={dtype}",
                           f"paths.root={root}"], cwd=root, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"tiny build failed:\n{proc.stderr[-3000:]}")
    return next(root.glob("triton_repo/*-package-*/manifest.json")).parent


def _session_cpu_s(sid: int | None) -> float:
    """User + system CPU seconds of every live process in session ``sid`` (a server and its python stubs)."""
    import psutil

    total = 0.0
    if sid is None:
        return total
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                t = p.cpu_times()
                total += t.user + t.system
        except (psutil.Error, OSError):
            pass
    return total


def _listener_session(url: str) -> int | None:
    """The session of the process listening on ``url``'s port (the front end runs in a session of its own)."""
    import psutil

    port = int(url.rsplit(":", 1)[1].split("/")[0])
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
            return os.getsid(c.pid)
    return None


def _self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _paired(got: dict) -> dict:
    """Each round's OpenAI figures against the direct round run next to it (the same prompts, back to back), and
    their medians: a view that a burst of load from elsewhere, which hits a few rounds, moves less than the pooled
    figures."""
    import statistics

    from pipeline.stages.bench import triton_client as client

    rounds = []
    for (g_recs, o_recs), (g_wall, o_wall) in zip(zip(got["grpc"][0], got["openai"][0]),
                                                   zip(got["grpc"][1], got["openai"][1])):
        g, o = client.summarize(g_recs, g_wall), client.summarize(o_recs, o_wall)
        try:
            rounds.append({"ttft_p50_ms_added": o["time_to_first_token"]["p50"] - g["time_to_first_token"]["p50"],
                           "itl_p50_ratio": o["inter_token_latency"]["p50"] / g["inter_token_latency"]["p50"],
                           "throughput_ratio": o["output_token_throughput"]["avg"] / g["output_token_throughput"]["avg"]})
        except (TypeError, ZeroDivisionError):  # a round without figures (every request failed)
            continue
    return {"rounds": rounds, "median": {k: statistics.median(r[k] for r in rounds) for k in
                                         ("ttft_p50_ms_added", "itl_p50_ratio", "throughput_ratio")} if rounds else {}}


def _intervals(got: dict) -> dict:
    """95 % bootstrap intervals of the three target figures (pooled over rounds, as the targets are), resampling
    whole rounds: a round of each path is drawn with the direct round it ran beside, so load that hit a few rounds
    widens the interval instead of hiding in one number."""
    import numpy as np
    from scipy.stats import bootstrap

    def per_round(path):
        out = []
        for recs, wall in zip(*got[path]):
            ok = [r for r in recs if r.error is None]
            out.append((np.array([1e3 * r.ttft for r in ok if r.ttft is not None]),
                        np.array([1e3 * r.itl for r in ok if r.itl is not None]),
                        sum(r.output_tokens or 0 for r in ok), wall))
        return out

    g, o = per_round("grpc"), per_round("openai")
    if len(g) < 2:
        return {}

    def pooled(rounds, idx, k):
        return np.percentile(np.concatenate([rounds[i][k] for i in idx]), 50)

    def tps(rounds, idx):
        return sum(rounds[i][2] for i in idx) / sum(rounds[i][3] for i in idx)

    figures = {"ttft_p50_ms_added": lambda idx: pooled(o, idx, 0) - pooled(g, idx, 0),
               "itl_p50_ratio": lambda idx: pooled(o, idx, 1) / pooled(g, idx, 1),
               "throughput_ratio": lambda idx: tps(o, idx) / tps(g, idx)}
    out = {}
    for name, fn in figures.items():
        res = bootstrap((np.arange(len(g)),), lambda idx: fn(idx.astype(int)), vectorized=False,
                        n_resamples=2000, confidence_level=0.95, method="percentile",
                        random_state=np.random.default_rng(0))
        out[name] = [float(res.confidence_interval.low), float(res.confidence_interval.high)]
    return out


def _opening(got: dict, concurrency: int) -> dict:
    """Per path: TTFT p50 of each round's opening requests (its first ``concurrency``, sent at once) and of the rest
    (each sent as an earlier one ended), where the added time to first token sits; for the opening ones also how
    far apart their load generator sent them (p50 over rounds of last send - first send) and their first token's
    time from the round's first send (p50): a request its generator sends later waits less from its own send."""
    import numpy as np

    def p50(xs):
        return float(np.percentile(xs, 50)) if xs else None

    out = {}
    for path, (rounds, _) in got.items():
        first, rest, spread, from_start = [], [], [], []
        for recs in rounds:
            ok = sorted((r for r in recs if r.error is None and r.ttft is not None), key=lambda r: r.sent)
            first += [1e3 * r.ttft for r in ok[:concurrency]]
            rest += [1e3 * r.ttft for r in ok[concurrency:]]
            if len(ok) >= concurrency:
                t0 = ok[0].sent
                spread.append(1e3 * (ok[concurrency - 1].sent - t0))
                from_start += [1e3 * (r.first - t0) for r in ok[:concurrency]]
        out[path] = {"opening_ttft_p50_ms": p50(first), "rest_ttft_p50_ms": p50(rest),
                     "opening_send_spread_p50_ms": p50(spread), "opening_first_token_from_start_p50_ms": p50(from_start)}
    return out


def _whole_first_token(url: str, entry, prompts: list[str]) -> list[int]:
    """The prompts whose first generated token is a whole character: each prompt once, one token, through the
    ensemble, whose ``postprocessing`` decodes that token alone with the model's tokenizer; a U+FFFD in the answer is
    a token that holds only part of a character's UTF-8 bytes (greedy decoding: every round generates the same one).
    A streamed OpenAI answer holds such a token back until its character is whole (docs/serving.md, *Streamed
    text*), so its first chunk is a later token's, while the direct path's first response is the fragment itself."""
    from pipeline.stages.bench import triton_client as client

    recs, _ = client.run_level(url, entry, prompts, list(range(len(prompts))), 1, 1, 120)
    return sorted(r.prompt_index for r in recs if r.error is None and r.text and "\ufffd" not in r.text)


def _like_for_like(got: dict, whole: list[int]) -> dict:
    """TTFT and ITL of both paths over the requests of the prompts in ``whole`` only (their 95 % intervals too):
    there the first chunk of both paths carries the same first token."""
    keep = set(whole)
    sub = {p: ([[r for r in rs if r.prompt_index in keep] for rs in recs], walls) for p, (recs, walls) in got.items()}
    if not keep:
        return {"prompts": [], "summary": {}, "interval_95": {}}
    summary = {p: {k: v for k, v in _pooled(*sub[p]).items() if k in ("time_to_first_token", "inter_token_latency")}
               | {"requests": sum(len(rs) for rs in sub[p][0])} for p in sub}
    # a round with none of these prompts on a path (short rounds) leaves nothing to resample
    iv = _intervals(sub) if all(rs for p in sub for rs in sub[p][0]) else {}
    return {"prompts": whole, "summary": summary,
            "interval_95": {k: v for k, v in iv.items() if k in ("ttft_p50_ms_added", "itl_p50_ratio")}}


def _raw(rec, rnd: int, t0: float) -> dict:
    """One request as the raw data keeps it: what every figure here is computed from (its chunk gaps are left out:
    no figure uses them, and a level of 192-request rounds would hold a quarter of a million), its round, worker,
    and its send and first token from the round's first send ``t0`` (ms)."""
    d = rec.as_dict()
    d.pop("inter_chunk_latencies_ms", None)
    return d | {"round": rnd, "worker": rec.worker, "sent_ms": round(1e3 * (rec.sent - t0), 3),
                "first_ms": None if rec.first is None else round(1e3 * (rec.first - t0), 3)}


def _pooled(records_by_round: list[list], walls: list[float]) -> dict:
    from pipeline.stages.bench import triton_client as client

    flat = [r for rs in records_by_round for r in rs]
    out = client.summarize(flat, sum(walls))
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repo", type=Path, help="a packaged inflight_batcher_llm repository (default: build tiny)")
    ap.add_argument("--requests", type=int, default=24,
                    help="requests per round, path and concurrent worker (a round at concurrency 8: 8x as many)")
    ap.add_argument("--rounds", type=int, default=20, help="alternating rounds per level (each path once a round)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="the built model's runtime.dtype (auto: bfloat16 where the CPU has it natively, else float32)")


def run(args) -> dict:
    from transformers import AutoTokenizer

    from pipeline.config import compose
    from pipeline.serving import model as served_model
    from pipeline.stages.bench import openai_client as oa_client
    from pipeline.serving import run as front
    from pipeline.stages.bench import triton_client as client
    from pipeline.triton import server

    load_before = os.getloadavg()
    prompts = [f"Question {i}: write one sentence about the number {i * 13} and the colour of the sky."
               for i in range(64)]
    levels = []
    with tempfile.TemporaryDirectory(prefix="openai-overhead-") as tmp:
        tmp = Path(tmp)
        repo = args.repo.resolve() if args.repo else _build(tmp, args.dtype)
        served = served_model.load(repo, load_tokenizer=False)
        tok = AutoTokenizer.from_pretrained(str(served.tokenizer_dir))
        settings = front.write_settings(compose([]).serve.openai, tmp / "front.json", port=0,
                                        model_name=served.name)  # the shipped serve.openai settings
        with server.local_server(repo, host="127.0.0.1", server_bin=None, work_dir=tmp / "w", timeout_s=600) as s, \
                front.child(repo, s.grpc_url, settings, tmp / "front.log") as url:
            entry = client.entry_point(s.grpc_url, "ensemble", "inflight_batcher_llm")
            # CPU seconds per path, by process: the Triton server with its python stubs (the model), the front end,
            # and this process (both load generators; each path's rounds run alone)
            sessions = {"triton": os.getsid(s.proc.pid), "front_end": _listener_session(url)}
            warm = list(range(8))
            client.run_level(s.grpc_url, entry, prompts, warm, 2, args.max_tokens, 120)
            oa_client.run_level(url, served.name, prompts, warm, 2, args.max_tokens, 120, chat=False)
            whole = _whole_first_token(s.grpc_url, entry, prompts)
            for conc in (int(c) for c in args.concurrency.split(",")):
                got = {"grpc": ([], []), "openai": ([], [])}
                cpu = {p: {"triton": 0.0, "front_end": 0.0, "load_generator": 0.0} for p in got}
                for rnd in range(args.rounds):
                    n = args.requests * conc
                    order = [(rnd * n + k) % len(prompts) for k in range(n)]
                    for path in (("grpc", "openai") if rnd % 2 == 0 else ("openai", "grpc")):
                        c0 = {k: _session_cpu_s(v) for k, v in sessions.items()} | {"load_generator": _self_cpu_s()}
                        if path == "grpc":
                            recs, wall = client.run_level(s.grpc_url, entry, prompts, order, conc, args.max_tokens,
                                                          120)
                        else:
                            recs, wall = oa_client.run_level(url, served.name, prompts, order, conc,
                                                             args.max_tokens, 120, chat=False)
                        c1 = {k: _session_cpu_s(v) for k, v in sessions.items()} | {"load_generator": _self_cpu_s()}
                        for k in c1:
                            cpu[path][k] += c1[k] - c0[k]
                        client.count_output_tokens(recs, tok)
                        got[path][0].append(recs)
                        got[path][1].append(wall)
                summary = {p: _pooled(*got[p]) for p in got}
                for p in got:
                    toks = sum(r.output_tokens or 0 for rs in got[p][0] for r in rs if r.error is None)
                    nreq = sum(len(rs) for rs in got[p][0])
                    summary[p]["cpu"] = {
                        "seconds": {k: round(v, 3) for k, v in cpu[p].items()},
                        "us_per_output_token": {k: round(1e6 * v / max(1, toks), 1) for k, v in cpu[p].items()},
                        "ms_per_request": {k: round(1e3 * v / max(1, nreq), 3) for k, v in cpu[p].items()},
                        "cores_busy": round(sum(cpu[p].values()) / max(1e-9, sum(got[p][1])), 3)}
                raw = {p: [_raw(r, k, min(x.sent for x in rs)) for k, rs in enumerate(got[p][0]) for r in rs]
                       for p in got}
                levels.append({"concurrency": conc, "summary": summary, "paired_rounds": _paired(got),
                               "interval_95": _intervals(got), "opening_vs_rest": _opening(got, conc),
                               "whole_first_token": _like_for_like(got, whole), "requests": raw})
                g, o = summary["grpc"], summary["openai"]
                print(f"c={conc}: TTFT p50 {g['time_to_first_token']['p50']:.2f} / "
                      f"{o['time_to_first_token']['p50']:.2f} ms, ITL p50 {g['inter_token_latency']['p50']:.2f} / "
                      f"{o['inter_token_latency']['p50']:.2f} ms, tok/s {g['output_token_throughput']['avg']:.1f} / "
                      f"{o['output_token_throughput']['avg']:.1f}, errors {g['error_count']} / {o['error_count']}",
                      file=sys.stderr)

    load_after = os.getloadavg()
    rows, verdicts = [], []
    for lv in levels:
        g, o = lv["summary"]["grpc"], lv["summary"]["openai"]
        # TTFT and ITL on the prompts whose first token is a whole character, where both paths time the same token
        like = lv["whole_first_token"]["summary"] if lv["whole_first_token"]["prompts"] else lv["summary"]
        ttft_g, ttft_o = like["grpc"]["time_to_first_token"]["p50"], like["openai"]["time_to_first_token"]["p50"]
        itl_g, itl_o = like["grpc"]["inter_token_latency"]["p50"], like["openai"]["inter_token_latency"]["p50"]
        tps_g, tps_o = g["output_token_throughput"]["avg"], o["output_token_throughput"]["avg"]
        ttft_ok = ttft_o - ttft_g <= max(2.0, 0.05 * ttft_g)
        itl_ok = itl_o <= 1.05 * itl_g
        tps_ok = tps_o >= 0.95 * tps_g
        errors_ok = g["error_count"] == 0 and o["error_count"] == 0
        lv["targets"] = {"ttft_p50_ms_added": ttft_o - ttft_g, "ttft_met": ttft_ok, "itl_p50_ratio": itl_o / itl_g,
                         "itl_met": itl_ok, "throughput_ratio": tps_o / tps_g, "throughput_met": tps_ok,
                         "no_errors": errors_ok,
                         "ttft_p50_ms_added_all_prompts": o["time_to_first_token"]["p50"]
                         - g["time_to_first_token"]["p50"],
                         "itl_p50_ratio_all_prompts": o["inter_token_latency"]["p50"] / g["inter_token_latency"]["p50"]}
        verdicts.append(ttft_ok and itl_ok and tps_ok and errors_ok)
        rows.append((lv["concurrency"], g, o, lv["targets"]))

    if args.repo:
        computed = "the given repository's runtime.dtype"
    else:
        from pipeline.runtime.reference import compute_dtype

        computed = f"runtime.dtype={args.dtype}: {str(compute_dtype(args.dtype, 'cpu')).removeprefix('torch.')} here"
    return {"compute_dtype": computed, "prompts": len(prompts), "vocab": len(tok),
            "fragment_tokens": sum("\ufffd" in tok.decode([i]) for i in range(len(tok))), "max_tokens": args.max_tokens, "requests_per_round_per_worker": args.requests,
            "rounds": args.rounds, "endpoint": "/v1/completions (stream)", "direct": "ensemble over gRPC streams",
            "load_avg_before": [round(x, 2) for x in load_before], "load_avg_after": [round(x, 2) for x in load_after],
            "levels": levels, "all_targets_met": all(verdicts)}


def variant(record: dict) -> str:
    m = re.search(r"(\d+) CPUs", record["machine"])
    return f"{m.group(1)} CPUs" if m else record["machine"]


def render(record: dict) -> list[str]:
    levels = record["levels"]
    rows = [(lv["concurrency"], lv["summary"]["grpc"], lv["summary"]["openai"], lv["targets"]) for lv in levels]
    requests = record.get("requests_per_round_per_worker", record.get("requests_per_round"))
    load_before, load_after = record["load_avg_before"], record["load_avg_after"]
    computed = record.get("compute_dtype")

    def ms(x):
        return f"{x:.2f}"

    per_round = ", ".join(f"{requests * lv['concurrency']} at {lv['concurrency']}" for lv in levels)
    lines = [f"{record['date'][:16].replace('T', ' ')} UTC · commit {commit_label(record)} · {record['machine']} · "
             f"tiny-qwen3 (reference runtime{', ' + computed if computed else ''}) on a real "
             f"tritonserver; the front end in its own process (`python -m pipeline.serving`), the load generators "
             f"in this one, all on the same cores. {record['rounds']} alternating rounds per level of {requests} "
             f"requests per path and concurrent worker ({per_round}), "
             f"{record['max_tokens']} tokens max, greedy, the same prompt text on both paths "
             f"(`/v1/completions` streamed vs `ensemble` over gRPC streams). Load average (1 min) "
             f"{load_before[0]:.2f} → {load_after[0]:.2f}.", "",
             "| concurrency | path | TTFT p50 (ms) | ITL p50 (ms) | request latency p50 / p95 (ms) | output tokens/s | "
             "errors |", "|---|---|---|---|---|---|---|"]
    for conc, g, o, t in rows:
        for name, sm in (("direct gRPC", g), ("OpenAI", o)):
            lat = sm["request_latency"]
            lines.append(f"| {conc} | {name} | {ms(sm['time_to_first_token']['p50'])} | "
                         f"{ms(sm['inter_token_latency']['p50'])} | {ms(lat['p50'])} / {ms(lat['p95'])} | "
                         f"{sm['output_token_throughput']['avg']:.1f} | {sm['error_count']} |")
    lines.append("")
    prompts = record.get("prompts", 64)
    for lv in levels[:1]:
        wf = lv.get("whole_first_token")
        if wf is not None:
            lines.append(f"The first generated token of {prompts - len(wf['prompts'])} of the {prompts} prompts holds "
                         f"only part of a character's UTF-8 bytes (tiny-qwen3 is random and its byte-level vocabulary "
                         f"of {record['vocab']} has {record['fragment_tokens']} such tokens; probed once per prompt through the "
                         f"ensemble). A streamed OpenAI answer holds such a token back until its character is whole "
                         f"(docs/serving.md, *Streamed text*), so its first chunk is a later token's, while the direct "
                         f"path's first response is the fragment. TTFT and ITL are therefore compared on the requests "
                         f"of the other {len(wf['prompts'])} prompts, where both paths time the same first token; "
                         f"throughput over all requests.")
            lines.append("")
    for lv, (conc, g, o, t) in zip(levels, rows):
        wf = lv.get("whole_first_token") or {}
        iv = lv["interval_95"]
        if wf.get("prompts"):  # TTFT and ITL from those prompts' requests, throughput from all
            iv = {k: v for k, v in iv.items() if k == "throughput_ratio"} | wf["interval_95"]

        def within(name, fmt):
            return f", 95 % interval {fmt(iv[name][0])} to {fmt(iv[name][1])}" if name in iv else ""

        lines.append(f"- concurrency {conc}: TTFT p50 {t['ttft_p50_ms_added']:+.2f} ms"
                     f"{within('ttft_p50_ms_added', lambda x: f'{x:+.2f}')} (target ≤ max(2 ms, 5 %): "
                     f"{'met' if t['ttft_met'] else 'NOT met'}); ITL p50 {t['itl_p50_ratio']:.3f}×"
                     f"{within('itl_p50_ratio', lambda x: f'{x:.3f}')} (target ≤ 1.05×: "
                     f"{'met' if t['itl_met'] else 'NOT met'}); throughput {t['throughput_ratio']:.3f}×"
                     f"{within('throughput_ratio', lambda x: f'{x:.3f}')} (target ≥ 0.95×: "
                     f"{'met' if t['throughput_met'] else 'NOT met'}).")
        if "ttft_p50_ms_added_all_prompts" in t:
            lines.append(f"  Over all prompts, held-back first tokens included: TTFT p50 "
                         f"{t['ttft_p50_ms_added_all_prompts']:+.2f} ms, ITL p50 {t['itl_p50_ratio_all_prompts']:.3f}×.")
    lines.append("  (Verdicts on the pooled figures, as the targets are stated; intervals: bootstrap over rounds.)")
    lines.append("")
    for lv in levels:
        pr = lv["paired_rounds"]
        if pr["median"]:
            m = pr["median"]
            span = {k: (min(r[k] for r in pr["rounds"]), max(r[k] for r in pr["rounds"])) for k in m}
            lines.append(f"- concurrency {lv['concurrency']}, each round against the direct round beside it (median "
                         f"of {len(pr['rounds'])}, min–max; not the targets' figures): TTFT p50 "
                         f"{m['ttft_p50_ms_added']:+.2f} ms ({span['ttft_p50_ms_added'][0]:+.2f} to "
                         f"{span['ttft_p50_ms_added'][1]:+.2f}), ITL p50 {m['itl_p50_ratio']:.3f}× "
                         f"({span['itl_p50_ratio'][0]:.3f}–{span['itl_p50_ratio'][1]:.3f}), throughput "
                         f"{m['throughput_ratio']:.3f}× ({span['throughput_ratio'][0]:.3f}–"
                         f"{span['throughput_ratio'][1]:.3f}).")
    for lv in levels:
        sp = lv["opening_vs_rest"]
        if lv["concurrency"] > 1 and all(v["rest_ttft_p50_ms"] is not None for v in sp.values()):
            g, o = sp["grpc"], sp["openai"]
            lines.append(f"- concurrency {lv['concurrency']}, TTFT p50 of each round's opening {lv['concurrency']} "
                         f"requests (sent at once) and of the rest (each sent as one ended), direct / OpenAI: "
                         f"{g['opening_ttft_p50_ms']:.2f} / {o['opening_ttft_p50_ms']:.2f} ms "
                         f"({o['opening_ttft_p50_ms'] - g['opening_ttft_p50_ms']:+.2f}) and {g['rest_ttft_p50_ms']:.2f} / "
                         f"{o['rest_ttft_p50_ms']:.2f} ms ({o['rest_ttft_p50_ms'] - g['rest_ttft_p50_ms']:+.2f}). "
                         f"The opening requests left their load generator within {g['opening_send_spread_p50_ms']:.2f} "
                         f"/ {o['opening_send_spread_p50_ms']:.2f} ms (p50 of last send - first); their first token "
                         f"came {g['opening_first_token_from_start_p50_ms']:.2f} / "
                         f"{o['opening_first_token_from_start_p50_ms']:.2f} ms after the round's first send "
                         f"({o['opening_first_token_from_start_p50_ms'] - g['opening_first_token_from_start_p50_ms']:+.2f}).")
    lines += ["", "CPU per output token (µs, user + system, measured per path over its rounds) and cores busy:", "",
              "| concurrency | path | Triton server + stubs | front end | load generator | total | cores busy |",
              "|---|---|---|---|---|---|---|"]
    for conc, g, o, t in rows:
        for name, sm in (("direct gRPC", g), ("OpenAI", o)):
            u = sm["cpu"]["us_per_output_token"]
            lines.append(f"| {conc} | {name} | {u['triton']:.0f} | {u['front_end']:.0f} | {u['load_generator']:.0f} | "
                         f"{sum(u.values()):.0f} | {sm['cpu']['cores_busy']:.2f} |")
    return lines
