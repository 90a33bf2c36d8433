"""The bench's load: prompts drawn from the shipped corpus, and each workload's concurrency sweep through the load
generator (``pipeline.stages.bench.triton_client``)."""
from __future__ import annotations

import json
import random
from typing import Any

from pipeline import calib
from pipeline.runner.contract import Context
from pipeline.stages.bench import aiperf, noise
from pipeline.triton import server as srv
from pipeline.triton.layouts import ENGINE_REL
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


def workload_names(b) -> list[str]:
    """The workloads a bench runs, in order: ``bench.only`` when set, else every entry of ``bench.workloads``."""
    return [str(w) for w in (b.only if b.get("only") is not None else list(b.workloads))]


def run_workloads(ctx: Context, lease, entry, tok, result: dict[str, Any], requests: list[dict[str, Any]]) -> None:
    """Answer checks, the warm-up (once, before the first workload), then each workload's concurrency levels; every
    request sent is appended to ``requests`` (the lines of requests.jsonl). ``lease``: the server the bench took
    (``pipeline.runner.leases.Lease``). With ``bench.openai``, each level is sent again through the OpenAI front
    end; with ``bench.aiperf`` too, aiperf profiles the front end with the same prompts at the levels
    ``bench.aiperf_levels`` names (:func:`aiperf_levels`; its export: ``aiperf/<workload>/concurrency_<N>/``)."""
    from pipeline.stages.bench import triton_client

    cfg, b = ctx.cfg, ctx.cfg.bench
    server = lease.value
    url, chat = server.grpc_url, bool(cfg.model.chat_template)

    def keep(records, phase: str, workload: str | None, concurrency: int) -> None:
        triton_client.count_output_tokens(records, tok)
        requests.extend({"phase": phase, "path": "grpc", "workload": workload, "concurrency": concurrency,
                         **r.as_dict()} for r in records)

    with_aiperf = bool(b.get("openai", False)) and bool(b.get("aiperf", False))
    profiled = aiperf_levels(b) if with_aiperf else set()
    front = _Front(ctx, lease) if b.get("openai", False) else None
    try:
        if cfg.model.checks:  # fixed prompts, greedy, through the same entry point as the load
            w = triton_client.StreamWorker(url, entry, b.request_timeout_s)
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
            raw = make_prompts(total, spec.prompt_words, b.seed + wi)
            prompts = [_render(tok, p, chat) for p in raw]
            if b.warmup_requests and wi == 0:  # the later workloads find the server warm
                records, _ = triton_client.run_level(url, entry, prompts, list(range(b.warmup_requests)), 1,
                                                     spec.max_tokens, b.request_timeout_s)
                keep(records, "warmup", wname, 1)
            if front is not None and wi == 0 and b.warmup_requests:
                front.level(raw, list(range(b.warmup_requests)), 1, spec.max_tokens, chat)
            offset, out, oa_out = b.warmup_requests, [], []
            for conc, n in plan:
                order = list(range(offset, offset + n))
                offset += n
                with progress(f"bench {wname}: concurrency {conc}", n) as bar:
                    records, wall = triton_client.run_level(url, entry, prompts, order, conc, spec.max_tokens,
                                                            b.request_timeout_s, bar.advance)
                keep(records, "measure", wname, conc)
                if not server.alive():
                    raise srv.ServerError(f"tritonserver died during {wname} at concurrency {conc}:\n"
                                          f"{server.log_tail()}")
                if any(r.error for r in records) and not server.responsive():
                    raise srv.ServerError(f"tritonserver stopped answering during {wname} at concurrency {conc} "
                                          f"(hung: its process is alive, its readiness probe times out):\n"
                                          f"{server.log_tail()}")
                summary = triton_client.summarize(records, wall)
                # how much the level's figures move by chance: bootstrap intervals over its requests
                out.append({"concurrency": conc, **summary, "noise": noise.of_records(records, wall, seed=b.seed)})
                if front is not None:  # the same requests as apps send them, right after the gRPC level
                    with progress(f"bench {wname}: concurrency {conc} (OpenAI)", n) as bar:
                        oa_records, oa_wall = front.level(raw, order, conc, spec.max_tokens, chat, bar.advance)
                    triton_client.count_output_tokens(oa_records, tok)
                    requests.extend({"phase": "measure", "path": "openai", "workload": wname, "concurrency": conc,
                                     **r.as_dict()} for r in oa_records)
                    oa = triton_client.summarize(oa_records, oa_wall)
                    row = {"concurrency": conc, **oa, "overhead": overhead(summary, oa)}
                    if (wname, conc) in profiled:  # aiperf's own chat endpoint type, natively, with the same prompts
                        with status(f"bench {wname}: concurrency {conc} (aiperf --endpoint-type "
                                    f"{aiperf.endpoint_type(chat)} --streaming)"):
                            row["aiperf"] = front.aiperf([raw[i] for i in order], conc, spec.max_tokens, chat,
                                                         ctx.out / "aiperf" / wname / f"concurrency_{conc}", b.seed)
                    oa_out.append(row)
            result["workloads"][wname] = {"prompt_words": spec.prompt_words, "max_tokens": spec.max_tokens,
                                          "levels": out}
            if front is not None:
                result["workloads"][wname]["openai_levels"] = oa_out
    finally:
        if front is not None:
            front.close()
    if front is not None:
        result["openai"] = {"endpoint": "/v1/chat/completions" if chat else "/v1/completions", "stream": True,
                            "front_end": "python -m pipeline.serving (its own process)",
                            "aiperf": ({"endpoint_type": aiperf.endpoint_type(chat), "streaming": True,
                                        "levels": _aiperf_choice(b),
                                        "export": "aiperf/<workload>/concurrency_<N>/"} if with_aiperf else None)}


