"""Log-likelihood requests in the reference runtime's batching engine: one at a time against passes of N.

    python benchmarks/loglik_prefill.py --root ROOT [--group 8] [--dtype bfloat16]

The prompts are the default task's (``pipeline_facts``: each question's context followed by each of its four
choices, tokenized as lm-eval does with the model's tokenizer), 540 for SmolLM2. ROOT is a build root holding the
default model's fetch output (``python -m pipeline build until=fetch paths.root=ROOT``). Each prompt asks for every
position's logits and one new token (what ``/v1/completions`` with ``echo`` and ``logprobs`` asks of the
``tensorrt_llm`` model), submitted one at a time (each waits for the last), then ``--group`` at a time (submitted
together, so they join one step boundary), interleaved ``--repeat`` times, the fastest of each way counting. Reported: the wall time of each way, the passes run, the largest and mean
difference of the continuations' log-likelihoods between the two, and how many items' best choice differs. One torch
thread (``serve.torch_threads``' default). Raw JSON: ``benchmarks/results/loglik_prefill-<date>-<host>-<dtype>.json``;
the section is prepended to ``docs/benchmarks.md``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import _docfile  # noqa: E402


def prompts(tokenizer) -> tuple[list[tuple[list[int], list[int]]], int]:
    from pipeline.eval import tasks

    items = [json.loads(line) for line in (tasks.TASKS_DIR / "pipeline_facts.jsonl").read_text().splitlines()]
    out = []
    for it in items:
        ctx = tokenizer(f"Question: {it['question']}\nAnswer:")["input_ids"]
        out += [(ctx, tokenizer(" " + c)["input_ids"]) for c in it["choices"]]
    return out, len(items)


def main() -> None:
    import torch
    from transformers import AutoTokenizer

    from pipeline.runtime import batching, reference as rt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2, help="runs of each way, interleaved (default 2)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--render", type=Path, help="a raw JSON file: only write its doc section")
    a = ap.parse_args()
    if a.render:
        _docfile.prepend(section(json.loads(a.render.read_text()), str(a.render.resolve().relative_to(REPO))))
        return
    if a.root is None:
        ap.error("--root is required (a build root holding the default model's fetch output)")
    torch.set_num_threads(1)
    ckpt = next(a.root.glob(".store/smollm2-135m-fetch-*"))
    reqs, n_items = prompts(AutoTokenizer.from_pretrained(str(ckpt)))
    model = rt.load(ckpt, dtype=torch.bfloat16).to(getattr(torch, a.dtype))
    eng = batching.BatchEngine(model, max_batch_size=max(8, a.group))
    order = sorted(range(len(reqs)), key=lambda i: -len(reqs[i][0] + reqs[i][1]))  # lm-eval's order: longest first

    def loglik(h, ctx, cont) -> float:
        lp = torch.log_softmax(h.context_logits.float(), -1)
        full = ctx + cont
        return sum(float(lp[i - 1, full[i]]) for i in range(len(ctx), len(full)))

    def run(group: int) -> tuple[list[float], float, int]:
        before, res = eng.prefills, {}
        t0 = time.perf_counter()
        for k in range(0, len(order), group):
            idx = order[k:k + group]
            with eng._cv:  # held: they join at one step boundary
                hs = [eng.submit(batching.GenerationRequest(reqs[i][0] + reqs[i][1], 1, return_context_logits=True))
                      for i in idx]
            for i, h in zip(idx, hs):
                h.tokens()
                res[i] = loglik(h, *reqs[i])
        return [res[i] for i in range(len(reqs))], time.perf_counter() - t0, eng.prefills - before

    load0 = os.getloadavg()
    t_ones, t_grps = [], []
    for _ in range(a.repeat):  # interleaved, so that both ways see the same machine; the fastest of each counts
        one, t, p_one = run(1)
        t_ones.append(t)
        grp, t, p_grp = run(a.group)
        t_grps.append(t)
    t_one, t_grp = min(t_ones), min(t_grps)
    load1 = os.getloadavg()
    eng.close()
    diff = [abs(x - y) for x, y in zip(one, grp)]

    def picks(v):
        return [max(range(4), key=lambda j: v[4 * i + j]) for i in range(n_items)]

    flips = sum(x != y for x, y in zip(picks(one), picks(grp)))
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    doc = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
           "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
           "torch": torch.__version__, "dtype": a.dtype, "torch_threads": 1, "prompts": len(reqs), "items": n_items,
           "one_at_a_time": {"wall_s": round(t_one, 1), "passes": p_one, "runs_s": [round(t, 1) for t in t_ones]},
           f"groups_of_{a.group}": {"wall_s": round(t_grp, 1), "passes": p_grp,
                                    "runs_s": [round(t, 1) for t in t_grps]},
           "speedup": round(t_one / t_grp, 2), "max_abs_loglik_diff": max(diff),
           "mean_abs_loglik_diff": sum(diff) / len(diff), "items_whose_best_choice_differs": flips,
           "load_avg_before": [round(x, 2) for x in load0], "load_avg_after": [round(x, 2) for x in load1]}
    name = f"loglik_prefill-{doc['date'][:10]}-{doc['host']}-{a.dtype}.json"
    path = REPO / "benchmarks" / "results" / name
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
    if not a.no_doc:
        _docfile.prepend(section(doc, str(path.relative_to(REPO))))


def section(doc: dict, path: str) -> str:
    group = next(k for k in doc if k.startswith("groups_of_"))
    n = group.rsplit("_", 1)[1]
    return "\n".join([
        f"## Log-likelihood prompts in the reference runtime: one at a time vs passes of {n} "
        "(`benchmarks/loglik_prefill.py`)",
        f"{doc['date'][:10]} · commit {doc['commit']} · {doc['host']} · {doc['cpus']} CPUs · Python {doc['python']} · "
        f"torch {doc['torch']} · SmolLM2-135M in {doc['dtype']}, one torch thread · load avg "
        f"{doc['load_avg_before'][0]:.1f} → {doc['load_avg_after'][0]:.1f}", "",
        f"The default task's {doc['prompts']} prompts ({doc['items']} items × 4 choices), every position's logits "
        "each, through the batching engine in-process (no server).", "",
        "| way | wall s (fastest of the interleaved runs) | forward passes |", "|---|---|---|",
        f"| one at a time | {doc['one_at_a_time']['wall_s']} | {doc['one_at_a_time']['passes']} |",
        f"| {n} submitted together | {doc[group]['wall_s']} | {doc[group]['passes']} |", "",
        f"Ratio {doc['speedup']}× (same run). Continuation log-likelihoods differ between the two by at most "
        f"{doc['max_abs_loglik_diff']:.3g} nats (mean {doc['mean_abs_loglik_diff']:.3g}); "
        f"{doc['items_whose_best_choice_differs']} of {doc['items']} items' best choice differs.", "",
        f"Raw data: `{path}`."])

if __name__ == "__main__":
    main()
