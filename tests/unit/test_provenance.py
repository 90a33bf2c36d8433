"""benchmarks/_provenance.py: a raw record's ``commit_matched`` is the commit whose source files have the run's digest,
found in this checkout's history; the ``commit`` the script saw stays as it was."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prov():
    from benchmarks import _provenance

    return _provenance


def test_annotate_finds_the_commit_with_the_runs_files_and_keeps_what_the_script_saw(prov, tmp_path):
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    head = head.stdout.strip()
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"commit": "1e1fb7d", "dirty": True, "source_sha256": prov.commit_sha256(head)}))
    assert prov.annotate(run, "carried build", max_count=1) == head
    doc = json.loads(run.read_text())
    assert doc["commit"] == "1e1fb7d" and doc["dirty"] is True  # as the script saw it
    assert doc["commit_matched"] == head and doc["note"] == "carried build"
    # negative control: files that no commit has match nothing
    run.write_text(json.dumps({"commit": "1e1fb7d", "source_sha256": "0" * 64}))
    assert prov.annotate(run, max_count=2) is None
    assert json.loads(run.read_text())["commit_matched"] is None


def test_the_commit_label_says_which_commit_the_files_were_and_whether_they_differed(prov):
    sha, other = "a" * 40, "b" * 40
    assert prov.commit_label({"commit": sha, "dirty": False}) == "a" * 10
    assert prov.commit_label({"commit": sha, "dirty": True}) == "a" * 10 + " (uncommitted changes)"
    assert prov.commit_label({"commit": sha, "dirty": True, "commit_matched": other}) == (
        "b" * 10 + " (the files that ran have its source digest; the copy's git metadata read " + "a" * 10
        + " with uncommitted changes)")
    assert prov.commit_label({"commit": "abc+dirty"}) == "abc+dirty (uncommitted changes in the tree that ran)"
    assert prov.commit_label({"commit": "46a9f49-dirty"}) == "46a9f49 (uncommitted changes)"  # the older mark
    assert prov.commit_label({"commit": None}) == "?"
