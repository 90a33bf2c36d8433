"""The paired task gate on planted per-item vectors, the task files, and the gate's wiring into results."""
from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from pipeline.eval import gate, markdown, stats, tasks


def _items(values):
    return {str(i): float(v) for i, v in enumerate(values)}


def _cfg(**over):
    base = {"max_drop": {"fp8": 0.05, "none": 0.02}, "confidence": 0.95, "resamples": 2000, "seed": 0,
            "strict": False}
    return OmegaConf.create({**base, **over})


def test_identical_runs_give_zero_difference_inside_a_zero_interval():
    b = _items([1, 0, 1, 1, 0] * 40)
    r = stats.compare(b, dict(b), max_drop=0.05)
    assert r["difference"] == 0 and r["ci_low"] == 0 and r["ci_high"] == 0
    assert r["ci_low"] <= r["difference"] <= r["ci_high"]
    assert r["verdict"] == "pass" and r["changed_items"] == 0
    assert r["mcnemar"] == {"lost": 0, "gained": 0, "p_value": 1.0}


def test_planted_regression_fails():
    base = [1] * 150 + [0] * 50  # 0.75
    quant = [1] * 80 + [0] * 70 + [0] * 50  # 70 right answers lost: 0.40
    r = stats.compare(_items(base), _items(quant), max_drop=0.05)
    assert r["difference"] == pytest.approx(-0.35)
    assert r["ci_high"] < -0.05 and r["verdict"] == "fail"
    assert r["mcnemar"]["lost"] == 70 and r["mcnemar"]["gained"] == 0 and r["mcnemar"]["p_value"] < 1e-10


def test_few_flips_pass_and_the_interval_covers_the_difference():
    base = [1, 0] * 100
    quant = list(base)
    for i in (0, 2, 4):  # three lost, two gained
        quant[i] = 0
    for i in (1, 3):
        quant[i] = 1
    r = stats.compare(_items(base), _items(quant), max_drop=0.05)
    assert r["difference"] == pytest.approx(-1 / 200)
    assert r["ci_low"] < r["difference"] < r["ci_high"]
    assert r["ci_low"] > -0.05 and r["verdict"] == "pass"


def test_too_few_items_is_inconclusive_and_says_why():
    base, quant = [1, 1, 0, 1, 0, 1, 1, 0], [1, 0, 0, 1, 1, 0, 1, 0]
    r = stats.compare(_items(base), _items(quant), max_drop=0.05)
    assert r["ci_low"] < -0.05 < r["ci_high"]
    assert r["verdict"] == "inconclusive"
    assert "too few items" in r["explanation"]


def test_bootstrap_is_seeded_and_the_seed_matters():
    d = [0, -1, 1, 0, -1, 0, 0, 1, -1, -1] * 5
    assert stats.bootstrap_ci(d, seed=3) == stats.bootstrap_ci(d, seed=3)
    assert stats.bootstrap_ci(d, seed=3) != stats.bootstrap_ci(d, seed=4)


def test_bootstrap_interval_matches_the_normal_approximation_on_many_items():
    import random

    rng = random.Random(0)
    d = [rng.choice((-1, 0, 0, 0, 1)) for _ in range(4000)]
    lo, hi = stats.bootstrap_ci(d, resamples=4000)
    n = len(d)
    mean = sum(d) / n
    sd = (sum((x - mean) ** 2 for x in d) / (n - 1)) ** 0.5
    half = 1.96 * sd / n ** 0.5
    assert lo == pytest.approx(mean - half, abs=0.25 * half)
    assert hi == pytest.approx(mean + half, abs=0.25 * half)


@pytest.mark.parametrize("lo,hi,verdict", [(-0.01, 0.02, "pass"), (-0.2, -0.06, "fail"), (-0.08, 0.01, "inconclusive"),
                                           (-0.05, 0.0, "inconclusive"), (-0.3, -0.05, "inconclusive")])
def test_verdict_edges(lo, hi, verdict):
    assert stats.verdict(lo, hi, 0.05) == verdict


