"""The bench's regression gate, measure by measure: its direction (a rise in a latency, a fall in throughput is
the regression; the opposite is an improvement), its boundary (a change of exactly ``bench.gates.regression_pct``
is allowed) and what it records per check. Planted levels stand in for a bench run (no server)."""
from __future__ import annotations

import functools

import pytest

from pipeline import hardware
from pipeline.stages import bench

PCT = 25.0


def _level(conc: int = 1, *, tps: float = 100.0, ttft: float = 10.0, itl: float = 5.0, latency: float = 50.0,
           requests: int = 4, errors: int = 0) -> dict:
    def stat(p95):
        return {"unit": "ms", "avg": p95, "p50": p95, "p95": p95, "p99": p95}

    return {"concurrency": conc, "request_count": requests, "error_count": errors,
            "errors": ["refused"] * errors, "time_to_first_token": stat(ttft), "inter_token_latency": stat(itl),
            "request_latency": stat(latency), "output_token_throughput": {"avg": tps},
            "request_throughput": {"avg": 1.0}}


def _run(*levels: dict) -> dict:
    return {"workloads": {"chat": {"levels": list(levels)}}}


def _found(result: dict) -> dict:
    rows = {w: [bench.summary_row(lv) for lv in r["levels"]] for w, r in result["workloads"].items()}
    return {"status": "found", "source": "memory://b", "version": "v1", "detail": None, "bench": {"workloads": rows}}


@functools.lru_cache(maxsize=None)
def _cfg(*extra: str):
    return hardware.compose(["target=cpu", "runtime=reference", "bench.gates.regression_on_cpu=true",
                           f"bench.gates.regression_pct={PCT:g}", *extra])


BASE = dict(tps=100.0, ttft=10.0, itl=5.0, latency=50.0)
# measure -> (level field, its label in the gate, whether a rise is the regression)
MEASURES = {"tps": ("output tokens/s", False), "ttft": ("TTFT p95", True), "itl": ("inter-token latency p95", True),
            "latency": ("request latency p95", True)}


@pytest.mark.parametrize("measure", list(MEASURES))
@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_the_regression_direction_of_each_measure(measure, factor):
    label, rise_is_worse = MEASURES[measure]
    previous = _found(_run(_level(**BASE)))
    g = bench.gates(_cfg(), _run(_level(**{**BASE, measure: BASE[measure] * factor})), previous)
    worse = (factor > 1) == rise_is_worse
    mine = [c for c in g["checks"] if c["check"] == f"regression: {label}"]
    assert len(mine) == 1 and mine[0]["change_pct"] == pytest.approx(100 * (factor - 1))
    assert mine[0]["pass"] is (not worse) and mine[0]["previous"] == BASE[measure]
    assert all(c["pass"] for c in g["checks"] if c is not mine[0])  # the other measures did not move
    if worse:
        assert g["verdict"] == "fail" and len(g["regressions"]) == 1 and g["breaches"] == g["regressions"]
        assert g["regressions"][0].startswith(f"chat at concurrency 1: {label} ")
        assert f"({100 * (factor - 1):+.0f}%, allowed {PCT:g}%)" in g["regressions"][0]
    else:  # an improvement
        assert g["verdict"] == "pass" and g["regressions"] == []


@pytest.mark.parametrize("measure", list(MEASURES))
def test_a_change_of_exactly_the_allowed_percentage_passes_and_just_over_fails(measure):
    label, rise_is_worse = MEASURES[measure]
    sign = 1 if rise_is_worse else -1
    previous = _found(_run(_level(**BASE)))
    at = bench.gates(_cfg(), _run(_level(**{**BASE, measure: BASE[measure] * (1 + sign * PCT / 100)})), previous)
    assert at["verdict"] == "pass", at["regressions"]
    over = bench.gates(_cfg(), _run(_level(**{**BASE, measure: BASE[measure] * (1 + sign * (PCT + 1) / 100)})),
                       previous)
    assert over["verdict"] == "fail" and over["regressions"][0].startswith(f"chat at concurrency 1: {label} ")


def test_regressions_are_compared_level_by_level():
    previous = _found(_run(_level(1, **BASE), _level(8, **{**BASE, "tps": 400.0})))
    g = bench.gates(_cfg(), _run(_level(1, **BASE), _level(8, **{**BASE, "tps": 200.0})), previous)
    assert g["compared_with_previous_levels"] == 2
    assert g["regressions"] == ["chat at concurrency 8: output tokens/s 200.0 vs 400.0 in the previous bundle "
                                "(-50%, allowed 25%)"]


