"""The bench's load: prompts drawn from the shipped corpus, and each workload's concurrency sweep through the load
generator (``pipeline.triton.client``)."""
from __future__ import annotations

import random
from typing import Any

from pipeline import calib
from pipeline.runner import Context
from pipeline.triton import server as srv
from pipeline.ui import progress

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


def workload_names(b) -> list[str]:
    """The workloads a bench runs, in order: ``bench.only`` when set, else every entry of ``bench.workloads``."""
    return [str(w) for w in (b.only if b.get("only") is not None else list(b.workloads))]


def run_workloads(ctx: Context, server, entry, tok, result: dict[str, Any], requests: list[dict[str, Any]],
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
    for wi, wname in enumerate(workload_names(b)):
        spec = b.workloads[wname]
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
