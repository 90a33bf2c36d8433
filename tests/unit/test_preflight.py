"""`serve`'s preflight and `verify`'s `loadable` check: both use lint's repository rules
(:func:`pipeline.triton.lint.repository_problems`), so neither passes what `lint` rejects, and each failure names the
file. The bundles are :mod:`tests.helpers.bundles`' small ones with a two-model repository written into them."""
from __future__ import annotations

import hashlib
import json

import pytest

from pipeline import bundle
from pipeline.cli import serve
from pipeline.errors import UserError
from pipeline.triton import lint

STEP = """name: "step"
backend: "python"
max_batch_size: {mbs}
input [ {{ name: "x" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "y" data_type: TYPE_INT32 dims: [ 1 ] }} ]
"""
ENSEMBLE = """name: "ensemble"
platform: "ensemble"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [ { model_name: "step" model_version: -1
  input_map { key: "x" value: "x" } output_map { key: "y" value: "y" } } ] }
"""


def _bundle(tmp_path, *, step_mbs: int = 8, step_text: str | None = None):
    from tests.helpers.bundles import make_bundle

    out = make_bundle(tmp_path)
    repo = out / "triton_repo"
    files = {"ensemble/config.pbtxt": ENSEMBLE, "step/config.pbtxt": step_text or STEP.format(mbs=step_mbs),
             "step/1/model.py": "# the model\n"}
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    doc = json.loads((out / "bundle.json").read_text())
    doc["files"] = [f for f in doc["files"] if not f["path"].startswith("triton_repo/")]
    for p in sorted(repo.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            doc["files"].append({"path": p.relative_to(out).as_posix(), "size": len(data),
                                 "sha256": hashlib.sha256(data).hexdigest(), "mtime_ns": p.stat().st_mtime_ns})
    doc["dirs"] = bundle.store_dirs(out)
    (out / "bundle.json").chmod(0o644)
    (out / "bundle.json").write_text(json.dumps(doc))
    return out


def _cfg(tmp_path):
    from omegaconf import OmegaConf

    return OmegaConf.create({"paths": {"root": str(tmp_path), "store": str(tmp_path / ".store")}})


def _loadable(out) -> tuple:
    return next(c for c in bundle.verify(str(out)) if c[0] == "loadable")


def test_a_sound_bundle_passes_preflight_verify_and_lint(tmp_path):
    out = _bundle(tmp_path)
    serve.preflight(out / "triton_repo", _cfg(tmp_path))
    assert _loadable(out)[1] is True
    files, dirs = lint.tree_of(out / "triton_repo")
    assert lint.repository_problems(files, dirs, lambda r: (out / "triton_repo" / r).read_text()) == []


def test_an_unparseable_config_is_named_by_preflight_and_verify(tmp_path):
    out = _bundle(tmp_path, step_text='name: "step"\nbackend: "python"\nmax_batch_size: [oops\n')
    with pytest.raises(UserError, match=r"triton_repo/step/config\.pbtxt"):
        serve.preflight(out / "triton_repo", _cfg(tmp_path))
    name, ok, detail = _loadable(out)
    assert ok is False and "triton_repo/step/config.pbtxt" in detail, detail


def test_an_ensemble_larger_than_its_step_fails_verify_as_lint(tmp_path):
    out = _bundle(tmp_path, step_mbs=4)
    name, ok, detail = _loadable(out)
    assert ok is False and "max_batch_size 8 exceeds step model \"step\"'s 4" in detail, detail
    with pytest.raises(UserError, match=r"triton_repo/ensemble/config\.pbtxt: max_batch_size 8 exceeds"):
        serve.preflight(out / "triton_repo", _cfg(tmp_path))


def test_a_truncated_file_is_named_before_triton_starts(tmp_path):
    out = _bundle(tmp_path)
    f = out / "checkpoint" / "model.safetensors"
    f.chmod(0o644)
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(UserError, match=r"checkpoint/model\.safetensors: \d+ bytes, bundle\.json lists \d+"):
        serve.preflight(out / "triton_repo", _cfg(tmp_path))
    g = out / "triton_repo" / "step" / "1" / "model.py"  # same size, other bytes
    f.write_bytes(f.read_bytes() + b"\0" * 100)
    with pytest.raises(UserError, match=r"(?s)^(?!.*safetensors: \d+ bytes).*step/1/model\.py: sha256 differs"):
        g.write_text("# the modeL\n")
        serve.preflight(out / "triton_repo", _cfg(tmp_path))


def test_a_stray_file_or_directory_is_named_by_preflight_as_verify_names_it(tmp_path):
    """The exact tree `verify` checks: a file the manifest does not list is refused before Triton starts."""
    out = _bundle(tmp_path)
    serve.preflight(out / "triton_repo", _cfg(tmp_path))  # control: the sound bundle passes
    (out / "triton_repo" / "step" / "1" / "stray.py").write_text("print('not listed')\n")
    with pytest.raises(UserError, match=r"triton_repo/step/1/stray\.py is not in the manifest"):
        serve.preflight(out / "triton_repo", _cfg(tmp_path))
    assert next(c for c in bundle.verify(str(out)) if c[0] == "tree")[1] is False  # verify says the same


def test_the_work_directories_of_serves_that_are_gone_are_removed_and_no_other(tmp_path):
    """What a kill -9 of serve leaves in the temp directory (pipeline-serve-<pid>-*) is removed by the next serve when
    no process has that pid, or the one that has it started after the directory was last written (the pid was
    reused); a live owner's directory, and anything not named so, stay."""
    import os
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"pipeline-serve-{dead.pid}-abc_123"
    reused = tmp_path / f"pipeline-serve-{os.getpid()}-old"  # this process started after the directory was written
    live = tmp_path / f"pipeline-serve-{os.getpid()}-mine"
    others = [tmp_path / "pipeline-serve-notapid", tmp_path / f"pipeline-serve-{dead.pid}"]
    for d in (gone, reused, live, *others):
        d.mkdir()
        (d / "server.log").write_text("x")
    os.utime(reused, (1_000_000_000, 1_000_000_000))  # 2001
    as_file = tmp_path / f"pipeline-serve-{dead.pid}-file"
    as_file.write_text("not a directory")
    assert serve.remove_stale_work_dirs(tmp_path) == sorted([gone, reused])
    assert not gone.exists() and not reused.exists()
    assert live.is_dir() and all(d.is_dir() for d in others) and as_file.is_file()