def test_on_cpu_regressions_are_reported_not_gated_unless_asked():
    cfg = hardware.compose(["target=cpu", "runtime=reference", f"bench.gates.regression_pct={PCT:g}"])
    g = bench.gates(cfg, _run(_level(**{**BASE, "ttft": 40.0})), _found(_run(_level(**BASE))))
    assert g["regressions"] and g["breaches"] == [] and g["regressions_gated"] is False and g["verdict"] == "pass"


def test_each_absolute_limit_records_its_check_and_names_the_breach_with_its_size():
    cfg = _cfg("bench.gates.ttft_p95_ms=50", "bench.gates.itl_p95_ms=4", "bench.gates.request_latency_p95_ms=100",
               "bench.gates.min_output_tokens_per_s=200", "bench.gates.max_error_rate=0.2")
    g = bench.gates(cfg, _run(_level(8, **{**BASE, "ttft": 80.0}, requests=4, errors=1)), {"status": "none"})
    by = {c["check"]: c for c in g["checks"]}
    where = "chat at concurrency 8"
    assert by["error rate"] == {"check": "error rate", "where": where, "value": 0.25, "limit": 0.2, "pass": False}
    assert by["TTFT p95"] == {"check": "TTFT p95", "where": where, "value": 80.0, "limit": 50.0, "pass": False}
    assert by["inter-token latency p95"] == {"check": "inter-token latency p95", "where": where, "value": 5.0,
                                             "limit": 4.0, "pass": False}
    assert by["request latency p95"]["pass"] is True and by["request latency p95"]["value"] == 50.0
    assert by["output tokens/s"] == {"check": "output tokens/s", "where": where, "value": 100.0, "limit": 200.0,
                                     "pass": False}
    assert g["breaches"] == [f"{where}: error rate 25.0% > 20.0% (['refused'])",
                             f"{where}: TTFT p95 80.0 ms > 50.0 ms (+60%)",
                             f"{where}: inter-token latency p95 5.0 ms > 4.0 ms (+25%)",
                             f"{where}: output 100.0 tokens/s < 200.0 (-50%)"]
    assert g["verdict"] == "fail"


def test_a_level_without_a_measured_limit_is_a_breach_not_a_pass():
    level = _level()
    level["time_to_first_token"]["p95"] = None
    g = bench.gates(_cfg("bench.gates.ttft_p95_ms=50"), _run(level), {"status": "none"})
    assert g["breaches"] == ["chat at concurrency 1: TTFT p95 not measured (limit 50.0 ms)"] and g["verdict"] == "fail"


def test_only_a_found_baseline_is_compared():
    previous = _found(_run(_level(**BASE)))
    for status in ("corrupt", "unreachable", "none", "disabled"):
        g = bench.gates(_cfg(), _run(_level(**{**BASE, "tps": 10.0})), {**previous, "status": status})
        assert g["regressions"] == [] and g["compared_with_previous_levels"] == 0, status


def test_the_regression_checks_record_the_change_to_two_decimals():
    g = bench.gates(_cfg(), _run(_level(**{**BASE, "tps": 100.0 * 2 / 3})), _found(_run(_level(**BASE))))
    c = next(c for c in g["checks"] if c["check"] == "regression: output tokens/s")
    assert c == {"check": "regression: output tokens/s", "where": "chat at concurrency 1", "value": 100.0 * 2 / 3,
                 "previous": 100.0, "change_pct": -33.33, "limit": PCT, "pass": False}


def test_regressions_are_gated_on_gpu_targets_without_being_asked():
    cfg = hardware.compose(["model=qwen32b", "quant=fp8", "target=h100", f"bench.gates.regression_pct={PCT:g}"])
    g = bench.gates(cfg, _run(_level(**{**BASE, "ttft": 40.0})), _found(_run(_level(**BASE))))
    assert g["regressions_gated"] is True and g["verdict"] == "fail" and g["breaches"] == g["regressions"]


