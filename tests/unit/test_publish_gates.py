"""The publish gates: bundle.json's verdicts and whether ``latest`` may move. Only ``pass`` moves it; ``n/a`` only for
the accuracy gate and export proof of an unquantized bundle; a quantized bundle without an accuracy section is
``missing``, never passed."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.results import BenchResult
from pipeline.stages import publish

QUANTIZED = {"format": "fp8", "kv_cache": "fp8"}
UNQUANTIZED = {"format": "none", "kv_cache": "none"}
PASS = {"accuracy": "pass", "export_check": "pass", "bench": "pass"}


def test_the_bench_verdict_is_the_bench_results_gate_as_given():
    gates = {"verdict": "incomplete", "breaches": [], "regressions": ["TTFT +40%"], "missing": ["chat: TTFT p95"],
             "regressions_gated": True, "compared_with_previous_levels": 1,
             "baseline": {"status": "found", "source": "s3://b", "version": "v7", "detail": None}}
    res = BenchResult(model="ensemble", layout="inflight_batcher_llm", workloads={}, answers_passed=1, answers=1,
                      gates=gates)
    assert publish.bench_verdict(res) == gates


@pytest.mark.parametrize("quant, accuracy, expected", [
    (QUANTIZED, SimpleNamespace(gate="warn", export_check="pass"), {"accuracy": "warn", "export_check": "pass"}),
    (QUANTIZED, None, {"accuracy": "missing", "export_check": "missing"}),
    ({"format": "none", "kv_cache": "fp8"}, None, {"accuracy": "missing", "export_check": "missing"}),
    (UNQUANTIZED, None, {"accuracy": "n/a", "export_check": "n/a"}),
])
def test_a_missing_accuracy_section_is_missing_unless_nothing_was_quantized(quant, accuracy, expected):
    assert publish.gate_verdicts(quant, accuracy) == expected


@pytest.mark.parametrize("gates, quant, passed", [
    (PASS, QUANTIZED, True),
    (PASS, None, True),
    ({**PASS, "accuracy": "warn"}, QUANTIZED, False),
    ({**PASS, "export_check": "fail"}, QUANTIZED, False),
    ({**PASS, "bench": "no-baseline"}, QUANTIZED, False),
    ({**PASS, "bench": "incomplete"}, QUANTIZED, False),
    ({**PASS, "accuracy": "missing", "export_check": "missing"}, QUANTIZED, False),
    ({**PASS, "accuracy": "n/a", "export_check": "n/a"}, QUANTIZED, False),  # written by an older publish
    ({**PASS, "accuracy": "n/a", "export_check": "n/a"}, None, False),
    ({**PASS, "accuracy": "n/a", "export_check": "n/a"}, UNQUANTIZED, True),
    (PASS, UNQUANTIZED, True),
    ({**PASS, "accuracy": "n/a"}, UNQUANTIZED, True),
    ({**PASS, "export_check": "n/a"}, UNQUANTIZED, True),
    ({**PASS, "export_check": "warn"}, UNQUANTIZED, False),
    ({**PASS, "bench": "n/a"}, UNQUANTIZED, False),  # the bench always applies
    ({"accuracy": "pass", "export_check": "pass"}, QUANTIZED, False),
])
def test_latest_moves_only_when_every_gate_passed(gates, quant, passed):
    assert publish.gates_passed(gates, quant) is passed


@pytest.mark.parametrize("verdict, passed", [("pass", True), ("inconclusive", True), ("n/a", True), ("fail", False),
                                             ("INCONCLUSIVE", False), (None, True)])
def test_the_task_gate_blocks_latest_only_when_it_failed(verdict, passed):
    """An inconclusive task evaluation reaches a bundle only without eval.strict (with it, evaluate fails); no
    evaluate stage is n/a."""
    gates = dict(PASS) if verdict is None else {**PASS, "eval": verdict}
    assert publish.gates_passed(gates, QUANTIZED) is passed


def test_the_gates_line_names_every_gate_and_marks_those_that_keep_latest():
    gates = {**PASS, "accuracy": "warn", "eval": "inconclusive"}
    line = publish.gates_line(gates, QUANTIZED)
    assert line == "accuracy warn (did not pass), export_check pass, bench pass, eval inconclusive"
    assert publish.gates_line({**PASS, "eval": "fail"}, QUANTIZED).endswith("eval fail (did not pass)")
    # a gate missing from bundle.json is named as missing (it does not pass), not left out
    assert "bench missing (did not pass)" in publish.gates_line({"accuracy": "pass", "export_check": "pass"},
                                                                 QUANTIZED)
    # the line and the verdict agree: the planted failing gate is the one marked
    for name, verdict, ok in publish.gate_outcomes(gates, QUANTIZED):
        assert ok is (name != "accuracy"), (name, verdict)
