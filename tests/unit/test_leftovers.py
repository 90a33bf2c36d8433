"""Nothing left behind: the temp directory of a killed build is removed by the next run or by ``gc``, at any age,
while one that a running build owns (its lock is held) stays."""
from __future__ import annotations

import subprocess
import sys

from pipeline import fleet, hardware, store


def _hold_lock(path) -> subprocess.Popen:
    code = ("import sys, time; from filelock import FileLock; l = FileLock(sys.argv[1]); l.acquire(); "
            "print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_orphaned_temp_directories_go_and_owned_ones_stay(tmp_path):
    root = tmp_path / ".store"
    killed = root / ".m-fetch-aaaaaaaaaaaa.tmp-4242-abcdef"
    swapped = root / ".m-quantize-bbbbbbbbbbbb.old-123456"
    running = root / ".m-bench-cccccccccccc.tmp-4343-fedcba"
    for d in (killed, swapped, running):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "weights.bin").write_bytes(b"x" * 10)
    done = root / "m-fetch-aaaaaaaaaaaa"  # a finished output is never an orphan
    done.mkdir()
    locks = tmp_path / "locks"
    locks.mkdir()
    holder = _hold_lock(store.lock_path(root / "m-bench-cccccccccccc", locks))
    try:
        assert sorted(store.orphans([root], locks)) == sorted([killed, swapped])
        assert sorted(store.remove_orphans([root], locks)) == sorted([killed, swapped])
        assert not killed.exists() and not swapped.exists() and running.is_dir() and done.is_dir()
    finally:
        holder.kill()
        holder.wait()
    assert store.orphans([root], locks) == [running]  # its build is gone now


def test_gc_removes_a_killed_builds_temp_directory_of_any_age(tmp_path):
    cfg = hardware.compose(["model=tiny-qwen3", f"paths.root={tmp_path}"])
    tmp = tmp_path / "engines" / ".x-build-aaaaaaaaaaaa.tmp-99-abcdef"
    tmp.mkdir(parents=True)
    (tmp / "rank0.engine").write_bytes(b"0" * 100)
    report = fleet.gc(cfg, max_age_days=1000, dry_run=True)
    assert str(tmp) in report["removed"] and tmp.is_dir()
    report = fleet.gc(cfg, max_age_days=1000)
    assert str(tmp) in report["removed"] and report["freed_bytes"] >= 100 and not tmp.exists()
