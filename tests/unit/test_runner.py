"""The stage runner on small stages of its own: fingerprints, atomic outputs, manifests, cache checks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import hardware

from pipeline.runner import executor as runner
from pipeline.errors import StageFailed
from pipeline.runner.contract import Stage


def _write(ctx):
    (ctx.out / "a.txt").write_text(ctx.cfg.model.name)
    (ctx.out / "sub").mkdir()
    (ctx.out / "sub" / "b.bin").write_bytes(b"\0" * 100)
    return {"ok": True}


def _write_quant(ctx):
    (ctx.out / "a.txt").write_text(ctx.cfg.quant.format.value)  # b declares quant.format only
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
B = Stage(name="b", run=_write_quant, reads=("quant.format",), inputs=("a",), label=lambda c: "t")


def _cfg(tmp_path: Path, *extra: str):
    return hardware.compose(["model=tiny-qwen3", f"paths.root={tmp_path}", *extra])


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
    assert [p.name for p in out.parent.iterdir() if p.name != "locks"] == []  # no temp dir, no lock beside it
    assert not list(out.parent.glob("*.lock"))


def test_output_folders_hold_only_outputs(tmp_path):
    from pipeline.config import resolved_paths

    cfg = _cfg(tmp_path)
    planned = {p.stage.name: p for p in runner.plan(cfg, [A, B])}
    for name in ("a", "b"):
        runner.execute(cfg, planned[name], planned)
    outs = {planned[n].out for n in ("a", "b")}
    for parent in {o.parent for o in outs}:
        assert {p for p in parent.iterdir() if p.name != "locks"} == {o for o in outs if o.parent == parent}
    locks = list((resolved_paths(cfg)["store"] / "locks").glob("*.lock"))
    assert sorted(p.name.rsplit("-", 1)[0] for p in locks) == sorted(planned[n].out.name for n in ("a", "b"))


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


def _link(ctx):
    dst = ctx.link_input("a", "sub", "linked")
    ctx.link_input("a", "a.txt", "top/a.txt", link=False)
    ctx.link_input("a", "", "all")
    return {"dst": dst.relative_to(ctx.out).as_posix()}


def test_link_input_links_upstream_files_with_their_known_hashes(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    linker = Stage(name="b", run=_link, reads=(), inputs=("a",), label=lambda c: "t")
    planned = {p.stage.name: p for p in runner.plan(cfg, [A, linker])}
    up = runner.execute(cfg, planned["a"], planned)
    (planned["a"].out / "sub" / "planted.bin").write_bytes(b"not in a's manifest")  # negative control
    seen = {}
    original = runner.store.list_files

    def spy(root, known=None):
        seen.update(known or {})
        return original(root, known)

    monkeypatch.setattr(runner.store, "list_files", spy)
    m = runner.execute(cfg, planned["b"], planned)
    up_sha = {f["path"]: f["sha256"] for f in up["files"]}
    assert m["result"] == {"dst": "linked"}
    assert seen == {"linked/b.bin": up_sha["sub/b.bin"], "top/a.txt": up_sha["a.txt"],
                    "all/a.txt": up_sha["a.txt"], "all/sub/b.bin": up_sha["sub/b.bin"]}
    out = planned["b"].out
    assert (out / "linked" / "b.bin").stat().st_ino == (planned["a"].out / "sub" / "b.bin").stat().st_ino
    assert (out / "top" / "a.txt").stat().st_ino != (planned["a"].out / "a.txt").stat().st_ino  # link=False copies
    assert not (out / "all" / "manifest.json").exists()  # the upstream manifest is never linked
    files = {f["path"]: f["sha256"] for f in m["files"]}
    assert files["linked/planted.bin"] != up_sha["sub/b.bin"] and "linked/planted.bin" not in seen


# ---------------------------------------------------------------------------------- preflight and run (the build loop)
@pytest.fixture
def root_log():
    """No run log open (pytest's own file handler, /dev/null, set aside), so ``runner.run`` opens one; the root
    logger's handlers are put back afterwards."""
    import logging

    saved = logging.getLogger().handlers[:]
    logging.getLogger().handlers[:] = []
    yield
    logging.getLogger().handlers[:] = saved


def test_preflight_reports_config_problems_first_and_alone_then_the_machines(tmp_path):
    from pipeline.errors import UserError

    cfg = _cfg(tmp_path)
    both = Stage(name="a", run=_write, reads=(), label=lambda c: "t", check=lambda c: ["config: bad"],
                 env_check=lambda c: ["machine: no GPU"])
    with pytest.raises(UserError) as exc:
        runner.preflight(cfg, [both])
    assert str(exc.value) == "config: bad" and exc.value.problems == ["config: bad"]
    env_only = Stage(name="a", run=_write, reads=(), label=lambda c: "t",
                     env_check=lambda c: ["machine: no GPU", "machine: no TensorRT-LLM"])
    with pytest.raises(UserError, match="^machine: no GPU; machine: no TensorRT-LLM$"):
        runner.preflight(cfg, [env_only, B])
    plan = runner.preflight(cfg, [env_only, B], environment=False)  # the negative control: plan skips the machine
    assert [p.stage.name for p in plan.stages] == ["a", "b"] and plan.by_name["b"] is plan.stages[1]
    cfg.until = "a"
    assert [s.name for s in runner.select(cfg, [A, B])] == ["a"]
    assert [p.stage.name for p in runner.preflight(cfg, [A, B]).stages] == ["a"]


def test_run_builds_then_finds_everything_cached_and_calls_each_after_hook(tmp_path, root_log):
    calls = []
    hooked = Stage(name="a", run=_write, reads=("model.name",), label=lambda c: "t",
                   after=lambda cfg, out: calls.append(("a", cfg.publish.dest, out)) or "not a publish result")
    publish = Stage(name="publish", run=_write_quant, reads=("quant.format",), inputs=("a",), label=lambda c: "t",
                    after=lambda cfg, out: {"url": f"{cfg.publish.dest}/v1", "from": str(out)})
    cfg = _cfg(tmp_path, "publish.dest=/tmp/dest")
    first = runner.run(runner.preflight(cfg, [hooked, publish]))
    assert [(r["stage"], r["status"]) for r in first.stages] == [("a", "ran"), ("publish", "ran")]
    assert first.stages[0]["bytes"] == len("tiny-qwen3") + 100 and first.stages[0]["result"] == {"ok": True}
    assert Path(first.log).is_file() and Path(first.log).parent == tmp_path / ".store" / "logs"
    out = runner.preflight(cfg, [hooked, publish]).by_name["a"].out
    assert calls == [("a", "/tmp/dest", out)]  # the hook gets the full config, not the stage's slice
    assert first.published == {"url": "/tmp/dest/v1", "from": str(first.stages[1]["output"])}
    again = runner.run(runner.preflight(cfg, [hooked, publish]))
    assert [r["status"] for r in again.stages] == ["cached", "cached"] and len(calls) == 2
    assert again.to_dict()["published"] == first.published
    plain = runner.run(runner.preflight(cfg, [A]))  # no hook: nothing published
    assert plain.published is None and len(calls) == 2
