"""End to end through the real CLI: tiny-qwen3 through every stage, real ModelOpt, real tritonserver, real
tritonclient. Covers the outputs, a cache hit, invalidation, force, until, a failing config, hf:// via a local
stand-in for the Hub, and a multirun sweep."""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest

from pipeline.stages import STAGE_NAMES
from tests.conftest import TINY, cli_env, report, run_cli, statuses

pytestmark = pytest.mark.e2e
LABEL = "tiny-qwen3.fp8-kvfp8.cpu.reference"


def _outputs(root: Path) -> dict[str, Path]:
    return {r["stage"]: Path(r["output"]) for r in report(root)["stages"]}


def test_every_stage_ran_and_left_a_complete_manifest(tiny_build):
    assert statuses(tiny_build) == {s: "ran" for s in STAGE_NAMES}
    for stage, out in _outputs(tiny_build).items():
        m = json.loads((out / "manifest.json").read_text())
        assert m["stage"] == stage and len(m["fingerprint"]) == 64
        for key in ("config", "versions", "host", "wall_s", "peak_rss_mb", "fingerprint_parts"):
            assert key in m, (stage, key)
        assert m["files"], stage
        for f in m["files"]:  # every listed file is there with the recorded size and sha256
            p = out / f["path"]
            assert p.stat().st_size == f["size"]
            assert hashlib.sha256(p.read_bytes()).hexdigest() == f["sha256"], p
    assert not list(tiny_build.rglob(".*.tmp-*")), "no temp dirs left behind"


