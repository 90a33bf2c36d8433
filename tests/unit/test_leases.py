"""One server per repository per build run: the runner's shared scope (``runner.Shared``), the serving leases
(``pipeline.runner.leases``) with a stand-in for tritonserver, and the run-log count of start-ups, each with a
negative control."""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest

from pipeline import hardware

from pipeline.runner import executor as runner
from pipeline.runner.contract import Stage
from pipeline.runner import leases as sh

EVENTS: list[str] = []


class FakeServer:
    """What the stages use of a started tritonserver."""

    def __init__(self, repo: Path, log_path: Path, n: int):
        self.proc = type("Proc", (), {"pid": 4242 + n})()
        self.grpc_url = f"127.0.0.1:{9000 + n}"
        self.log_path = log_path
        self.repo = repo
        self.dead = False

    def alive(self) -> bool:
        return not self.dead

    def ready(self) -> bool:
        return not self.dead


@pytest.fixture
def fake_triton(monkeypatch, tmp_path):
    """tritonserver's launcher replaced: each start-up and stop is an event; the server log is a file."""
    from pipeline.triton import server as srv

    EVENTS.clear()
    _SERVE_CFG.clear()
    started: list[FakeServer] = []

    @contextlib.contextmanager
    def launched(serve, repo, work, on_wait=None):
        log = tmp_path / f"server-{len(started)}.log"
        log.write_text(f"started {repo}\n")
        s = FakeServer(Path(repo), log, len(started))
        started.append(s)
        EVENTS.append(f"start {Path(repo).name}")
        try:
            yield s
        finally:
            EVENTS.append(f"stop {Path(repo).name}")

    monkeypatch.setattr(srv, "launched", launched)
    monkeypatch.setattr(srv, "stop", lambda server, grace_s=10.0: None)
    return started


def _produce(ctx):
    (ctx.out / "repo.txt").write_text("a repository")
    return {"ok": True}


_SERVE_CFG: list = []


def _serve_cfg():
    """serve settings as a build has them (composed once per test: the fixture clears it)."""
    if not _SERVE_CFG:
        _SERVE_CFG.append(hardware.compose(["model=tiny-qwen3"]).serve)
    return _SERVE_CFG[0]


def _serve(ctx):
    """A stage that serves its input ``p`` the way bench and evaluate do."""
    with sh.triton(ctx.shared, _serve_cfg(), ctx.inputs["p"], ctx.paths["store"] / "servers",
                   ctx.stage.name) as lease:
        EVENTS.append(f"{ctx.stage.name} on {lease.value.grpc_url} started_here={lease.started}")
        Path(lease.log_path).open("a").write(f"request from {ctx.stage.name}\n")
        lease.copy_log(ctx.out / "server.log")
    return {"ok": True}


def _plain(ctx):
    EVENTS.append(f"{ctx.stage.name} runs")
    (ctx.out / "x.txt").write_text("x")
    return {"ok": True}


P = Stage(name="p", run=_produce, reads=("model.name",), label=lambda c: "t")
S1 = Stage(name="s1", run=_serve, reads=("model.name",), inputs=("p",), serves=("p",), label=lambda c: "t")
MID = Stage(name="mid", run=_plain, reads=("model.name",), inputs=("p",), label=lambda c: "t")
S2 = Stage(name="s2", run=_serve, reads=("model.name",), inputs=("p",), serves=("p",), label=lambda c: "t")
LAST = Stage(name="last", run=_plain, reads=("model.name",), inputs=("s2",), label=lambda c: "t")
STAGES = [P, S1, MID, S2, LAST]


def _run(tmp_path: Path, stages, rerun: tuple[str, ...] = ()) -> tuple[runner.BuildReport, str]:
    """``runner.run`` of ``stages`` (those named in ``rerun`` forced), with a run log of its own -> (report, log)."""
    from pipeline import errors

    cfg = hardware.compose(["model=tiny-qwen3", f"paths.root={tmp_path}"])
    planned = runner.plan(cfg, stages)
    for ps in planned:
        if ps.stage.name in rerun:
            ps.cached, ps.reason = False, "forced"
    log_path = tmp_path / f"run-{len(list(tmp_path.glob('run-*.log')))}.log"
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    errors.setup_logging(log_path)
    try:
        rep = runner.run(runner.BuildPlan(cfg, planned, None))
    finally:
        for h in root.handlers:
            h.close()
        root.handlers[:], root.level = saved, level
    return rep, log_path.read_text()


def test_two_stages_serving_one_output_share_one_server_stopped_when_no_later_stage_serves_it(tmp_path,
                                                                                               fake_triton):
    rep, log = _run(tmp_path, STAGES)
    repo = Path(next(r["output"] for r in rep.stages if r["stage"] == "p")).name
    # one start-up, by s1; s2 reuses it; it stops right after s2, before the last stage runs
    assert EVENTS == [f"start {repo}", "s1 on 127.0.0.1:9000 started_here=True", "mid runs",
                      "s2 on 127.0.0.1:9000 started_here=False", f"stop {repo}", "last runs"], EVENTS
    assert sh.startup_problems(log) == []
    counts = sh.startups(log)
    (what, path), n = next(iter(counts.items()))
    assert what == "tritonserver" and Path(path).name == repo
    assert (n["started"], n["reused"], n["stopped"]) == (1, 1, 1)
    # each stage keeps its own part of the server's log: the second one a header naming who started it, then
    # only what was written while it served
    s1 = Path(next(r["output"] for r in rep.stages if r["stage"] == "s1"))
    s2 = Path(next(r["output"] for r in rep.stages if r["stage"] == "s2"))
    assert (s1 / "server.log").read_text() == f"started {path}\nrequest from s1\n"  # it started it: all of it
    text = (s2 / "server.log").read_text()
    assert text.startswith("(shared: started by the s1 stage of this build run") and text.endswith(
        "\nrequest from s2\n") and "request from s1" not in text

    # negative control: a planted second start-up for the same repository is what the check reports
    started = next(ln for ln in log.splitlines() if "tritonserver started for" in ln)
    planted = log + started + "\n" + started.replace("started for", "stopped for") + "\n"
    assert sh.startup_problems(planted) == [f"tritonserver started 2 times for {path}"]
    unstopped = log + started + "\n"
    assert f"tritonserver for {path}: started 2, stopped 1" in sh.startup_problems(unstopped)