def test_mcnemar_exact_against_the_binomial():
    from scipy.stats import binomtest

    b = [1] * 12 + [0] * 3 + [1] * 30
    q = [0] * 12 + [1] * 3 + [1] * 30
    m = stats.mcnemar_exact(b, q)
    assert (m["lost"], m["gained"]) == (12, 3)
    assert m["p_value"] == pytest.approx(binomtest(3, 15, 0.5).pvalue)


def test_different_items_are_an_error_never_dropped():
    with pytest.raises(ValueError, match="different items"):
        stats.compare({"0": 1.0, "1": 0.0}, {"0": 1.0}, max_drop=0.05)


def _doc(values):
    return {"tasks": {"pipeline_facts": {"metrics": ["acc", "acc_norm"], "items": {"acc": _items(values),
                                                                                   "acc_norm": _items(values)}}}}


def test_gate_uses_the_formats_allowed_drop_and_strictness():
    base = [1] * 150 + [0] * 50
    q = [1] * 140 + [0] * 60  # -0.05: straddles the limit
    g = gate(_doc(base), _doc(q), _cfg(), "fp8")
    assert g["tasks"]["pipeline_facts"]["metric"] == "acc"
    assert g["tasks"]["pipeline_facts"]["max_drop"] == 0.05
    assert g["verdict"] == "inconclusive" and g["inconclusive"] and not g["failures"]
    g_none = gate(_doc(base), _doc(q), _cfg(max_drop={"fp8": 0.05, "none": 0.01}), "none")  # tighter: fails
    assert g_none["verdict"] == "fail"
    from pipeline.errors import StageFailed

    with pytest.raises(StageFailed, match="eval.max_drop has no entry for quant.format=nvfp4"):
        gate(_doc(base), _doc(q), _cfg(), "nvfp4")


def test_markdown_table_shows_both_scores_interval_and_verdict():
    base = [1] * 150 + [0] * 50
    g = gate(_doc(base), _doc(base), _cfg(), "fp8")
    text = markdown("m", "fp8", {"gate": g, "lm_eval": "0.4.13", "endpoint": "http://h/v1",
                                 "baseline": {"source": "m.cpu-eval_baseline-x"}, "task_files": {"a.yaml": "0" * 64}})
    row = [ln for ln in text.splitlines() if ln.startswith("| pipeline_facts")][0]
    assert "0.7500 | 0.7500 | +0.0000 | [+0.0000, +0.0000] | 0.05 | pass" in row


def test_shipped_task_files_are_complete_and_hashed():
    assert "pipeline_facts" in tasks.builtin()
    files = tasks.files_of(["pipeline_facts"])
    assert [p.suffix for p in files] == [".yaml", ".jsonl"]
    rows = [json.loads(ln) for ln in files[1].read_text().splitlines()]
    assert len(rows) >= 100
    for r in rows:
        assert len(r["choices"]) == 4 and 0 <= r["answer"] < 4 and len(set(r["choices"])) == 4
    assert len({r["question"] for r in rows}) == len(rows)
    d = tasks.digests(["pipeline_facts", "arc_easy"])  # lm-eval's own tasks have no files here
    assert set(d) == {"pipeline_facts.yaml", "pipeline_facts.jsonl"} and all(len(v) == 64 for v in d.values())


