"""A killed build's temp stage directory is removed by the next run, even when every stage of that run is
cached (the killed stage's lock is free)."""
from __future__ import annotations

import shutil

from tests.conftest import TINY, run_cli, statuses


def test_the_next_run_removes_a_killed_builds_temp_directory(tiny_build, tmp_path):
    root = tmp_path / "r"
    shutil.copytree(tiny_build, root)
    fetch = next(root.glob(".store/tiny-qwen3-fetch-*/manifest.json")).parent
    left = fetch.parent / f".{fetch.name}.tmp-4242-abcdef"  # what SIGTERM during fetch leaves
    (left / "x").mkdir(parents=True)
    proc = run_cli("build", *TINY, root=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert set(statuses(root).values()) == {"cached"}
    assert not left.exists()
