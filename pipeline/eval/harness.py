"""lm-evaluation-harness against an OpenAI endpoint, in a child process; per-item scores for the paired gate.

Log-likelihood tasks (``multiple_choice``, ``loglikelihood``, ``loglikelihood_rolling``) go through lm-eval's
``local-completions`` model: it tokenizes with the model's own tokenizer and posts ``/v1/completions`` with the token
ids as ``prompt``, ``echo: true``, ``logprobs: 1``, ``max_tokens: 1`` and ``temperature: 0``, then sums the echoed
prompt log probabilities of the continuation tokens (read up to the prompt's own length: :func:`_register`). Generative tasks (``generate_until``) go through
``local-chat-completions``: ``/v1/chat/completions`` with the task's prompt as messages (lm-eval's
``apply_chat_template``), ``max_tokens`` from the task's ``max_gen_toks``, its stop strings and ``temperature: 0``.

The child writes one JSON file: per task, lm-eval's aggregate results, and per metric the score of every item keyed by
``doc_id``, with the lm-eval version and how each task was run. Running lm-eval in a child keeps its imports
(``datasets``, ``pyarrow``), logging and event loops out of the stage's process; on an environment whose numpy is
older than pyarrow needs, the child runs on the evaluation overlay (``pipeline.eval.env``).

    python -m pipeline.eval.harness SPEC.json OUT.json
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

_STARTED = time.perf_counter()  # the child's imports (lm-eval's) are timed from here
LOGLIKELIHOOD = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")
GENERATE = ("generate_until",)
COMPLETIONS = "pipeline-local-completions"


def continuation_logprobs(outputs, tokens, ctxlens) -> list[tuple[float, bool]]:
    """(log-likelihood, greedy) of each continuation from OpenAI completions responses with ``echo`` and
    ``logprobs``: the entries from ``ctxlen`` up to the prompt's own length (``tokens``, the ids sent).

    lm-eval's ``local-completions`` reads ``token_logprobs[ctxlen:-1]``: it assumes the echoed list ends with exactly
    one generated entry. A server whose model generates its end token for ``max_tokens: 1`` may return the prompt's
    entries alone, and ``[:-1]`` then silently drops the continuation's last token. Ending at the prompt's length is
    right in both cases; a response with fewer entries than the prompt is an error."""
    from operator import itemgetter

    res = []
    for out in outputs if isinstance(outputs, list) else [outputs]:
        choices = sorted(out["choices"], key=itemgetter("index"))
        if len(choices) != len(ctxlens) or len(tokens) != len(ctxlens):
            raise ValueError(f"{len(choices)} choices for {len(ctxlens)} prompts")
        for choice, ctxlen, toks in zip(choices, ctxlens, tokens):
            lps, tops = choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]
            if len(lps) < len(toks):
                raise ValueError(f"the server echoed {len(lps)} log probabilities for a {len(toks)}-token prompt")
            cont, top = lps[ctxlen:len(toks)], tops[ctxlen:len(toks)]
            res.append((sum(cont), all(lp >= max(t.values()) for lp, t in zip(cont, top))))
    return res


_HTTP_FAILED = re.compile(r"API request failed! Status code: (\d+), Response text: (.*?)\. Retrying\.\.\.\s*$")
_SYNC_FAILED = re.compile(r"API request failed with error message: (.*?)\. Retrying\.\.\.\s*$")
_CALL_FAILED = re.compile(r"Exception:(\w+(?:Error|Exception|Timeout)\w*)\((.*)")
_RAISED = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Timeout|Interrupt|Exit)\w*)(?::\s*(.*))?$")


def _body_message(text: str) -> str:
    """An OpenAI error body's ``error.message`` (the text itself when it is not one)."""
    try:
        doc = json.loads(text)
        return str(doc["error"]["message"]) if isinstance(doc.get("error"), dict) else str(doc["error"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return text


def failure_cause(log: str) -> str | None:
    """What made lm-eval fail, from its log: the first request the server answered with an error status (its status
    and message), else the first failed API call, else the first exception raised; None when the log shows none.

    Once one request fails, lm-eval's concurrent client leaves its aiohttp session and every request still queued
    fails with ``RuntimeError: Session is closed``, which is what the end of the log shows: never the cause."""
    lines = log.splitlines()
    for ln in lines:
        m = _HTTP_FAILED.search(ln)
        if m:
            return f"the endpoint answered HTTP {m.group(1)}: {_body_message(m.group(2))[:500]}"
        m = _SYNC_FAILED.search(ln)
        if m:
            return f"the endpoint answered with an error: {_body_message(m.group(1))[:500]}"
    for ln in lines:
        m = _CALL_FAILED.search(ln)
        if m and "Session is closed" not in m.group(2):
            rest = re.sub(r"(, \(no outputs\))?, retrying\.\s*$", "", m.group(2))
            return f"a request failed: {m.group(1)}({rest[:400]}"
    raised = []
    for i, ln in enumerate(lines):
        if ln.startswith("Traceback (most recent call last)"):
            raised += [nxt.strip() for nxt in lines[i + 1:] if _RAISED.match(nxt)][:1]
    raised.sort(key=lambda r: "Session is closed" in r)  # stable: the first other one, if any
    return raised[0][:500] if raised else None


def _register() -> None:
    """lm-eval's ``local-completions`` reading the answer with :func:`continuation_logprobs`; its requests are
    unchanged."""
    from lm_eval.api.registry import register_model
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    @register_model(COMPLETIONS)
    class PromptLengthCompletions(LocalCompletionsAPI):
        @staticmethod
        def parse_logprobs(outputs, tokens=None, ctxlens=None, **kwargs):
            return continuation_logprobs(outputs, tokens, ctxlens)


def _item_scores(samples: list[dict[str, Any]], metrics: list[str]) -> dict[str, dict[str, float]]:
    """{metric: {doc_id: score}} from lm-eval's logged samples (one per item; ``filter`` ``none`` or the task's
    first filter)."""
    out: dict[str, dict[str, float]] = {}
    for s in samples:
        for m in metrics:
            v = s.get(m)
            if isinstance(v, bool):
                v = float(v)
            if isinstance(v, (int, float)):
                out.setdefault(m, {})[str(s["doc_id"])] = float(v)
    return out


def _evaluate(spec: dict[str, Any], tasks: list[Any], chat: bool) -> dict[str, Any]:
    """One simple_evaluate call over ``tasks`` (Task objects) through the model of their kind."""
    from lm_eval import simple_evaluate

    model = "local-chat-completions" if chat else COMPLETIONS
    path = "chat/completions" if chat else "completions"
    args = {"model": spec["model"], "base_url": f"{spec['base_url'].rstrip('/')}/{path}",
            "tokenizer_backend": "huggingface", "tokenizer": spec["tokenizer"], "num_concurrent": spec["concurrency"],
            "max_retries": 1, "timeout": int(spec["timeout_s"]), "max_length": spec["max_length"],
            "tokenized_requests": not chat}
    res = simple_evaluate(model=model, model_args=args, tasks=tasks, limit=spec.get("limit"),
                          num_fewshot=spec.get("num_fewshot"), log_samples=True, apply_chat_template=chat,
                          random_seed=spec["seed"], numpy_random_seed=spec["seed"], torch_random_seed=spec["seed"],
                          fewshot_random_seed=spec["seed"], bootstrap_iters=0)
    return {"model": model, "endpoint": args["base_url"], "results": res["results"], "samples": res["samples"]}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Every task of ``spec["tasks"]`` (a task or a group: its subtasks' items pooled) evaluated at
    ``spec["base_url"]``; -> {"lm_eval": version, "tasks": {name: ...}, "wall_s"}."""
    import importlib.metadata as md

    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    _register()
    t_tm = time.perf_counter()
    tm = TaskManager(include_path=spec.get("include_path"), include_defaults=bool(spec.get("include_defaults", True)))
    leaves: dict[str, list[Any]] = {}
    for name in spec["tasks"]:
        if name not in tm.all_tasks:
            raise SystemExit(f"error: eval.tasks: lm-eval has no task or group {name!r} (the project's own: "
                             f"{', '.join(sorted(n for n in tm.all_tasks if n.startswith('pipeline_')))}; "
                             f"lm-eval's: `lm-eval ls tasks`)")
        leaves[name] = list(tm.load(name)["tasks"].values())  # a group: its leaf tasks
    t_run = time.perf_counter()
    runs: dict[bool, dict[str, Any]] = {}
    for chat in (False, True):
        todo = [t for ts in leaves.values() for t in ts if (t.config.output_type in GENERATE) == chat]
        if todo:
            runs[chat] = _evaluate(spec, todo, chat)
    tasks: dict[str, Any] = {}
    for name, ts in leaves.items():
        items: dict[str, dict[str, float]] = {}
        info = {"subtasks": [], "output_types": sorted({t.config.output_type for t in ts})}
        for t in ts:
            r = runs[t.config.output_type in GENERATE]
            info.update(model=r["model"], endpoint=r["endpoint"])
            metrics = [m["metric"] if isinstance(m, dict) else m for m in (t.config.metric_list or [])]
            metrics = [m for m in metrics if isinstance(m, str)] or ["acc"]
            prefix = "" if len(ts) == 1 else f"{t.task_name}/"
            for m, scores in _item_scores(r["samples"].get(t.task_name, []), metrics).items():
                items.setdefault(m, {}).update({prefix + k: v for k, v in scores.items()})
            info["subtasks"].append(t.task_name)
        tasks[name] = {**info, "metrics": sorted(items), "items": items,
                       "results": {k: v for k, v in (runs[ts[0].config.output_type in GENERATE]["results"]
                                                     .get(name) or {}).items() if isinstance(v, (int, float, str))}}
    t_end = time.perf_counter()
    return {"lm_eval": md.version("lm_eval"), "tasks": tasks, "concurrency": spec["concurrency"],
            "wall_s": round(t_end - t0, 2),
            "harness_timings": {"import_s": round(t0 - _STARTED, 2), "tasks_load_s": round(t_run - t_tm, 2),
                                "evaluate_s": round(t_end - t_run, 2)}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    out = run(spec)
    tmp = Path(argv[1]).with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.replace(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
