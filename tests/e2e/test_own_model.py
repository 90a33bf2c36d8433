"""``build model.source=DIR model.name=NAME`` on a local checkpoint of one's own, offline, end to end: the
checkpoint is the tiny synthetic model's fetched output (config.json, safetensors, tokenizer) copied to a plain
directory, as a user's own fine-tune would be. Its name, shape and tokenizer come from the checkpoint; a shape that
disagrees with its config.json is refused by plan before anything runs."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import TINY, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture()
def own_ckpt(tiny_build, tmp_path):
    src = next(tiny_build.glob(".store/tiny-qwen3-fetch-*/manifest.json")).parent
    dst = tmp_path / "checkpoints" / "my-finetune"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("manifest.json"))
    for p in dst.rglob("*"):
        p.chmod(0o644)
    return dst


def _owned(d: Path) -> dict[str, tuple[int, int, bytes]]:
    """Each file's mode, link count and bytes: what a build must leave as it found it."""
    return {p.relative_to(d).as_posix(): (p.stat().st_mode, p.stat().st_nlink, p.read_bytes())
            for p in sorted(d.rglob("*")) if p.is_file()}


def _built(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.parts[len(root.parts)] in (".store", "engines", "triton_repo", "bundles", "published")
            and "digests" not in p.parts and "locks" not in p.parts}


def test_build_of_a_local_checkpoint_runs_end_to_end_offline(own_ckpt, tmp_path):
    """... and leaves the user's checkpoint as it was: modes, link counts and bytes; an in-place edit of it after
    the build changes no built artifact, and `outdated` names the changed source file."""
    bench = [a for a in TINY if a.startswith(("bench.", "eval."))]
    root = tmp_path / "root"
    (own_ckpt / "model.safetensors").chmod(0o600)
    before = _owned(own_ckpt)
    assert {v[1] for v in before.values()} == {1}
    args = (f"model.source={own_ckpt}", "model.name=acme-chat", "quant.gate=warn", "quant.calib.dataset=builtin",
            *bench)
    proc = run_cli("build", *args, root=root)  # cli_env: HF_HUB_OFFLINE=1
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _owned(own_ckpt) == before
    os.link(own_ckpt / "config.json", tmp_path / "alias.json")  # negative control: an alias is seen
    assert _owned(own_ckpt) != before
    (tmp_path / "alias.json").unlink()
    built = _built(root)
    assert any(k.endswith("tokenizer.json") for k in built) and any(k.startswith("published/") for k in built)
    tok = own_ckpt / "tokenizer.json"
    with open(tok, "r+b") as f:  # an edit in place (same inode), as an editor saving over the file might
        f.seek(0, os.SEEK_END)
        f.write(b"\n")
    assert _built(root) == built
    proc = run_cli("outdated", "--entry", *args, root=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"outdated: model.source={own_ckpt} changed since v"), proc.stdout
    assert "tokenizer.json differ from the built copy" in proc.stdout, proc.stdout
    doc = json.loads(next(root.glob("bundles/acme-chat.fp8-kvfp8.cpu.reference-publish-*/bundle.json")).read_text())
    assert doc["model"] == {"name": "acme-chat", "source": str(own_ckpt), "revision": None}
    assert doc["recipe"]["quantize"]["model"]["shape"]["num_layers"] == 2  # from its config.json, not smollm2's 30
    assert doc["recipe"]["bench"]["model"]["checks"] == []  # smollm2's answer check is not run on other weights
    assert list(root.glob("published/acme-chat/fp8-kvfp8/cpu/reference/v*/bundle.json"))


def test_plan_refuses_a_shape_that_disagrees_with_the_checkpoint(own_ckpt, tmp_path):
    proc = run_cli("plan", f"model.source={own_ckpt}", "model.shape.num_layers=30", root=tmp_path / "root")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: model.shape.num_layers=30 but {own_ckpt}/config.json says 2: drop model.shape for a checkpoint of "
        f"your own (it is read from its config.json) or give the right values"]
    assert not (tmp_path / "root" / ".store").exists() or not any((tmp_path / "root" / ".store").glob("*-fetch-*"))


def test_a_truncated_weights_file_is_named_and_nothing_is_cached(own_ckpt, tmp_path):
    f = own_ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    root = tmp_path / "root"
    proc = run_cli("build", f"model.source={own_ckpt}", "quant.calib.dataset=builtin", root=root)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {own_ckpt}: model.safetensors is damaged:"), lines
    assert not list(root.glob(".store/*fetch*"))
