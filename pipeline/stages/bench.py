"""bench: start a real Triton server on the packaged repository, check answers, and measure streaming load.

The only stage (with ``pipeline.triton``) that talks to Triton. Prompts are drawn reproducibly (``bench.seed``) from
the shipped corpus and rendered with the tokenizer's chat template when ``model.chat_template`` is on.
"""
from __future__ import annotations

import json
import random
import shutil
import time
from typing import Any

from pipeline import calib
from pipeline.errors import StageFailed
from pipeline.runner import Context, Stage
from pipeline.triton import server as srv
from pipeline.ui import progress, status

MODEL = "ensemble"


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    texts = calib.load("builtin")
    docs = list(texts.calib + texts.heldout)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        toks = rng.choice(docs).split()
        start = rng.randrange(0, max(1, len(toks) - words))
        out.append("Continue this text: " + " ".join(toks[start:start + words]))
    return out


def _render(tok, prompt: str, chat: bool) -> str:
    if chat and getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
    return prompt


def run(ctx: Context) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from pipeline.triton import client

    cfg, b = ctx.cfg, ctx.cfg.bench
    repo = ctx.inputs["package"]
    tok = AutoTokenizer.from_pretrained(repo / "tensorrt_llm" / "1" / "engine")
    chat = bool(cfg.model.chat_template)
    prompts_raw = make_prompts(b.requests_per_level * len(b.concurrency) + b.warmup_requests, b.prompt_words, b.seed)
    prompts = [_render(tok, p, chat) for p in prompts_raw]

    result: dict[str, Any] = {"model": MODEL, "levels": [], "answers": []}
    started = time.perf_counter()
    log_path = None
    try:
        with status("starting tritonserver (loading models)"):
            running = srv.running(repo, host=cfg.serve.host, server_bin=cfg.serve.server_bin,
                                  work_dir=ctx.paths["store"] / "servers", timeout_s=cfg.serve.startup_timeout_s)
            server = running.__enter__()
        log_path = server.log_path
        result["server_start_s"] = round(time.perf_counter() - started, 2)
        try:
            _bench(ctx, server, tok, prompts, result, client)
        except BaseException:
            running.__exit__(None, None, None)
            raise
        running.__exit__(None, None, None)
    except srv.ServerError as exc:
        (ctx.out / "server-error.txt").write_text(str(exc) + "\n")
        raise StageFailed(str(exc).splitlines()[0] + " (server log tail: server-error.txt)") from exc
    finally:
        if log_path is not None and log_path.is_file():
            shutil.copy2(log_path, ctx.out / "server.log")

    (ctx.out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (ctx.out / "bench.md").write_text(markdown(cfg.model.name, result))
    failed = [a for a in result["answers"] if not a["pass"]]
    errors = sum(lv["error_count"] for lv in result["levels"])
    if failed or errors:
        why = [f"answer check failed: {a['prompt']!r} -> {a['text']!r} (expected {a['expect']})" for a in failed]
        if errors:
            why.append(f"{errors} request error(s)")
        raise StageFailed("; ".join(why))
    return {"levels": [{k: lv[k] for k in ("concurrency", "request_count", "error_count")} |
                       {"ttft_p50_ms": lv["time_to_first_token"]["p50"],
                        "itl_p50_ms": lv["inter_token_latency"]["p50"],
                        "latency_p95_ms": lv["request_latency"]["p95"],
                        "output_tokens_per_s": lv["output_token_throughput"]["avg"],
                        "requests_per_s": lv["request_throughput"]["avg"]} for lv in result["levels"]],
            "answers_passed": len(result["answers"]) - len(failed), "answers": len(result["answers"])}


def _bench(ctx: Context, server, tok, prompts: list[str], result: dict[str, Any], client) -> None:
    cfg, b = ctx.cfg, ctx.cfg.bench
    url = server.grpc_url
    # Answer checks: fixed prompts, greedy, through the whole ensemble.
    if cfg.model.checks:
        w = client.StreamWorker(url, MODEL, b.request_timeout_s)
        try:
            for chk in cfg.model.checks:
                rec = w.request(-1, _render(tok, chk.prompt, bool(cfg.model.chat_template)), b.answer_max_tokens)
                ok = rec.error is None and any(e.lower() in rec.text.lower() for e in chk.expect)
                result["answers"].append({"prompt": chk.prompt, "expect": list(chk.expect), "text": rec.text,
                                          "error": rec.error, "pass": ok})
        finally:
            w.close()
    # Warm-up, then one level per concurrency.
    if b.warmup_requests:
        client.run_level(url, MODEL, prompts, list(range(b.warmup_requests)), 1, b.max_tokens, b.request_timeout_s)
    offset = b.warmup_requests
    for conc in b.concurrency:
        order = list(range(offset, offset + b.requests_per_level))
        offset += b.requests_per_level
        with progress(f"bench concurrency {conc}", len(order)) as bar:
            records, wall = client.run_level(url, MODEL, prompts, order, int(conc), b.max_tokens,
                                             b.request_timeout_s, bar.advance)
        if not server.alive():
            raise srv.ServerError(f"tritonserver died during the concurrency-{conc} level")
        level = {"concurrency": int(conc), **client.summarize(records, wall)}
        result["levels"].append(level)


def markdown(model: str, r: dict[str, Any]) -> str:
    lines = [f"# bench: {model}", "", f"Server start: {r.get('server_start_s')} s", ""]
    if r["answers"]:
        lines += ["| answer check | expected | output | result |", "|---|---|---|---|"]
        for a in r["answers"]:
            out = (a["error"] or a["text"]).replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {a['prompt']} | {', '.join(a['expect'])} | {out} | {'pass' if a['pass'] else 'FAIL'} |")
        lines.append("")
    lines += ["| concurrency | requests | errors | TTFT p50/p95 ms | ITL p50/p95 ms | latency p50/p95/p99 ms | "
              "output tok/s | req/s |", "|---|---|---|---|---|---|---|---|"]
    for lv in r["levels"]:
        def f(key, *ps):
            return "/".join("-" if lv[key][p] is None else f"{lv[key][p]:.1f}" for p in ps)
        lines.append(f"| {lv['concurrency']} | {lv['request_count']} | {lv['error_count']} | "
                     f"{f('time_to_first_token', 'p50', 'p95')} | {f('inter_token_latency', 'p50', 'p95')} | "
                     f"{f('request_latency', 'p50', 'p95', 'p99')} | {lv['output_token_throughput']['avg']:.1f} | "
                     f"{lv['request_throughput']['avg']:.2f} |")
    return "\n".join(lines) + "\n"


STAGE = Stage(
    volatile=("bench.json", "bench.md", "server.log"),
    name="bench",
    run=run,
    reads=("bench", "model.checks", "model.chat_template", "serve.host", "serve.server_bin",
           "serve.startup_timeout_s"),
    inputs=("package",),
    libs=("tritonclient", "nvidia-pytriton", "transformers"),
    code=("pipeline.triton.client", "pipeline.triton.server", "pipeline.calib"),
    root="store",
    label=lambda cfg: f"{cfg.model.name}.{cfg.quant.format.value}-kv{cfg.quant.kv_cache.value}"
                      f".{cfg.target.name}.{cfg.runtime.name.value}",
)
