"""One console: a non-interactive build shows the project's own lines (one per step) and its summary, and nothing
else: no third-party progress frames, no deprecation chatter; the libraries' records are in the run log."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.console import console_problems

pytestmark = pytest.mark.e2e


def test_non_interactive_build_prints_only_the_projects_output(tiny_build_run):
    root, out = tiny_build_run
    text = out["stdout"] + out["stderr"]
    assert console_problems(text) == [], console_problems(text)
    for stage in ("fetch", "quantize", "build", "package", "bench", "publish"):
        assert f"▶ {stage} " in out["stderr"] and f"✓ {stage} " in out["stderr"], stage
    # progress on stderr, the summary (and how to serve the result) on stdout, so `build > summary.txt` keeps it
    assert "stages" in out["stdout"] and "total " in out["stdout"] and "stages" not in out["stderr"]
    assert "serve it: python -m pipeline serve " in out["stdout"] and "OpenAI API: http://" in out["stdout"]
    assert "▶ " not in out["stdout"]
    log = Path(re.search(r"log: (\S+\.log)", out["stderr"]).group(1))
    assert log.is_relative_to(root / ".store" / "logs")
    records = log.read_text()
    assert "stage quantize: ran" in records
    # the libraries' warnings are kept, in the run log (ModelOpt, torch and transformers all emit some here)
    assert re.search(r" WARNING (py\.warnings|transformers[\w.]*): ", records), records[-3000:]
