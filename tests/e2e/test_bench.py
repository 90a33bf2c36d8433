"""The bench against the real server: aiperf's own export of every level, run natively against the OpenAI front end
(aiperf's own loader reads it), and the llmapi layout benched through its own ``tensorrt_llm`` entry point on the
reference runtime."""
from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path

import pytest

from pipeline.stages import bench
from tests.conftest import TINY, report, run_cli

pytestmark = pytest.mark.e2e


def _bench_out(root: Path) -> Path:
    return next(Path(r["output"]) for r in report(root)["stages"] if r["stage"] == "bench")


@pytest.fixture(scope="module")
def aiperf_build(tiny_build, tmp_path_factory) -> Path:
    """The shared tiny build re-benched with aiperf's export on (``bench.aiperf=true``, the default outside the
    tests) at every level (``bench.aiperf_levels=all``, the default on GPUs) of the chat workload (each aiperf run
    starts its own services, ~20 s on 2 cores: one workload's levels show the export), published: the bench and
    publish stages re-run, the rest is cached."""
    root = tmp_path_factory.mktemp("aiperf") / "root"
    shutil.copytree(tiny_build, root)
    proc = run_cli("build", *TINY, "bench.aiperf=true", "bench.aiperf_levels=all", "bench.only=[chat]", root=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def _level_dirs(out: Path, doc: dict) -> list[tuple[Path, dict]]:
    return [(out / "aiperf" / w / f"concurrency_{lv['concurrency']}", lv)
            for w, r in doc["workloads"].items() for lv in r["openai_levels"]]


@pytest.mark.slow  # aiperf_build: an aiperf run per level, each starting its own services (~40 s on 2 cores)
def test_every_level_has_aiperfs_native_chat_export(aiperf_build, tmp_path):
    """Each level's aiperf export is aiperf's own run against the front end: its OpenAI chat endpoint type,
    streaming, no request template, the level's prompts, concurrency and request count; planted exports of the
    wrong endpoint type, not streamed, or templated are refused."""
    out = _bench_out(aiperf_build)
    doc = json.loads((out / "bench.json").read_text())
    assert doc["openai"]["aiperf"]["endpoint_type"] == "chat"
    dirs = _level_dirs(out, doc)
    bundle = next(Path(r["output"]) for r in report(aiperf_build)["stages"] if r["stage"] == "publish")
    measured = [r for r in map(json.loads, (out / "requests.jsonl").read_text().splitlines())
                if r["phase"] == "measure"]
    assert sorted(p.relative_to(out).as_posix() for p in out.glob("aiperf/*/concurrency_*")) == \
        sorted(d.relative_to(out).as_posix() for d, _ in dirs) and dirs
    for d, lv in dirs:
        w = d.parent.name
        n, conc = lv["request_count"], lv["concurrency"]
        exp = json.loads((d / "profile_export_aiperf.json").read_text())
        ep = exp["input_config"]["endpoint"]
        assert (ep["type"], ep["streaming"]) == ("chat", True) and "template" not in ep and "path" not in ep
        assert exp["aiperf_version"] == importlib.metadata.version("aiperf")
        assert exp["input_config"]["models"]["items"][0]["name"] == "tiny-qwen3"
        prof = next(p for p in exp["input_config"]["phases"] if p["name"] == "profiling")
        assert (prof["type"], prof["concurrency"], prof["requests"]) == ("concurrency", conc, n)
        # the same prompts, greedy, as the level's OpenAI rows: a request answered with no text there (the end
        # token first) is the one aiperf records as an error ("no responses with actual content")
        empty = sum(1 for r in measured if (r["path"], r["workload"], r["concurrency"]) == ("openai", w, conc)
                    and not r["output_tokens"])
        assert exp["request_count"]["avg"] == n - empty
        assert (exp.get("error_request_count") or {"avg": 0})["avg"] == empty == lv["aiperf"]["error_count"]
        assert all("No responses with actual content" in e["error_details"]["message"]
                   for e in exp.get("error_summary") or [])
        assert exp["time_to_first_token"]["p50"] > 0 and exp["output_token_throughput"]["avg"] > 0
        # what aiperf sent: OpenAI chat requests, streamed with usage, the workload's output length, greedy
        payloads = [p for s in json.loads((d / "inputs.json").read_text())["data"] for p in s["payloads"]]
        assert len(payloads) == n
        for p in payloads:
            assert p["model"] == "tiny-qwen3" and p["stream"] is True
            assert p["stream_options"] == {"include_usage": True} and p["temperature"] == 0
            assert p["max_completion_tokens"] == doc["workloads"][w]["max_tokens"]
            assert [m["role"] for m in p["messages"]] == ["user"]
            assert p["messages"][0]["content"].startswith("Continue this text: ")  # the raw prompt, not rendered
        records = [json.loads(x) for x in (d / "profile_export.jsonl").read_text().splitlines()]
        ok = [r for r in records if not r.get("error")]
        assert len(records) == n and len(ok) == n - empty
        assert all(r["metrics"]["time_to_first_token"]["value"] > 0 for r in ok)
        assert lv["aiperf"]["request_count"] == n - empty
        assert bench.aiperf.export_problems(d, True, n, conc) == []
        published = bundle / "reports" / "aiperf" / w / d.name  # what the bundle ships is that export
        name = "profile_export_aiperf.json"
        assert (published / name).read_bytes() == (d / name).read_bytes()
        assert bench.aiperf.export_problems(published, True, n, conc) == []
    assert "natively against the front end (`--endpoint-type chat --streaming`" in (out / "bench.md").read_text()

    # negative controls: aiperf's completions endpoint type, a non-streamed run, a request template, another level
    d, lv = dirs[-1]
    n, conc = lv["request_count"], lv["concurrency"]

    def planted(change) -> list[str]:
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(d, bad)
        exp = json.loads((bad / "profile_export_aiperf.json").read_text())
        change(exp["input_config"]["endpoint"])
        (bad / "profile_export_aiperf.json").write_text(json.dumps(exp))
        return bench.aiperf.export_problems(bad, True, n, conc)

    assert planted(lambda ep: ep.update(type="completions")) == ["endpoint type 'completions', not 'chat'"]
    assert planted(lambda ep: ep.update(streaming=False)) == ["not streaming"]
    assert planted(lambda ep: ep.update(type="template", template={"body": "{}"}))[1].startswith(
        "a request template")
    assert bench.aiperf.export_problems(d, True, n + 1, conc) == [
        f"profiling phase (concurrency, requests) {(conc, n)}, not {(conc, n + 1)}",
        f"{n} requests recorded, not {n + 1}"]
    assert bench.aiperf.export_problems(d, False, n, conc) == [
        "endpoint type 'chat', not 'completions'",
        f"inputs.json: {n} payload(s) not streamed completions requests ('prompt', stream: true)"]


@pytest.mark.slow  # aiperf_build (above)
def test_aiperfs_own_loader_reads_every_level(aiperf_build, tmp_path):
    from aiperf.plot.core.data_loader import DataLoader
    from aiperf.plot.core.mode_detector import ModeDetector

    out = _bench_out(aiperf_build)
    doc = json.loads((out / "bench.json").read_text())
    loader = DataLoader()
    for d, lv in _level_dirs(out, doc):
        run = loader.load_run(d)
        assert run.metadata.concurrency == lv["concurrency"] and run.metadata.model == "tiny-qwen3"
        assert len(run.requests) == lv["request_count"]
    mode, runs = ModeDetector().detect_mode([out / "aiperf" / "chat"])
    assert mode.name == "MULTI_RUN" and len(runs) == len(doc["workloads"]["chat"]["openai_levels"])
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
                   "bench.aiperf=true",
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
    # on CPU aiperf profiles one level by default (bench.aiperf_levels=one): the first workload's highest
    # concurrency, whose export is aiperf's chat endpoint through the front end to the tensorrt_llm model
    assert doc["openai"]["aiperf"]["levels"] == "one"
    profiled = [(d, lv) for d, lv in _level_dirs(out, doc) if lv.get("aiperf")]
    assert [(d.parent.name, lv["concurrency"]) for d, lv in profiled] == [("chat", 2)]
    assert sorted(p.relative_to(out).as_posix() for p in out.glob("aiperf/*/concurrency_*")) == \
        ["aiperf/chat/concurrency_2"]
    for d, lv in profiled:
        assert bench.aiperf.export_problems(d, True, lv["request_count"], lv["concurrency"]) == []