def test_quantize_exports_fp8_with_fp8_kv_and_passes_the_export_check(tiny_build):
    out = _outputs(tiny_build)["quantize"]
    hq = json.loads((out / "checkpoint" / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "FP8" and hq["kv_cache_quant_algo"] == "FP8"
    acc = json.loads((out / "accuracy.json").read_text())
    assert acc["accuracy"]["export_check"] == "pass"
    assert acc["calibration"]["sha256"] == hashlib.sha256(
        (Path(__file__).parents[2] / "pipeline" / "data" / "corpus.txt").read_bytes()).hexdigest()
    m = json.loads((out / "manifest.json").read_text())
    assert m["result"]["quant_algo"] == "FP8" and m["result"]["exclude_modules"]


def test_package_renders_every_config_and_bench_measured_both_levels(tiny_build):
    from pipeline.triton.render import parse_model_config

    repo = _outputs(tiny_build)["package"]
    for name in ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing"):
        text = (repo / name / "config.pbtxt").read_text()
        assert "${" not in text
        assert parse_model_config(text).name == name
    assert parse_model_config((repo / "tensorrt_llm" / "config.pbtxt").read_text()).model_transaction_policy.decoupled
    bench = json.loads((_outputs(tiny_build)["bench"] / "bench.json").read_text())
    assert [lv["concurrency"] for lv in bench["workloads"]["chat"]["levels"]] == [1, 2]
    for lv in bench["workloads"]["chat"]["levels"] + bench["workloads"]["rag"]["levels"]:
        assert lv["error_count"] == 0 and lv["request_count"] == 3  # max(requests_per_level, concurrency)
        assert lv["time_to_first_token"]["p50"] > 0 and lv["request_latency"]["p95"] >= lv["request_latency"]["p50"]
        assert lv["output_token_throughput"]["avg"] > 0


def test_bundle_lists_every_file_with_its_sha256(tiny_build):
    bundle = _outputs(tiny_build)["publish"]
    doc = json.loads((bundle / "bundle.json").read_text())
    listed = {f["path"]: f for f in doc["files"]}
    on_disk = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()} - {"bundle.json",
                                                                                                "manifest.json"}
    assert set(listed) == on_disk
    for rel in ("checkpoint/hf_quant_config.json", "triton_repo/ensemble/config.pbtxt", "reports/bench.json",
                "reports/quantize.md", "manifests/quantize.json"):
        assert rel in listed
        assert hashlib.sha256((bundle / rel).read_bytes()).hexdigest() == listed[rel]["sha256"]
    assert set(doc["lineage"]) == {"fetch", "quantize", "build", "package", "bench", "eval_baseline", "evaluate"}
    assert doc["quant"]["quant_algo"] == "FP8"


def test_summary_report_has_stages_sizes_bench_and_paths(tiny_build):
    md = (tiny_build / "reports" / f"{LABEL}.md").read_text()
    for stage in STAGE_NAMES:
        assert f"| {stage} | ran |" in md
    assert "TTFT p50" in md and str(tiny_build) in md


def _copy_build(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    # manifests record absolute paths of inputs; a copied tree must be re-planned from its own paths
    return dst


@pytest.mark.slow  # ~80 s on 2 cores: a second full pipeline after a quant change
def test_rerun_is_a_noop_and_a_quant_change_reruns_only_downstream(tiny_build, tmp_path):
    root = tmp_path / "b"
    shutil.copytree(tiny_build, root)
    t0 = time.perf_counter()
    proc = run_cli("build", *TINY, root=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.perf_counter() - t0 < 20
    assert statuses(root) == {s: "cached" for s in STAGE_NAMES}
    from pipeline.runner import leases as shared

    assert shared.startups(Path(report(root)["log"]).read_text()) == {}  # a cached stage starts no server

    plan = run_cli("plan", "--json", *TINY, "quant.calib.num_samples=8", root=root)
    doc = json.loads(plan.stdout)
    cached = {s["stage"]: s["cached"] for s in doc["stages"]}
    # the task baseline serves the unquantized checkpoint: a calibration change leaves it cached
    assert cached == {"fetch": True, "quantize": False, "build": False, "package": False, "bench": False,
                      "eval_baseline": True, "evaluate": False, "publish": False}

    proc = run_cli("build", *TINY, "quant.calib.num_samples=8", "until=quantize", root=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert statuses(root) == {"fetch": "cached", "quantize": "ran"}


def test_force_reruns_the_stage_and_identical_output_keeps_downstream_cached(tiny_build, tmp_path):
    root = tmp_path / "f"
    shutil.copytree(tiny_build, root)
    proc = run_cli("build", *TINY, "force=[quantize]", "until=package", root=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    st = statuses(root)
    assert st["fetch"] == "cached" and st["quantize"] == "ran"
    # CPU calibration is deterministic: the re-run export is byte-identical, so build and package stay cached
    assert st["build"] == "cached" and st["package"] == "cached"


def test_a_damaged_output_is_rebuilt(tiny_build, tmp_path):
    root = tmp_path / "d"
    shutil.copytree(tiny_build, root)
    out = _outputs(root)["build"]
    out = root / out.relative_to(tiny_build)
    victim = next((out / "engine").glob("*.safetensors"))
    victim.unlink()
    victim.write_bytes(b"truncated")
    doc = json.loads(run_cli("plan", "--json", *TINY, root=root).stdout)
    build = next(s for s in doc["stages"] if s["stage"] == "build")
    assert not build["cached"] and "damaged" in build["reason"]


def test_hf_source_through_a_local_stand_in_for_the_hub(tiny_build, tmp_path):
    """No hub is reachable here: a pre-populated huggingface_hub cache (offline mode) stands in for the Hub."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    hub = tmp_path / "hf-home" / "hub"
    snap = hub / "models--acme--tiny" / "snapshots" / sha
    fetched = _outputs(tiny_build)["fetch"]
    shutil.copytree(fetched, snap, ignore=shutil.ignore_patterns("manifest.json"))
    (hub / "models--acme--tiny" / "refs").mkdir(parents=True)
    (hub / "models--acme--tiny" / "refs" / "main").write_text(sha)
    root = tmp_path / "hf"
    sentinel = "hf_SENTINEL-not-a-real-token-000000"
    env = cli_env(root, HF_HOME=str(tmp_path / "hf-home"), HF_TOKEN=sentinel)
    proc = run_cli("build", *TINY, f"model.source=hf://acme/tiny@{sha}", "until=fetch", root=root, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = json.loads((_outputs_label(root, "fetch") / "manifest.json").read_text())
    assert m["result"]["resolved_sha"] == sha and m["result"]["repo"] == "acme/tiny"
    for p in root.rglob("*"):
        if p.is_file():
            assert sentinel.encode() not in p.read_bytes(), p
    assert sentinel not in proc.stdout + proc.stderr

    missing = run_cli("build", *TINY, "model.source=hf://acme/other@main", "until=fetch", root=root, env=env)
    assert missing.returncode == 2 and "error: " in missing.stderr and "Traceback" not in missing.stderr


def test_a_moved_hub_branch_changes_the_fetch_fingerprint(tiny_build, tmp_path):
    """``hf://...@main`` follows the branch: the commit it resolves to (here from the local cache standing in for the
    Hub, offline) is part of the fetch fingerprint, so a moved branch re-fetches and everything downstream rebuilds."""
    hub = tmp_path / "hf-home" / "hub" / "models--acme--tiny"
    fetched = _outputs(tiny_build)["fetch"]
    for sha in ("1" * 40, "2" * 40):
        shutil.copytree(fetched, hub / "snapshots" / sha, ignore=shutil.ignore_patterns("manifest.json"))
    (hub / "refs").mkdir()
    root = tmp_path / "b"
    env = cli_env(root, HF_HOME=str(tmp_path / "hf-home"))
    args = ("build", *TINY, "model.source=hf://acme/tiny@main", "until=fetch")
    plans = []
    for sha in ("1" * 40, "1" * 40, "2" * 40):
        (hub / "refs" / "main").write_text(sha)
        proc = run_cli(*args, root=root, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        m = json.loads((_outputs_label(root, "fetch") / "manifest.json").read_text())
        plans.append((statuses(root, HUB_LABEL)["fetch"], m["fingerprint"], m["result"]["resolved_sha"]))
    assert [p[0] for p in plans] == ["ran", "cached", "ran"]
    assert plans[0][1] == plans[1][1] != plans[2][1] and plans[2][2] == "2" * 40


HUB_LABEL = "tiny.fp8-kvfp8.cpu.reference"  # a model named by its source: hf://acme/tiny is "tiny"


def _outputs_label(root: Path, stage: str, label: str = HUB_LABEL) -> Path:
    return {r["stage"]: Path(r["output"]) for r in report(root, label)["stages"]}[stage]


@pytest.mark.slow  # a two-job sweep; the local fan-out's own tests are in test_targets.py (~18 s on 2 cores)
def test_multirun_sweeps_and_shares_fetch(tiny_build, tmp_path):
    root = tmp_path / "m"
    shutil.copytree(tiny_build, root)
    proc = run_cli("build", "-m", *TINY, "quant=none,fp8", "until=quantize", root=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert statuses(root, "tiny-qwen3.none-kvfp8.cpu.reference") == {"fetch": "cached", "quantize": "ran"}
    assert statuses(root, LABEL)["fetch"] == "cached"


def test_output_folders_list_only_outputs(tiny_build):
    """``ls engines/ triton_repo/ bundles/`` after a build shows the stage outputs alone: each entry is one output
    with its manifest, and the stage locks live in the stage store."""
    for name in ("engines", "triton_repo", "bundles"):
        entries = sorted((tiny_build / name).iterdir())
        assert entries, name
        for p in entries:
            assert p.is_dir() and (p / "manifest.json").is_file(), f"{p} is not a stage output"
    locks = [p.name for p in (tiny_build / ".store" / "locks").glob("*.lock")]
    assert any(n.startswith("tiny-qwen3.fp8-kvfp8.cpu.reference-build-") for n in locks), locks