@pytest.mark.parametrize("baseline, line", [
    ({"status": "found", "version": "v9", "source": "s3://b/p/v9"}, "Regression baseline: v9 (1 levels compared)."),
    ({"status": "found", "version": None, "source": "bundles/x"}, "Regression baseline: bundles/x (1 levels compared)."),
    ({"status": "none"}, "Regression baseline: none (no bundle published yet); nothing compared."),
    ({"status": "disabled"}, "Regression baseline: not compared (bench.gates.regression_pct is null)."),
    ({"status": "unreachable", "detail": "refused"}, "Regression baseline: **unreachable**: refused; nothing compared."),
    ({"status": "corrupt", "detail": "not JSON"}, "Regression baseline: **unreadable**: not JSON; nothing compared."),
])
def test_the_baseline_line_says_what_was_compared(baseline, line):
    assert bench.baseline_line({"baseline": baseline, "compared_with_previous_levels": 1,
                                "regressions_gated": True}) == line
    if baseline["status"] == "found":  # an older record without the count compared nothing
        assert "(0 levels compared" in bench.baseline_line({"baseline": baseline, "regressions_gated": True})



# ------------------------------------------------------------------------- nothing compared is no pass
def test_a_gated_baseline_sharing_no_level_with_the_run_is_no_baseline_not_pass():
    previous = _found(_run(_level(4, **BASE)))
    g = bench.gates(_cfg(), _run(_level(1, **{**BASE, "tps": 1.0})), previous)
    assert g["compared_with_previous_levels"] == 0 and g["regressions"] == []
    assert g["verdict"] == "no-baseline"
    assert bench.baseline_line(g) == ("Regression baseline: v1 (0 levels compared): it shares no workload and "
                                      "concurrency level with this run; nothing compared.")
    # another workload's rows are no baseline either
    other = {**previous, "bench": {"workloads": {"rag": previous["bench"]["workloads"]["chat"]}}}
    assert bench.gates(_cfg(), _run(_level(4, **BASE)), other)["verdict"] == "no-baseline"
    # reported only (CPU without regression_on_cpu): the verdict does not hang on it, the line still says so
    cpu = hardware.compose(["target=cpu", "runtime=reference", f"bench.gates.regression_pct={PCT:g}"])
    g = bench.gates(cpu, _run(_level(1, **BASE)), previous)
    assert g["verdict"] == "pass" and "nothing compared" in bench.baseline_line(g)


def test_a_regression_measure_missing_on_either_side_makes_the_verdict_incomplete():
    level = _level(**BASE)
    level["time_to_first_token"]["p95"] = None  # no absolute TTFT limit: only the regression reads it
    g = bench.gates(_cfg(), _run(level), _found(_run(_level(**BASE))))
    assert g["verdict"] == "incomplete" and g["missing"] == ["chat at concurrency 1: TTFT p95 not measured in this run"]
    assert g["compared_with_previous_levels"] == 1
    assert bench.baseline_line(g).endswith("Not compared: chat at concurrency 1: TTFT p95 not measured in this run.")
    previous = _found(_run(_level(**{**BASE, "tps": 0.0})))
    g = bench.gates(_cfg(), _run(_level(**BASE)), previous)
    assert g["verdict"] == "incomplete" and g["missing"] == ["chat at concurrency 1: output tokens/s is 0.0 in the "
                                                             "baseline"]
    # a breach still fails first
    g = bench.gates(_cfg("bench.gates.max_error_rate=0"), _run(_level(**BASE, errors=1)), previous)
    assert g["verdict"] == "fail"


def test_a_run_that_measured_no_level_is_incomplete_even_without_a_baseline():
    g = bench.gates(_cfg(), {"workloads": {"chat": {"levels": []}}}, {"status": "none"})
    assert g["verdict"] == "incomplete" and g["missing"] == ["no level was measured"] and g["checks"] == []
    assert bench.gates(_cfg(), {"workloads": {}}, {"status": "disabled"})["verdict"] == "incomplete"


def test_the_typed_result_counts_the_answers_that_passed():
    r = {**_run(_level(**BASE)), "model": "ensemble", "layout": "inflight_batcher_llm",
         "answers": [{"pass": True}, {"pass": False}, {"pass": True}]}
    r["gates"] = bench.gates(_cfg(), r, {"status": "none"})
    res = bench.bench_result(r)
    assert (res.answers_passed, res.answers) == (2, 3)
    assert res.gates.verdict == "pass" and res.gates.missing == []
    assert res.workloads["chat"][0].concurrency == 1


# ------------------------------------------------------------------------- the baseline record, the entry point
def _gates_module():
    import importlib

    return importlib.import_module("pipeline.stages.bench.gates")


