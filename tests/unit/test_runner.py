"""The stage runner on small stages of its own: fingerprints, atomic outputs, manifests, cache checks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import config, runner
from pipeline.errors import StageFailed
from pipeline.runner import Stage


def _write(ctx):
    (ctx.out / "a.txt").write_text(ctx.cfg.model.name)
    (ctx.out / "sub").mkdir()
    (ctx.out / "sub" / "b.bin").write_bytes(b"\0" * 100)
    return {"ok": True}


def _boom(ctx):
    (ctx.out / "half.bin").write_bytes(b"partial")
    raise RuntimeError("killed mid-write")


def _gate(ctx):
    (ctx.out / "report.md").write_text("# numbers")
    raise StageFailed("gate breached")


A = Stage(name="a", run=_write, reads=("model.name",), label=lambda c: "t")
B = Stage(name="b", run=_write, reads=("quant.format",), inputs=("a",), label=lambda c: "t")


def _cfg(tmp_path: Path, *extra: str):
    return config.compose(["model=tiny-qwen3", f"paths.root={tmp_path}", *extra])


def test_fingerprint_covers_slice_inputs_and_libs(tmp_path):
    p1 = {p.stage.name: p for p in runner.plan(_cfg(tmp_path), [A, B])}
    p2 = {p.stage.name: p for p in runner.plan(_cfg(tmp_path, "quant=none"), [A, B])}
    assert p1["a"].fingerprint == p2["a"].fingerprint  # a does not read quant
    assert p1["b"].fingerprint != p2["b"].fingerprint
    p3 = {p.stage.name: p for p in runner.plan(_cfg(tmp_path, "model.dtype=float16"), [A, B])}
    assert p3["a"].fingerprint == p1["a"].fingerprint  # a reads model.name only
    assert set(p1["b"].parts) >= {"config", "inputs", "code", "libs"}
    assert p1["b"].parts["inputs"] == {"a": p1["a"].fingerprint}
    libbed = Stage(name="a", run=_write, reads=("model.name",), libs=("not-a-real-dist",), label=lambda c: "t")
    assert runner.plan(_cfg(tmp_path), [libbed])[0].parts["libs"] == {"not-a-real-dist": "absent"}


def test_execute_writes_manifest_and_second_plan_is_cached(tmp_path):
    cfg = _cfg(tmp_path)
    planned = {p.stage.name: p for p in runner.plan(cfg, [A, B])}
    for name in ("a", "b"):
        m = runner.execute(cfg, planned[name], planned)
    assert {f["path"] for f in m["files"]} == {"a.txt", "sub/b.bin"}
    assert m["peak_rss_mb"] > 0 and m["result"] == {"ok": True}
    assert json.loads((planned["b"].out / "manifest.json").read_text())["input_digests"]["a"]
    again = runner.plan(cfg, [A, B])
    assert all(p.cached for p in again)


def test_failed_stage_leaves_no_final_and_no_temp(tmp_path):
    cfg = _cfg(tmp_path)
    st = Stage(name="a", run=_boom, reads=(), label=lambda c: "t")
    planned = {p.stage.name: p for p in runner.plan(cfg, [st])}
    with pytest.raises(RuntimeError):
        runner.execute(cfg, planned["a"], planned)
    out = planned["a"].out
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if not p.name.endswith(".lock")] == []


def test_gate_failure_keeps_the_report_outside_the_outputs(tmp_path):
    cfg = _cfg(tmp_path)
    st = Stage(name="a", run=_gate, reads=(), label=lambda c: "t")
    planned = {p.stage.name: p for p in runner.plan(cfg, [st])}
    with pytest.raises(StageFailed, match="gate breached .report: "):
        runner.execute(cfg, planned["a"], planned)
    assert not planned["a"].out.exists()
    kept = list((tmp_path / "reports" / "failed").glob("*/report.md"))
    assert len(kept) == 1


def test_damaged_output_is_not_cached(tmp_path):
    cfg = _cfg(tmp_path)
    planned = {p.stage.name: p for p in runner.plan(cfg, [A])}
    runner.execute(cfg, planned["a"], planned)
    (planned["a"].out / "sub" / "b.bin").write_bytes(b"short")
    p = runner.plan(cfg, [A])[0]
    assert not p.cached and "damaged" in p.reason
