"""The publish gates: the bench verdict as bench.json records it (nothing assumed where a field is missing) and
whether ``latest`` may move."""
from __future__ import annotations

import json

import pytest

from pipeline.errors import StageFailed
from pipeline.stages import publish

GATES = {"verdict": "pass", "breaches": [], "regressions": [], "regressions_gated": False,
         "compared_with_previous_levels": 2, "baseline": {"status": "found", "version": "v1"}}


def _bench(tmp_path, gates=None, raw: str | None = None):
    path = tmp_path / "bench.json"
    path.write_text(raw if raw is not None else json.dumps({"gates": gates}))
    return path


def test_an_unreadable_bench_json_fails_publish_naming_the_file(tmp_path):
    path = _bench(tmp_path, raw="{not json")
    with pytest.raises(StageFailed, match=rf"{path}: cannot read the bench gate \(.*\); re-run bench"):
        publish.bench_verdict(path)
    with pytest.raises(StageFailed, match="cannot read the bench gate"):
        publish.bench_verdict(tmp_path / "absent.json")


def test_the_recorded_gate_is_kept_as_recorded(tmp_path):
    g = {**GATES, "breaches": [1.5], "regressions": ["TTFT +40%"], "baseline": {"status": "found", "version": "v7"}}
    got = publish.bench_verdict(_bench(tmp_path, g))
    assert got == {"verdict": "pass", "breaches": ["1.5"], "regressions": ["TTFT +40%"], "regressions_gated": False,
                   "compared_with_previous_levels": 2, "baseline": {"status": "found", "version": "v7"}}


def test_fields_older_bench_json_lacks_take_the_strict_reading(tmp_path):
    """Without ``regressions_gated`` the regressions count as gated; without a count, nothing was compared."""
    g = {k: v for k, v in GATES.items() if k not in ("regressions_gated", "compared_with_previous_levels",
                                                      "baseline")}
    got = publish.bench_verdict(_bench(tmp_path, g))
    assert got["regressions_gated"] is True and got["compared_with_previous_levels"] == 0 and got["baseline"] is None


@pytest.mark.parametrize("gates, passed", [
    ({"accuracy": "pass", "export_check": "pass", "bench": "pass"}, True),
    ({"accuracy": "warn", "export_check": "pass", "bench": "pass"}, False),
    ({"accuracy": "pass", "export_check": "fail", "bench": "pass"}, False),
    ({"accuracy": "pass", "export_check": "pass", "bench": "no-baseline"}, False),
    ({"accuracy": "pass", "export_check": "pass"}, False),
    ({"accuracy": "N/A", "export_check": "pass", "bench": "pass"}, False),
])
def test_latest_moves_only_when_every_gate_passed(gates, passed):
    assert publish.gates_passed(gates) is passed
