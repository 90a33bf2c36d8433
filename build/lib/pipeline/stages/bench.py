"""bench: serve the packaged repository on a real Triton server, check answers, measure streaming load, gate.

The only stage (with ``pipeline.triton``) that talks to Triton. The server comes from ``serve.launcher``: a local
binary, an NGC container, or an external URL. Two workloads (``chat``: short prompts, long outputs; ``rag``: long
prompts, short outputs) are drawn reproducibly from the shipped corpus (``bench.seed``), rendered with the chat
template when ``model.chat_template`` is on, and swept over ``bench.concurrency`` after warm-up requests.

``bench.json`` keeps genai-perf/aiperf profile-export field names (``time_to_first_token``, ``inter_token_latency``,
``request_latency``, ``output_token_throughput``, ``request_throughput``; ms, p50/p95/p99), so ops tools read it.
``requests.jsonl`` holds one line per request sent (answer checks, warm-up and every measured level): its phase,
workload and concurrency, TTFT, mean and per-gap inter-token latencies, request latency, output tokens and error.
Gates: absolute limits (``bench.gates``) and the regression against the previous published bundle of the same
model/quant/target/runtime (output tokens/s, and the p95 of TTFT, inter-token and request latency, each within
``bench.gates.regression_pct``); a breach fails the stage with the report naming the number and by how much.
"""
from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

from pipeline import calib
from pipeline.errors import StageFailed
from pipeline.runner import Context, Stage, artifact_label
from pipeline.triton import server as srv
from pipeline.ui import progress, status


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