def test_a_baseline_is_read_with_where_it_came_from_or_refused_as_corrupt():
    import json

    read = _gates_module()._read_baseline
    bad = read(b"{not json", "s3://b/p/v1", "v1")
    assert {k: bad[k] for k in ("status", "source", "version")} == {"status": "corrupt", "source": "s3://b/p/v1",
                                                                     "version": "v1"}
    assert bad["detail"].startswith("bundle.json is not JSON (Expecting property name")
    rows = {"status": "corrupt", "source": "w", "version": None,
            "detail": "bundle.json has no bench results with per-level rows"}
    assert read(b"[1]", "w", None) == rows
    for bench in ({}, {"workloads": []}, {"workloads": {"chat": "x"}}, {"workloads": {"chat": [{"tps": 1}]}},
                  {"workloads": {"chat": [1]}}):
        assert read(json.dumps({"bench": bench}).encode(), "w", None) == rows, bench
    good = {"workloads": {"chat": [{"concurrency": 1}]}}
    assert read(json.dumps({"bench": good}).encode(), "w", "v2") == {"status": "found", "source": "w", "version": "v2",
                                                                      "detail": None, "bench": good}


def test_the_error_rate_is_of_the_requests_sent_and_names_the_first_error():
    level = _level(requests=1, errors=1)
    level["errors"] = ["refused", "timeout"]
    g = bench.gates(_cfg(), _run(level), {"status": "none"})
    assert g["breaches"] == ["chat at concurrency 1: error rate 100.0% > 0.0% (['refused'])"]


def test_a_measure_exactly_at_its_absolute_limit_passes():
    cfg = _cfg("bench.gates.ttft_p95_ms=10", "bench.gates.min_output_tokens_per_s=100")
    g = bench.gates(cfg, _run(_level(**BASE)), {"status": "none"})
    assert g["verdict"] == "pass" and all(c["pass"] for c in g["checks"])
    g = bench.gates(cfg, _run(_level(**{**BASE, "tps": 80.0})), {"status": "none"})
    assert g["breaches"] == ["chat at concurrency 1: output 80.0 tokens/s < 100.0 (-20%)"]
    g = bench.gates(cfg, _run(_level(**{**BASE, "tps": 10.0})), {"status": "none"})
    assert g["breaches"] == ["chat at concurrency 1: output 10.0 tokens/s < 100.0 (-90%)"]  # the shortfall, exactly


def test_every_limit_level_and_measure_is_checked_not_only_the_first():
    cfg = _cfg("bench.gates.itl_p95_ms=4")  # no TTFT limit before it
    g = bench.gates(cfg, _run(_level(**BASE)), {"status": "none"})
    assert [c["check"] for c in g["checks"]] == ["error rate", "inter-token latency p95"]
    # a previous level this run lacks does not stop the comparison of the next one
    previous = _found(_run(_level(4, **BASE), _level(1, **BASE)))
    g = bench.gates(_cfg(), _run(_level(1, **{**BASE, "latency": 100.0})), previous)
    assert g["compared_with_previous_levels"] == 1 and len(g["regressions"]) == 1
    # a measure missing from the baseline does not stop the others' comparison
    old = _found(_run(_level(**BASE)))
    old["bench"]["workloads"]["chat"][0]["output_tokens_per_s"] = None
    g = bench.gates(_cfg(), _run(_level(**{**BASE, "latency": 100.0})), old)
    assert [c["check"] for c in g["checks"] if c["check"].startswith("regression")] == [
        "regression: TTFT p95", "regression: inter-token latency p95", "regression: request latency p95"]
    assert g["verdict"] == "fail" and g["missing"] == ["chat at concurrency 1: output tokens/s is None in the baseline"]


def test_the_baseline_line_lists_every_measure_not_compared():
    g = {"baseline": {"status": "found", "version": "v1"}, "compared_with_previous_levels": 2, "regressions_gated": True,
         "missing": ["a: TTFT p95 not measured in this run", "b: output tokens/s is 0 in the baseline"]}
    assert bench.baseline_line(g) == ("Regression baseline: v1 (2 levels compared). Not compared: a: TTFT p95 not "
                                      "measured in this run; b: output tokens/s is 0 in the baseline.")


def test_a_layout_the_bench_cannot_drive_names_the_ones_it_can():
    from pipeline.errors import UserError

    from pipeline.triton import layouts

    with pytest.raises(UserError) as err:
        bench.choose_entry("auto", "reference-ensemble")
    assert str(err.value).endswith(f"(it drives: {', '.join(layouts.ENTRY_POINTS)})")
    with pytest.raises(UserError) as err:
        bench.choose_entry("x", "inflight_batcher_llm", ["ensemble", "tensorrt_llm_bls"])
    assert str(err.value).endswith("(it has: ensemble, tensorrt_llm_bls); set bench.model=auto")
