"""Log-likelihood requests in the reference runtime's batching engine: fixed-shape passes against left-padded ones,
each in two compositions.

    python -m benchmarks loglik_prefill --root ROOT [--group 8] [--repeat 2] [--dtype bfloat16]

The prompts are the default task's (``pipeline_facts``: each question's context followed by each of its four
choices, tokenized as lm-eval does with the model's tokenizer), 540 for SmolLM2. ROOT is a build root holding the
default model's fetch output (``python -m pipeline build until=fetch paths.root=ROOT``). Each prompt asks for every
position's logits and one new token (what ``/v1/completions`` with ``echo`` and ``logprobs`` asks of the
``tensorrt_llm`` model), ``--group`` submitted together (so they join one step boundary), in two compositions: in
lm-eval's order (longest first) and shuffled (other companions, other rows). Two engines: the runtime's
(``BatchEngine``: passes of a fixed shape per prompt length, right-padded) and the same engine prefilling whatever
arrives together left-padded to the longest (``LeftPadded``, what the runtime did before). Reported per engine: the
wall time of each composition (the fastest of ``--repeat`` interleaved runs), the passes run, and between the two
compositions the largest and mean difference of the continuations' log-likelihoods and how many items' best choice
differs (0 and 0 mean a prompt's score does not depend on what shares its pass). One torch thread
(``serve.torch_threads``' default).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from benchmarks._provenance import commit_label

TITLE = "Log-likelihood prompts in the reference runtime: fixed-shape passes vs left-padded ones"


def prompts(tokenizer) -> tuple[list[tuple[list[int], list[int]]], int]:
    from pipeline.eval import tasks

    items = [json.loads(line) for line in (tasks.TASKS_DIR / "pipeline_facts.jsonl").read_text().splitlines()]
    out = []
    for it in items:
        ctx = tokenizer(f"Question: {it['question']}\nAnswer:")["input_ids"]
        out += [(ctx, tokenizer(" " + c)["input_ids"]) for c in it["choices"]]
    return out, len(items)


class _LeftPadded:
    """The engine prefilling log-likelihood prompts that arrive together in one left-padded pass (no fixed shape)."""

    @staticmethod
    def make(batching):
        class LeftPadded(batching.BatchEngine):
            def _admit(self, joining):
                ctx = sorted((s for s in joining if s.req.return_context_logits), key=lambda s: len(s.seen))
                for s in ctx:
                    s.handle.admitted_ns = time.time_ns()
                rest = [s for s in joining if not s.req.return_context_logits]
                for k in range(0, len(ctx), self.max_batch_size):
                    self._prefill(ctx[k:k + self.max_batch_size])
                if rest:
                    super()._admit(rest)

        return LeftPadded


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", type=Path, required=True,
                        help="a build root holding the default model's fetch output")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each way, interleaved (default 2)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))


def run(args) -> dict:
    import random

    import torch
    from transformers import AutoTokenizer

    from pipeline.runtime import batching, reference as rt

    a = args
    torch.set_num_threads(1)
    ckpt = next(a.root.glob(".store/smollm2-135m-fetch-*"))
    reqs, n_items = prompts(AutoTokenizer.from_pretrained(str(ckpt)))
    model = rt.load(ckpt, dtype=torch.bfloat16).to(getattr(torch, a.dtype))
    engines = {"fixed_shape": batching.BatchEngine(model, max_batch_size=max(8, a.group)),
               "left_padded": _LeftPadded.make(batching)(model, max_batch_size=max(8, a.group))}
    orders = {"lm_eval_order": sorted(range(len(reqs)), key=lambda i: -len(reqs[i][0] + reqs[i][1])),
              "shuffled": random.Random(0).sample(range(len(reqs)), len(reqs))}

    def loglik(h, ctx, cont) -> float:
        lp = torch.log_softmax(h.context_logits.float(), -1)
        full = ctx + cont
        return sum(float(lp[i - 1, full[i]]) for i in range(len(ctx), len(full)))

    def timed(eng, order) -> tuple[list[float], float, int]:
        before, res = eng.prefills, {}
        t0 = time.perf_counter()
        for k in range(0, len(order), a.group):
            idx = order[k:k + a.group]
            with eng._cv:  # held: they join at one step boundary
                hs = [eng.submit(batching.GenerationRequest(reqs[i][0] + reqs[i][1], 1, return_context_logits=True))
                      for i in idx]
            for i, h in zip(idx, hs):
                h.tokens()
                res[i] = loglik(h, *reqs[i])
        return [res[i] for i in range(len(reqs))], time.perf_counter() - t0, eng.prefills - before

    def picks(v):
        return [max(range(4), key=lambda j: v[4 * i + j]) for i in range(n_items)]

    load0 = os.getloadavg()
    times: dict = {(e, o): [] for e in engines for o in orders}
    scores, passes = {}, {}
    for _ in range(a.repeat):  # interleaved, so that every way sees the same machine; the fastest of each counts
        for e, eng in engines.items():
            for o, order in orders.items():
                scores[e, o], t, passes[e, o] = timed(eng, order)
                times[e, o].append(t)
    load1 = os.getloadavg()
    for eng in engines.values():
        eng.close()
    out = {}
    for e in engines:
        x, y = scores[e, "lm_eval_order"], scores[e, "shuffled"]
        diff = [abs(p - q) for p, q in zip(x, y)]
        out[e] = {o: {"wall_s": round(min(times[e, o]), 1), "passes": passes[e, o],
                      "runs_s": [round(t, 1) for t in times[e, o]]} for o in orders}
        out[e].update(max_abs_loglik_diff=max(diff), mean_abs_loglik_diff=sum(diff) / len(diff),
                      items_whose_best_choice_differs=sum(p != q for p, q in zip(picks(x), picks(y))))
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "dtype": a.dtype, "torch_threads": 1, "prompts": len(reqs), "items": n_items,
            "group": a.group, "width_step": batching.CONTEXT_WIDTH_STEP, "engines": out,
            "fixed_over_left_time": round(out["fixed_shape"]["lm_eval_order"]["wall_s"]
                                          / out["left_padded"]["lm_eval_order"]["wall_s"], 2),
            "load_avg_before": [round(x, 2) for x in load0], "load_avg_after": [round(x, 2) for x in load1]}


def variant(record: dict) -> str:
    return f"{record['dtype']}, groups of {record['group']}"


def suffix(record: dict) -> str:
    return f"{record['host']}-{record['dtype']}"


def render(record: dict) -> list[str]:
    doc = record
    e = doc["engines"]
    rows = []
    for name, label in (("fixed_shape", "fixed shape per prompt length (the runtime)"),
                        ("left_padded", "left-padded to the longest of those arriving together")):
        r = e[name]
        rows.append(f"| {label} | {r['lm_eval_order']['wall_s']} ({r['lm_eval_order']['passes']}) | "
                    f"{r['shuffled']['wall_s']} ({r['shuffled']['passes']}) | {r['max_abs_loglik_diff']:.3g} | "
                    f"{r['items_whose_best_choice_differs']} of {doc['items']} |")
    return [
        f"{doc['date'][:10]} · commit {commit_label(doc)} · {doc['host']} · {doc['cpus']} CPUs · Python {doc['python']} · "
        f"torch {doc['torch']} · SmolLM2-135M in {doc['dtype']}, one torch thread · load avg "
        f"{doc['load_avg_before'][0]:.1f} → {doc['load_avg_after'][0]:.1f}", "",
        f"The default task's {doc['prompts']} prompts ({doc['items']} items × 4 choices), every position's logits "
        f"each, through the batching engine in-process (no server), {doc['group']} submitted together, in lm-eval's "
        "order and shuffled (other companions, other rows).", "",
        "| passes | wall s, lm-eval's order (passes) | wall s, shuffled (passes) | largest log-likelihood "
        "difference between the orders (nats) | items whose best choice differs |", "|---|---|---|---|---|",
        *rows, "",
        f"Fixed-shape time / left-padded time: {doc['fixed_over_left_time']}× (same run, lm-eval's order; width "
        f"step {doc['width_step']} tokens)."]