def run(ctx: Context) -> dict[str, Any]:
    from transformers import AutoTokenizer

    cfg = ctx.cfg
    repo = ctx.inputs["package"]
    tok = AutoTokenizer.from_pretrained(repo / "tensorrt_llm" / "1" / "engine")
    result: dict[str, Any] = {"model": cfg.bench.model.value, "launcher": cfg.serve.launcher.value,
                              "workloads": {}, "answers": []}
    requests: list[dict[str, Any]] = []
    started = time.perf_counter()
    log_path = None
    try:
        with status(f"starting tritonserver ({cfg.serve.launcher.value}; loading models)"):
            cm = srv.launched(cfg.serve, repo, ctx.paths["store"] / "servers")
            server = cm.__enter__()
        log_path = server.log_path
        result["server_start_s"] = round(time.perf_counter() - started, 2)
        try:
            _bench(ctx, server, tok, result, requests)
        finally:
            cm.__exit__(None, None, None)
    except srv.ServerError as exc:
        (ctx.out / "server-error.txt").write_text(str(exc) + "\n")
        raise StageFailed(str(exc).splitlines()[0] + " (server log tail: server-error.txt)") from exc
    finally:
        if log_path is not None and log_path.is_file():
            shutil.copy2(log_path, ctx.out / "server.log")

    result["gates"] = gates(cfg, result, previous_bench(ctx))
    (ctx.out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (ctx.out / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    (ctx.out / "bench.md").write_text(markdown(cfg.model.name, result))
    if cfg.bench.plot:
        plot(result, ctx.out / "bench.png")
    failed = [a for a in result["answers"] if not a["pass"]]
    why = [f"answer check failed: {a['prompt']!r} -> {a['text']!r} (expected {a['expect']})" for a in failed]
    why += result["gates"]["breaches"]
    if why:
        raise StageFailed("; ".join(why))
    return {"workloads": {w: [summary_row(lv) for lv in r["levels"]] for w, r in result["workloads"].items()},
            "answers_passed": len(result["answers"]), "answers": len(result["answers"])}


def summary_row(lv: dict[str, Any]) -> dict[str, Any]:
    return {"concurrency": lv["concurrency"], "request_count": lv["request_count"], "error_count": lv["error_count"],
            "ttft_p50_ms": lv["time_to_first_token"]["p50"], "ttft_p95_ms": lv["time_to_first_token"]["p95"],
            "itl_p50_ms": lv["inter_token_latency"]["p50"], "itl_p95_ms": lv["inter_token_latency"]["p95"],
            "latency_p95_ms": lv["request_latency"]["p95"], "latency_p99_ms": lv["request_latency"]["p99"],
            "output_tokens_per_s": lv["output_token_throughput"]["avg"],
            "requests_per_s": lv["request_throughput"]["avg"]}


def _bench(ctx: Context, server, tok, result: dict[str, Any], requests: list[dict[str, Any]]) -> None:
    """Answer checks, then each workload's warm-up and concurrency levels; every request sent is appended to
    ``requests`` (the lines of requests.jsonl)."""
    from pipeline.triton import client

    cfg, b = ctx.cfg, ctx.cfg.bench
    url, model, chat = server.grpc_url, b.model.value, bool(cfg.model.chat_template)

    def keep(records, phase: str, workload: str | None, concurrency: int) -> None:
        requests.extend({"phase": phase, "workload": workload, "concurrency": concurrency, **r.as_dict()}
                        for r in records)

    if cfg.model.checks:  # fixed prompts, greedy, through the same entry point as the load
        w = client.StreamWorker(url, model, b.request_timeout_s)
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
        levels = [(int(c), max(int(c), b.requests_per_level)) for c in b.concurrency]
        total = b.warmup_requests + sum(n for _, n in levels)
        prompts = [_render(tok, p, chat) for p in make_prompts(total, spec.prompt_words, b.seed + wi)]
        if b.warmup_requests:
            records, _ = client.run_level(url, model, prompts, list(range(b.warmup_requests)), 1, spec.max_tokens,
                                          b.request_timeout_s)
            keep(records, "warmup", wname, 1)
        offset, out = b.warmup_requests, []
        for conc, n in levels:
            order = list(range(offset, offset + n))
            offset += n
            with progress(f"bench {wname}: concurrency {conc}", n) as bar:
                records, wall = client.run_level(url, model, prompts, order, conc, spec.max_tokens,
                                                 b.request_timeout_s, bar.advance)
            keep(records, "measure", wname, conc)
            if not server.alive():
                raise srv.ServerError(f"tritonserver died during {wname} at concurrency {conc}:\n"
                                      f"{server.log_tail()}")
            if any(r.error for r in records) and not server.responsive():
                raise srv.ServerError(f"tritonserver stopped answering during {wname} at concurrency {conc} (hung: "
                                      f"its process is alive, its readiness probe times out):\n{server.log_tail()}")
            out.append({"concurrency": conc, **client.summarize(records, wall)})
        result["workloads"][wname] = {"prompt_words": spec.prompt_words, "max_tokens": spec.max_tokens,
                                      "levels": out}


def previous_bench(ctx: Context) -> dict[str, Any] | None:
    """Bench results of the previous published bundle of the same model/quant/target/runtime: the ``latest`` one at
    ``publish.dest`` (what a scheduled rebuild on a fresh runner sees), else the newest local bundle."""
    from pipeline.fleet import _published_base

    try:
        fs, base = _published_base(ctx.cfg)
        version = fs.cat_file(f"{base}/latest").decode().strip()
        return json.loads(fs.cat_file(f"{base}/{version}/bundle.json")).get("bench") or None
    except Exception:  # no latest yet (or the destination is unreachable): fall back to local bundles
        pass
    label = ctx.stage.label(ctx.cfg)
    newest, found = -1.0, None
    for bundle in ctx.paths["bundles"].glob(f"{label}-publish-*/bundle.json"):
        mtime = bundle.stat().st_mtime
        if mtime > newest:
            try:
                found = json.loads(bundle.read_text()).get("bench") or None
                newest = mtime
            except (OSError, json.JSONDecodeError):
                continue
    return found


# summary_row keys compared with the previous bundle: (key, label, a rise is the regression)
REGRESSION_METRICS = (("output_tokens_per_s", "output tokens/s", False), ("ttft_p95_ms", "TTFT p95", True),
                      ("itl_p95_ms", "inter-token latency p95", True), ("latency_p95_ms", "request latency p95", True))


def gates(cfg, result: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    g = cfg.bench.gates
    breaches: list[str] = []
    limits = (("ttft_p95_ms", "TTFT p95", "time_to_first_token", "p95"),
              ("itl_p95_ms", "inter-token latency p95", "inter_token_latency", "p95"),
              ("request_latency_p95_ms", "request latency p95", "request_latency", "p95"))
    for wname, w in result["workloads"].items():
        for lv in w["levels"]:
            where = f"{wname} at concurrency {lv['concurrency']}"
            rate = lv["error_count"] / max(1, lv["request_count"])
            if rate > g.max_error_rate:
                breaches.append(f"{where}: error rate {rate:.1%} > {g.max_error_rate:.1%} ({lv['errors'][:1]})")
            for key, label, field, p in limits:
                limit, value = g[key], lv[field][p]
                if limit is not None and value is not None and value > limit:
                    breaches.append(f"{where}: {label} {value:.1f} ms > {limit} ms (+{100 * (value / limit - 1):.0f}%)")
            tps = lv["output_token_throughput"]["avg"]
            if g.min_output_tokens_per_s is not None and tps < g.min_output_tokens_per_s:
                breaches.append(f"{where}: output {tps:.1f} tokens/s < {g.min_output_tokens_per_s} "
                                f"(-{100 * (1 - tps / g.min_output_tokens_per_s):.0f}%)")
    compared, regressions = 0, []
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
                    if (change > g.regression_pct) if worse_if_higher else (-change > g.regression_pct):
                        regressions.append(f"{where}: {label} {n:.1f} vs {o:.1f} in the previous bundle "
                                           f"({change:+.0f}%, allowed {g.regression_pct:g}%)")
    gated = cfg.target.device.value == "cuda" or bool(g.regression_on_cpu)
    if gated:
        breaches += regressions
    return {"breaches": breaches, "compared_with_previous_levels": compared, "regressions": regressions,
            "regressions_gated": gated, "verdict": "fail" if breaches else "pass"}


def markdown(model: str, r: dict[str, Any]) -> str:
    lines = [f"# bench: {model}", "", f"Entry point `{r['model']}`, launcher {r['launcher']}, server start "
             f"{r.get('server_start_s')} s. Gate: **{r['gates']['verdict']}**", ""]
    lines += [f"- {b}" for b in r["gates"]["breaches"]]
    if r["gates"].get("regressions") and not r["gates"].get("regressions_gated"):
        lines += ["", "Slower than the previous bundle (reported only: on target=cpu, set "
                  "bench.gates.regression_on_cpu=true to fail on it):", ""]
        lines += [f"- {x}" for x in r["gates"]["regressions"]]
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(r["workloads"])
    fig, axes = plt.subplots(len(names), 2, figsize=(10, 3.2 * len(names)), squeeze=False)
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
    plt.close(fig)


def env_check(cfg) -> list[str]:
    """The server binary must exist here before any work starts (serve.launcher=local)."""
    from pipeline.errors import UserError

    if cfg.serve.launcher.value != "local":
        return []
    try:
        srv.find_server(cfg.serve.server_bin)
    except UserError as exc:
        return [str(exc)]
    return []


STAGE = Stage(
    env_check=env_check,
    volatile=("bench.json", "bench.md", "bench.png", "server.log", "requests.jsonl"),
    name="bench",
    run=run,
    reads=("bench", "model.checks", "model.chat_template", "serve.host", "serve.server_bin",
           "serve.startup_timeout_s", "serve.launcher", "serve.image", "serve.url", "serve.repo_mount"),
    inputs=("package",),
    libs=("tritonclient", "nvidia-pytriton", "transformers"),
    code=("pipeline.triton.client", "pipeline.triton.server", "pipeline.calib"),
    root="store",
    label=artifact_label,
)