def test_task_data_is_what_the_generator_writes():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("make_eval_tasks", Path(tasks.TASKS_DIR).parents[2] /
                                                  "tools" / "make_eval_tasks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.items(mod.FACTS, seed=23)
    shipped = (tasks.TASKS_DIR / "pipeline_facts.jsonl").read_text()
    assert shipped == "".join(json.dumps(r) + "\n" for r in rows)


def test_include_dir_makes_data_paths_absolute(tmp_path):
    import yaml

    out = tasks.include_dir(tmp_path)
    doc = yaml.safe_load((out / "pipeline_facts.yaml").read_text())
    path = doc["dataset_kwargs"]["data_files"]["test"]
    assert path.startswith("/") and path.endswith("pipeline_facts.jsonl")


def test_diff_shows_task_scores_between_bundles(tmp_path):
    from pipeline import bundle
    from tests.helpers.bundles import make_bundle, rewrite_manifest

    def with_eval(quantized, verdict):
        def change(doc):
            doc["eval"] = {"verdict": verdict, "lm_eval": "0.4.13", "tasks": {"pipeline_facts": {
                "metric": "acc", "baseline": 0.7259, "quantized": quantized, "difference": quantized - 0.7259,
                "ci_low": quantized - 0.7259 - 0.02, "ci_high": quantized - 0.7259 + 0.02, "items": 135,
                "verdict": verdict}}}
            doc["gates"]["eval"] = verdict
        return change

    old, new = make_bundle(tmp_path, version="v000000000001"), make_bundle(tmp_path, version="v000000000002")
    rewrite_manifest(old / "bundle.json", with_eval(0.7333, "pass"))
    rewrite_manifest(new / "bundle.json", with_eval(0.3333, "fail"))
    for b in (old, new):
        bundle.BundleManifest.model_validate(json.loads((b / "bundle.json").read_text()))
    text = bundle.diff(str(old), str(new))
    assert "| task pipeline_facts quantized | 0.7333 | 0.3333 | -0.4 |" in text  # a score changes by points, not %
    assert "| task pipeline_facts verdict | pass | fail |  |" in text
    assert "task pipeline_facts baseline" not in text  # unchanged rows are left out


def _echo(prompt_lps, generated):
    """An OpenAI completions response with echo: the prompt's log probabilities, then the generated ones."""
    lps = [None, *prompt_lps, *generated]
    tops = [None, *({"t": lp} for lp in prompt_lps), *({"g": lp} for lp in generated)]
    return {"choices": [{"index": 0, "text": "", "logprobs": {"token_logprobs": lps, "top_logprobs": tops}}]}


@pytest.mark.parametrize("generated", [[-0.5], []], ids=["one generated token", "end token: none returned"])
def test_continuation_log_probability_ends_at_the_prompt(generated):
    """Three context tokens and a two-token continuation; the answer is the same whether the server returned the one
    generated token or, having generated the end token, none. lm-eval's own slice [ctxlen:-1] is wrong in the
    second case: it drops the continuation's last token (the negative control, run in lm-eval's child
    environment)."""
    import os
    import subprocess
    import sys

    from pipeline.eval import env, harness

    tokens = [[11, 12, 13, 14, 15]]
    out = _echo([-1.0, -2.0, -0.25, -0.75], generated)
    assert harness.continuation_logprobs(out, tokens, [3]) == [(-1.0, True)]
    code = ("import json, sys; from lm_eval.models.openai_completions import LocalCompletionsAPI as M; "
            "a = json.loads(sys.argv[1]); print(json.dumps(M.parse_logprobs(a, tokens=a['t'], ctxlens=[3])))")
    doc = {**out, "t": tokens}
    child = {**os.environ, "PYTHONPATH": os.pathsep.join([*env.pythonpath(), *sys.path])}
    stock = json.loads(subprocess.run([sys.executable, "-c", code, json.dumps(doc)], capture_output=True, text=True,
                                      env=child, check=True).stdout)
    assert stock[0][0] == (-1.0 if generated else -0.25)


def test_a_short_echo_is_an_error():
    from pipeline.eval import harness

    with pytest.raises(ValueError, match="echoed 3 log probabilities for a 5-token prompt"):
        harness.continuation_logprobs(_echo([-1.0, -2.0], []), [[1, 2, 3, 4, 5]], [3])


def test_plan_names_a_format_without_an_allowed_drop_and_a_bad_one():
    from pipeline import hardware
    from pipeline.stages import evaluate

    cfg = hardware.compose(["quant=nvfp4", "~eval.max_drop.nvfp4", "eval.max_drop.fp8=-0.1"])
    problems = evaluate.check(cfg)
    assert "eval.max_drop has no entry for quant.format=nvfp4; add eval.max_drop.nvfp4=0.05 (say)" in problems
    assert "eval.max_drop.fp8=-0.1: an allowed drop of the task score lies in [0, 1]" in problems
    assert evaluate.check(hardware.compose(["eval.tasks=[]", "quant=nvfp4", "~eval.max_drop.nvfp4"])) == []


# lm-eval 0.4.13's log after one request failed (api_models.py amodel_call's warning and error lines; the aiohttp
# session left by tqdm_asyncio.gather's first exception fails every queued request, and the log ends with that)
_LOG_HTTP = """Requesting API:   0%|          | 0/80 [00:00<?, ?it/s]API request failed! Status code: 500, \
Response text: \
{"error": {"message": "the model failed: TypeError: boom", "type": "internal_error", "param": null, "code": null}}. \
Retrying...
Exception:ClientResponseError(RequestInfo(url=URL('http://127.0.0.1:1/v1/completions')), (), status=500), \
(no outputs), retrying.
Exception:ServerDisconnectedError('Server disconnected'), (no outputs), retrying.
Exception:RuntimeError('Session is closed'), (no outputs), retrying.
Traceback (most recent call last):
  File "/x/aiohttp/client.py", line 581, in _request
    raise RuntimeError("Session is closed")
RuntimeError: Session is closed
"""


def test_the_failure_named_is_the_first_failed_request_not_the_closed_session(tmp_path):
    from pipeline import eval as ev
    from pipeline.eval import harness

    assert harness.failure_cause(_LOG_HTTP) == ("the endpoint answered HTTP 500: the model failed: TypeError: boom")
    # no status line: the first failed call that is not the closed session, then the first other exception
    no_status = "\n".join(ln for ln in _LOG_HTTP.splitlines() if "Status code" not in ln and "Retrying" not in ln)
    assert harness.failure_cause(no_status) == ("a request failed: ClientResponseError(RequestInfo(url=URL("
                                                "'http://127.0.0.1:1/v1/completions')), (), status=500)")
    no_call = "\n".join(ln for ln in no_status.splitlines() if "ClientResponseError" not in ln)
    assert harness.failure_cause(no_call) == "a request failed: ServerDisconnectedError('Server disconnected')"
    tb = ("Traceback (most recent call last):\n  File \"a\", line 1\nRuntimeError: Session is closed\n"
          "Traceback (most recent call last):\n  File \"b\", line 2\n"
          "asyncio.exceptions.TimeoutError: read timed out\n")
    assert harness.failure_cause(tb) == "asyncio.exceptions.TimeoutError: read timed out"
    assert harness.failure_cause("Traceback (most recent call last):\nRuntimeError: Session is closed\n") == \
        "RuntimeError: Session is closed"  # nothing better to name
    assert harness.failure_cause("all good\n") is None
    # with the front end's own log
    (tmp_path / "lm-eval.log").write_text(_LOG_HTTP)
    (tmp_path / "frontend.log").write_text("2026-12-01 10:00:00,000 INFO 400 refused\n"
                                           "2026-12-01 10:00:01,000 ERROR 500 the model failed: TypeError: boom\n")
    msg = ev.failure(tmp_path / "lm-eval.log", tmp_path / "frontend.log")
    assert msg == ("the endpoint answered HTTP 500: the model failed: TypeError: boom; the front end's first error: "
                   "500 the model failed: TypeError: boom")
    (tmp_path / "other.log").write_text("starting\nsomething odd\nthe end\n")
    assert ev.failure(tmp_path / "other.log") == "starting | something odd | the end"  # no cause: the tail


def test_the_setup_entry_points_run_without_a_warning():
    """``make setup`` runs ``python -m pipeline.eval.env`` and ``python -m pipeline.perfmodel``: a newcomer's first
    command prints no RuntimeWarning (runpy warns when the package imported the module before running it; here -W error
    makes that a failure)."""
    import subprocess
    import sys

    for module in ("pipeline.eval.env", "pipeline.perfmodel"):
        proc = subprocess.run([sys.executable, "-W", "error", "-m", module, "--help"], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0 and "Warning" not in proc.stderr, (module, proc.stderr[-500:])
