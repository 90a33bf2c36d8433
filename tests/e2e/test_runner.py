"""The stage runner across processes: two concurrent builds of one output build it once (file lock), the other
reuses it. The in-process runner tests are in ``tests/unit/test_runner.py``."""
from __future__ import annotations

import multiprocessing as mp
import time

from pipeline import hardware

from pipeline.runner import executor as runner
from pipeline.runner.contract import Stage


def _slow(ctx):
    time.sleep(1.5)
    (ctx.out / "n.txt").write_text(str(time.time()))
    return {}


def _concurrent(root: str, q, barrier):
    cfg = hardware.compose(["model=tiny-qwen3", f"paths.root={root}"])
    st = Stage(name="a", run=_slow, reads=(), label=lambda c: "t")
    planned = {p.stage.name: p for p in runner.plan(cfg, [st])}
    barrier.wait(60)  # both have planned "no output yet" before either executes
    runner.execute(cfg, planned["a"], planned)
    q.put(planned["a"].reason)


def test_two_processes_build_once_the_other_waits_and_reuses(tmp_path):
    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_concurrent, args=(str(tmp_path), q, barrier)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    reasons = sorted(q.get(timeout=5) for _ in procs)
    assert reasons == ["cached (built by a concurrent run)", "no output yet"]