def test_without_the_runs_scope_each_stage_starts_its_own_and_the_check_fails(tmp_path, fake_triton):
    """The negative control of the sharing itself: stages that take a server outside the run's scope (each its
    own, as before) start it twice, and the run-log check says so."""
    def _own(ctx):
        with sh.triton(None, _serve_cfg(), ctx.inputs["p"], ctx.paths["store"] / "servers", ctx.stage.name) as lease:
            EVENTS.append(f"{ctx.stage.name} started_here={lease.started}")
        return {"ok": True}

    a = Stage(name="s1", run=_own, reads=("model.name",), inputs=("p",), label=lambda c: "t")
    b = Stage(name="s2", run=_own, reads=("model.name",), inputs=("p",), label=lambda c: "t")
    rep, log = _run(tmp_path, [P, a, b])
    repo = Path(next(r["output"] for r in rep.stages if r["stage"] == "p")).name
    assert EVENTS == [f"start {repo}", "s1 started_here=True", f"stop {repo}", f"start {repo}",
                      "s2 started_here=True", f"stop {repo}"]
    assert len(sh.startup_problems(log)) == 1 and "started 2 times" in sh.startup_problems(log)[0]


def test_a_cached_stage_starts_nothing_and_a_lone_server_stops_after_its_stage(tmp_path, fake_triton):
    _run(tmp_path, STAGES)
    EVENTS.clear()
    rep, log = _run(tmp_path, STAGES)  # nothing changed
    assert {r["status"] for r in rep.stages} == {"cached"} and EVENTS == [] and sh.startups(log) == {}
    # s1 forced, s2 cached: the server s1 started stops right after it (no stage left serves the repository)
    EVENTS.clear()
    rep, log = _run(tmp_path, STAGES, rerun=("s1",))
    repo = Path(next(r["output"] for r in rep.stages if r["stage"] == "p")).name
    assert EVENTS == [f"start {repo}", "s1 on 127.0.0.1:9001 started_here=True", f"stop {repo}"]


def test_a_server_that_died_between_stages_is_replaced_not_reused(tmp_path, fake_triton):
    def _kill(ctx):
        fake_triton[-1].dead = True
        EVENTS.append("killed")
        (ctx.out / "x.txt").write_text("x")
        return {"ok": True}

    killer = Stage(name="mid", run=_kill, reads=("model.name",), inputs=("p",), label=lambda c: "t")
    rep, log = _run(tmp_path, [P, S1, killer, S2])
    repo = Path(next(r["output"] for r in rep.stages if r["stage"] == "p")).name
    assert EVENTS == [f"start {repo}", "s1 on 127.0.0.1:9000 started_here=True", "killed", f"stop {repo}",
                      f"start {repo}", "s2 on 127.0.0.1:9001 started_here=True", f"stop {repo}"]


def test_a_failed_stage_still_stops_the_runs_server(tmp_path, fake_triton):
    def _fail(ctx):
        with sh.triton(ctx.shared, _serve_cfg(), ctx.inputs["p"], ctx.paths["store"] / "servers", "s1"):
            raise RuntimeError("boom")

    bad = Stage(name="s1", run=_fail, reads=("model.name",), inputs=("p",), serves=("p",), label=lambda c: "t")
    with pytest.raises(RuntimeError, match="boom"):
        _run(tmp_path, [P, bad, S2])
    assert EVENTS[0].startswith("start ") and EVENTS[-1].startswith("stop ") and len(EVENTS) == 2


def test_front_end_settings_key_is_the_same_for_the_bench_and_the_evaluation(tmp_path, monkeypatch):
    """The bench's view of serve.openai holds five keys, the evaluation's all of them: both give the front end the
    same settings (so it is shared); another limit gives other settings (a front end of its own)."""
    from omegaconf import OmegaConf

    import pipeline.serving.model as served_model
    from pipeline.stages import bench, evaluate

    class _Served:
        name = "tiny-qwen3"

    monkeypatch.setattr(served_model, "load", lambda repo, name=None, load_tokenizer=True: _Served())
    cfg = hardware.compose(["model=tiny-qwen3"])
    views = [runner.stage_config(cfg, st).serve.openai for st in (bench.STAGE, evaluate.STAGE)]
    assert set(views[0]) < set(views[1])
    a, b = (sh.front_settings(v, tmp_path) for v in views)
    assert a == b and a["port"] == 0 and a["model_name"] == "tiny-qwen3"
    other = OmegaConf.merge(OmegaConf.to_container(views[1]), {"limits": {"max_tokens": 7}})
    assert sh.front_settings(other, tmp_path) != a