def _aiperf_choice(b) -> str:
    choice = b.get("aiperf_levels", "all")
    return str(getattr(choice, "value", choice))


def aiperf_levels(b) -> set[tuple[str, int]]:
    """The (workload, concurrency) levels aiperf profiles: every level of the sweep with ``bench.aiperf_levels=all``;
    with ``one``, the first workload's highest concurrency alone (the default on CPU, where each aiperf run starts
    its own services on the cores the server uses: about 20 s before its first request on 2 cores)."""
    names = workload_names(b)
    levels = [int(c) for c in b.concurrency]
    if not names or not levels:
        return set()
    if _aiperf_choice(b) == "one":
        return {(names[0], max(levels))}
    return {(w, c) for w in names for c in levels}


def overhead(direct: dict[str, Any], via: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI front end's cost at one level: TTFT p50 added (ms), ITL p50 and output-throughput ratios."""
    def p50(s, key):
        return s[key]["p50"]

    out: dict[str, Any] = {"ttft_p50_added_ms": None, "itl_p50_ratio": None, "throughput_ratio": None}
    if p50(direct, "time_to_first_token") is not None and p50(via, "time_to_first_token") is not None:
        out["ttft_p50_added_ms"] = p50(via, "time_to_first_token") - p50(direct, "time_to_first_token")
    if p50(direct, "inter_token_latency") and p50(via, "inter_token_latency") is not None:
        out["itl_p50_ratio"] = p50(via, "inter_token_latency") / p50(direct, "inter_token_latency")
    if direct["output_token_throughput"]["avg"]:
        out["throughput_ratio"] = via["output_token_throughput"]["avg"] / direct["output_token_throughput"]["avg"]
    return out


# the build's serve.openai settings the bench's front end runs with (on a free port): those that shape what it
# measures, and where it listens and the key's variable
OPENAI_READS = ("serve.openai.model_name", "serve.openai.entry_point", "serve.openai.limits")
OPENAI_UNHASHED = ("serve.openai.host", "serve.openai.api_key_env")


class _Front:
    """The OpenAI front end in a process of its own, in front of the bench's server, with the build's own
    ``serve.openai`` settings (:data:`OPENAI_READS`, :data:`OPENAI_UNHASHED`; written to ``openai-front-end.json``,
    its log's part written while the bench ran to ``openai-front-end.log``) on a free port; the run's own when the
    task evaluation will serve the same repository with the same settings (``pipeline.runner.leases``). The load
    generators send its key where it has one."""

    def __init__(self, ctx: Context, lease):
        import contextlib

        from pipeline.runner import leases
        from pipeline.serving.frontend import Settings

        repo = ctx.inputs["package"]
        oa = ctx.cfg.serve.openai
        self.api_key = Settings.from_config(oa).api_key  # its variable unset: refused before anything starts
        self.tokenizer = repo / ENGINE_REL
        self.timeout = ctx.cfg.bench.request_timeout_s
        settings = leases.front_settings(oa, repo)
        self.name = settings["model_name"]
        (ctx.out / "openai-front-end.json").write_text(json.dumps(settings, indent=1) + "\n")
        self._out = ctx.out
        self._stack = contextlib.ExitStack()
        self.lease = self._stack.enter_context(leases.front_end(ctx.shared, lease, settings, repo,
                                                                ctx.paths["store"] / "servers", "bench"))
        self.url = self.lease.value

    def level(self, prompts, order, conc, max_tokens, chat, on_done=None):
        from pipeline.stages.bench import openai_client

        return openai_client.run_level(self.url, self.name, prompts, order, conc, max_tokens, self.timeout, chat=chat,
                                       on_done=on_done, api_key=self.api_key)

    def aiperf(self, prompts, conc, max_tokens, chat, out, seed):
        return aiperf.profile(self.url.removesuffix("/v1"), self.name, self.tokenizer, prompts, max_tokens, conc,
                              out, chat, seed, self.timeout, api_key=self.api_key)

    def close(self):
        try:
            self.lease.copy_log(self._out / "openai-front-end.log")
        finally:
            self._stack.close()

