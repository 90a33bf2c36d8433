"""The bench against the real server: aiperf's export of every level (aiperf's own loader reads it where aiperf is
installed), and the llmapi layout benched through its own ``tensorrt_llm`` entry point on the reference runtime."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import TINY, report, run_cli
from tests.unit.test_bench import aiperf_schema_problems

pytestmark = pytest.mark.e2e


def _bench_out(root: Path) -> Path:
    return next(Path(r["output"]) for r in report(root)["stages"] if r["stage"] == "bench")


def _level_dirs(out: Path, doc: dict) -> list[tuple[Path, dict]]:
    return [(out / "aiperf" / w / f"concurrency_{lv['concurrency']}", lv)
            for w, r in doc["workloads"].items() for lv in r["levels"]]


def test_every_level_has_aiperfs_export(tiny_build):
    out = _bench_out(tiny_build)
    doc = json.loads((out / "bench.json").read_text())
    dirs = _level_dirs(out, doc)
    assert sorted(p.relative_to(out).as_posix() for p in out.glob("aiperf/*/concurrency_*")) == \
        sorted(d.relative_to(out).as_posix() for d, _ in dirs)
    for d, lv in dirs:
        assert aiperf_schema_problems(d) == [], d
        lines = (d / "profile_export.jsonl").read_text().splitlines()
        assert len(lines) == lv["request_count"]
        agg = json.loads((d / "profile_export_aiperf.json").read_text())
        assert agg["output_token_throughput"]["avg"] == pytest.approx(lv["output_token_throughput"]["avg"])
        assert agg["time_to_first_token"]["p95"] == pytest.approx(lv["time_to_first_token"]["p95"])
        assert sum(json.loads(x)["metrics"]["output_sequence_length"]["value"] for x in lines) == \
            round(lv["output_sequence_length"]["avg"] * lv["request_count"])


@pytest.mark.skipif(importlib.util.find_spec("aiperf") is None,
                    reason="aiperf is not installed (aiperf 0.13 pins huggingface_hub<2, rich 14.1, psutil 7.0 and "
                           "pillow 12.3, which would downgrade this environment); the schema test above covers it")
def test_aiperfs_own_loader_reads_every_level(tiny_build, tmp_path):
    from aiperf.plot.core.data_loader import DataLoader
    from aiperf.plot.core.mode_detector import ModeDetector

    out = _bench_out(tiny_build)
    doc = json.loads((out / "bench.json").read_text())
    loader = DataLoader()
    for d, lv in _level_dirs(out, doc):
        run = loader.load_run(d)
        assert run.metadata.concurrency == lv["concurrency"] and run.metadata.model == doc["model"]
        assert len(run.requests) == lv["request_count"]
        assert run.get_metric("output_token_throughput")["avg"] == pytest.approx(lv["output_token_throughput"]["avg"])
    mode, runs = ModeDetector().detect_mode([out / "aiperf" / "chat"])
    assert mode.name == "MULTI_RUN" and len(runs) == len(doc["workloads"]["chat"]["levels"])
    # negative control: a record without its end time is refused by aiperf's loader
    bad = tmp_path / "concurrency_1"
    shutil.copytree(out / "aiperf" / "chat" / "concurrency_1", bad)
    rec = json.loads((bad / "profile_export.jsonl").read_text().splitlines()[0])
    rec["metadata"].pop("request_end_ns")
    (bad / "profile_export.jsonl").write_text(json.dumps(rec) + "\n")
    with pytest.raises(Exception, match="request_end_ns|No valid records"):  # aiperf 0.13 drops it, then finds none
        loader.load_run(bad)


@pytest.mark.slow
def test_llmapi_layout_is_benched_through_its_tensorrt_llm_model(tiny_build, tmp_path):
    """The reference runtime behind the llmapi layout: the bench sends upstream's LLM-API tensors (1-D, streaming,
    sampling_param_max_tokens) to ``tensorrt_llm``; a BLS choice is refused before any work."""
    root = tmp_path / "l"
    shutil.copytree(tiny_build, root)
    refused = run_cli("build", *TINY, "serve.layout=llmapi", "bench.model=tensorrt_llm_bls", root=root)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: bench.model=tensorrt_llm_bls: the llmapi layout has no such entry point (it has: tensorrt_llm); "
        "set bench.model=auto")

    # with the regression gate on and an unreachable publish.dest: the verdict says no baseline, never "pass"
    proc = run_cli("build", *TINY, "serve.layout=llmapi", "until=bench", "publish.dest=nosuchproto://bucket/x",
                   "bench.gates.regression_pct=25", "bench.gates.regression_on_cpu=true", root=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = _bench_out(root)
    doc = json.loads((out / "bench.json").read_text())
    assert (doc["model"], doc["layout"], doc["decoupled"]) == ("tensorrt_llm", "llmapi", True)
    assert doc["gates"]["verdict"] == "no-baseline" and doc["gates"]["baseline"]["status"] == "unreachable"
    assert "Gate: **no-baseline**" in (out / "bench.md").read_text()
    summary = (root / "reports" / "tiny-qwen3.fp8-kvfp8.cpu.reference.md").read_text()
    assert "Bench gate: no-baseline (entry point tensorrt_llm). Regression baseline: **unreachable**: " \
           "publish.dest=nosuchproto://bucket/x" in summary
    for w in doc["workloads"].values():
        for lv in w["levels"]:
            assert lv["error_count"] == 0 and lv["output_token_throughput"]["avg"] > 0
            assert lv["time_to_first_token"]["p50"] > 0
    measured = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert all(r["error"] is None for r in measured) and sum(r["output_tokens"] for r in measured) > 0
    for d, _ in _level_dirs(out, doc):
        assert aiperf_schema_problems(d) == []
        body = json.loads((d / "profile_export_aiperf.json").read_text())["input_config"]["endpoint"]
        assert body["path"] == "/v2/models/tensorrt_llm/generate_stream"
        assert '"sampling_param_max_tokens"' in body["template"]["body"] and '"streaming": true' in \
            body["template"]["body"]
