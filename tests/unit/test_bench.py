"""The bench's decisions without a server: the entry point per layout, the default sweep per target device, the
regression baseline (found, none, unreachable, corrupt) and the gate's verdict and checks."""
from __future__ import annotations

import copy
import functools
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline import config
from pipeline.errors import UserError
from pipeline.stages import bench


def test_entry_point_per_layout_and_a_refused_choice_is_one_line():
    assert bench.choose_entry("auto", "inflight_batcher_llm") == "ensemble"
    assert bench.choose_entry("tensorrt_llm_bls", "inflight_batcher_llm") == "tensorrt_llm_bls"
    assert bench.choose_entry("auto", "llmapi", ["tensorrt_llm"]) == "tensorrt_llm"
    for choice, layout in (("ensemble", "llmapi"), ("tensorrt_llm_bls", "llmapi"),
                           ("tensorrt_llm", "inflight_batcher_llm")):
        with pytest.raises(UserError) as err:
            bench.choose_entry(choice, layout)
        msg = str(err.value)
        assert f"bench.model={choice}: the {layout} layout has no such entry point" in msg and "\n" not in msg
    with pytest.raises(UserError, match="layout 'reference-ensemble', which the bench cannot drive"):
        bench.choose_entry("auto", "reference-ensemble")


def test_env_check_refuses_an_entry_point_the_layout_lacks_before_any_work():
    cfg = config.compose(["runtime=reference", "serve.layout=llmapi", "bench.model=tensorrt_llm_bls",
                          "serve.launcher=external", "serve.url=127.0.0.1:1"])
    assert bench.env_check(cfg) == ["bench.model=tensorrt_llm_bls: the llmapi layout has no such entry point "
                                    "(it has: tensorrt_llm); set bench.model=auto"]
    cfg = config.compose(["runtime=reference", "serve.layout=llmapi", "serve.launcher=external",
                          "serve.url=127.0.0.1:1"])
    assert bench.env_check(cfg) == []


def test_default_sweep_is_a_smoke_on_cpu_and_full_on_gpus_and_explicit_values_win():
    cpu = config.compose(["target=cpu", "runtime=reference"]).bench
    assert list(cpu.concurrency) == [1, 8] and cpu.requests_per_level <= 4 and cpu.workloads.chat.max_tokens <= 16
    gpu = config.compose(["target=h100", "model=qwen32b"]).bench
    assert list(gpu.concurrency) == [1, 8, 32] and gpu.workloads.chat.max_tokens == 32
    assert gpu.workloads.rag.prompt_words == 300
    mine = config.compose(["target=cpu", "runtime=reference", "bench.concurrency=[1,2,3]",
                           "bench.workloads.chat.max_tokens=5"]).bench
    assert list(mine.concurrency) == [1, 2, 3] and mine.workloads.chat.max_tokens == 5
    assert mine.workloads.chat.prompt_words == 24 and mine.workloads.rag.max_tokens == 8
    assert bench.workload_names(mine) == ["chat", "rag"]


def _conf_with_workload(tmp_path, monkeypatch, entry: str) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(config.CONF_DIR, conf)
    path = conf / "bench" / "default.yaml"
    path.write_text(path.read_text().replace("workloads:\n", f"workloads:\n{entry}\n", 1))
    monkeypatch.setattr(config, "CONF_DIR", conf)


def test_a_new_workload_is_one_config_entry(tmp_path, monkeypatch):
    _conf_with_workload(tmp_path, monkeypatch, "  code: {by_device: {cpu: {prompt_words: 60, max_tokens: 12}}}")
    cfg = config.compose(["target=cpu", "runtime=reference"]).bench
    assert bench.workload_names(cfg) == ["code", "chat", "rag"]
    assert (cfg.workloads.code.prompt_words, cfg.workloads.code.max_tokens) == (60, 12)
    assert bench.workload_names(config.compose(["target=cpu", "runtime=reference", "bench.only=[rag,code]"]).bench) \
        == ["rag", "code"]
    with pytest.raises(UserError, match="bench.only: unknown workload 'summarise'; choose from: code, chat, rag"):
        config.compose(["target=cpu", "runtime=reference", "bench.only=[summarise]"])
    with pytest.raises(UserError, match="bench.workloads.code.max_tokens is not set for target.device=cuda"):
        config.compose(["target=h100", "model=qwen32b"])  # no cuda sizes given
    with pytest.raises(UserError, match=r"bench.workloads.code.max_tokens=0 is out of range"):
        config.compose(["target=cpu", "runtime=reference", "bench.workloads.code.max_tokens=0"])


def test_a_workload_without_sizes_and_out_of_range_sizes_are_refused(tmp_path, monkeypatch):
    _conf_with_workload(tmp_path, monkeypatch, "  code: {prompt_words: 60}")
    with pytest.raises(UserError, match="bench.workloads.code.max_tokens is not set for target.device=cpu"):
        config.compose(["target=cpu", "runtime=reference"])


def _level(conc: int, tps: float, ttft_p95: float, errors: int = 0) -> dict:
    stat = {"unit": "ms", "avg": 1.0, "p50": 1.0, "p95": ttft_p95, "p99": ttft_p95}
    return {"concurrency": conc, "request_count": 4, "error_count": errors, "errors": ["x"] if errors else [],
            "time_to_first_token": dict(stat), "inter_token_latency": dict(stat, p95=5.0),
            "request_latency": dict(stat, p95=50.0), "output_token_throughput": {"avg": tps},
            "request_throughput": {"avg": 1.0}}


def _result(tps: float = 100.0, ttft_p95: float = 10.0, errors: int = 0) -> dict:
    return {"workloads": {"chat": {"levels": [_level(1, tps, ttft_p95, errors), _level(8, 3 * tps, ttft_p95)]}}}


def _found(result: dict) -> dict:
    rows = {w: [bench.summary_row(lv) for lv in r["levels"]] for w, r in result["workloads"].items()}
    return {"status": "found", "source": "x", "version": "v1", "detail": None, "bench": {"workloads": rows}}


@functools.lru_cache(maxsize=None)
def _cfg(*extra: str):  # composed once per override set (read-only here)
    return config.compose(["target=cpu", "runtime=reference", *extra])


def test_gate_verdicts_checks_and_regressions():
    cfg = _cfg("bench.gates.regression_on_cpu=true", "bench.gates.ttft_p95_ms=50")
    g = bench.gates(cfg, _result(), _found(_result()))
    assert g["verdict"] == "pass" and g["breaches"] == [] and g["compared_with_previous_levels"] == 2
    assert {c["check"] for c in g["checks"]} >= {"error rate", "TTFT p95", "regression: output tokens/s"}
    assert all(c["pass"] for c in g["checks"])
    # negative controls: an absolute limit, an error, a regression against the previous bundle
    g = bench.gates(cfg, _result(ttft_p95=80.0), _found(_result()))
    assert g["verdict"] == "fail" and any("TTFT p95 80.0 ms > 50.0 ms" in b for b in g["breaches"])
    g = bench.gates(cfg, _result(errors=1), _found(_result()))
    assert g["verdict"] == "fail" and any("error rate 25.0% > 0.0%" in b for b in g["breaches"])
    g = bench.gates(cfg, _result(tps=50.0), _found(_result()))
    assert g["verdict"] == "fail"
    assert "chat at concurrency 1: output tokens/s 50.0 vs 100.0 in the previous bundle (-50%, allowed 25%)" in \
        g["regressions"]
    failed = [c for c in g["checks"] if not c["pass"]]
    assert failed and all(c["check"] == "regression: output tokens/s" and c["change_pct"] == -50.0 for c in failed)
    # on CPU regressions are reported, not gated, unless asked
    g = bench.gates(_cfg(), _result(tps=50.0), _found(_result()))
    assert g["verdict"] == "pass" and g["regressions"] and not g["regressions_gated"]


@pytest.mark.parametrize("status", ["unreachable", "corrupt"])
def test_an_unreadable_baseline_is_no_baseline_never_pass(status):
    baseline = {"status": status, "source": "s3://b/p", "version": None, "detail": "ConnectionError: refused"}
    g = bench.gates(_cfg("bench.gates.regression_on_cpu=true"), _result(), baseline)
    assert g["verdict"] == "no-baseline" and g["compared_with_previous_levels"] == 0
    assert g["baseline"]["status"] == status
    assert "nothing compared" in bench.baseline_line(g) and "ConnectionError: refused" in bench.baseline_line(g)
    # nothing published yet is an empty baseline: pass
    none = {"status": "none", "source": "x", "version": None, "detail": "no bundle published yet"}
    assert bench.gates(_cfg("bench.gates.regression_on_cpu=true"), _result(), none)["verdict"] == "pass"
    # a breach still fails
    assert bench.gates(_cfg("bench.gates.regression_on_cpu=true"), _result(errors=1), baseline)["verdict"] == "fail"


def _ctx(tmp_path: Path, dest: str, *extra: str) -> SimpleNamespace:
    cfg = copy.deepcopy(_cfg(*extra))
    cfg.publish.dest = dest
    (tmp_path / "bundles").mkdir(parents=True, exist_ok=True)
    return SimpleNamespace(cfg=cfg, stage=bench.STAGE, paths={"bundles": tmp_path / "bundles"})


def _publish(ctx, doc, version: str = "v000000000001", raw: bytes | None = None) -> Path:
    from pipeline.bundle import published_base

    _, base = published_base(ctx.cfg)
    d = Path(base) / version
    d.mkdir(parents=True)
    (d / "bundle.json").write_bytes(raw if raw is not None else json.dumps(doc).encode())
    (Path(base) / "latest").write_text(version)
    return d


def test_previous_bench_found_none_corrupt_unreachable(tmp_path):
    dest = tmp_path / "published"
    ctx = _ctx(tmp_path, str(dest))
    assert bench.previous_bench(ctx)["status"] == "none"
    _publish(ctx, {"bench": _found(_result())["bench"]})
    got = bench.previous_bench(ctx)
    assert got["status"] == "found" and got["version"] == "v000000000001"
    assert got["bench"]["workloads"]["chat"][0]["output_tokens_per_s"] == 100.0

    ctx = _ctx(tmp_path / "c", str(tmp_path / "c" / "published"))
    _publish(ctx, None, raw=b"{ not json")
    got = bench.previous_bench(ctx)
    assert got["status"] == "corrupt" and "not JSON" in got["detail"]
    ctx = _ctx(tmp_path / "d", str(tmp_path / "d" / "published"))
    _publish(ctx, {"bench": {"workloads": "oops"}})
    assert bench.previous_bench(ctx)["status"] == "corrupt"

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    got = bench.previous_bench(_ctx(tmp_path / "e", str(blocker / "published")))
    assert got["status"] == "unreachable" and got["detail"].startswith(f"publish.dest={blocker / 'published'}")
    got = bench.previous_bench(_ctx(tmp_path / "f", "nosuchproto://bucket/prefix"))
    assert got["status"] == "unreachable" and "nosuchproto://bucket/prefix" in got["detail"]
    assert bench.previous_bench(_ctx(tmp_path / "g", str(dest), "bench.gates.regression_pct=null"))["status"] == \
        "disabled"


def test_bench_md_shows_the_verdict_baseline_and_counting():
    r = {"model": "tensorrt_llm", "layout": "llmapi", "launcher": "local", "server_start_s": 1.0, "answers": [],
         "workloads": {"chat": {"prompt_words": 24, "max_tokens": 16,
                                "levels": _result()["workloads"]["chat"]["levels"]}}}
    r["gates"] = bench.gates(_cfg("bench.gates.regression_on_cpu=true"), r,
                             {"status": "corrupt", "source": "x", "version": None, "detail": "bundle.json is not JSON"})
    md = bench.markdown("m", r)
    assert "Gate: **no-baseline**" in md and "Regression baseline: **unreadable**: bundle.json is not JSON" in md
    assert "Entry point `tensorrt_llm` (llmapi layout)" in md
    assert "re-tokenized with the model's tokenizer" in md and "(request latency - TTFT) / (output tokens - 1)" in md


# ------------------------------------------------------------------------------------------- aiperf's export schema
# Recorded from aiperf 0.13.0 (PyPI): aiperf/common/models/record_models.py (MetricRecordInfo,
# MetricRecordMetadata), aiperf/common/models/export_models.py (JsonExportData, JsonMetricResult),
# aiperf/config/config.py (BenchmarkConfig), aiperf/plot/core/data_loader.py (what `aiperf plot` reads), and the
# display units of aiperf/metrics/types/*.
AIPERF_RECORD_REQUIRED = {"session_num": int, "request_start_ns": int, "request_end_ns": int, "worker_id": str,
                          "record_processor_id": str, "benchmark_phase": str}
AIPERF_STAT_KEYS = {"unit", "avg", "p1", "p5", "p10", "p25", "p50", "p75", "p90", "p95", "p99", "min", "max", "std",
                    "count", "sum"}
AIPERF_UNITS = {"request_latency": "ms", "time_to_first_token": "ms", "inter_token_latency": "ms",
                "inter_chunk_latency": "ms", "output_sequence_length": "tokens", "input_sequence_length": "tokens",
                "output_token_throughput": "tokens/sec", "output_token_throughput_per_user": "tokens/sec/user",
                "request_throughput": "requests/sec", "request_count": "requests", "error_request_count": "requests",
                "benchmark_duration": "sec", "total_output_tokens": "tokens", "total_isl": "tokens"}
AIPERF_CONFIG_REQUIRED = ("models", "endpoint", "datasets", "phases")


def aiperf_schema_problems(run_dir: Path) -> list[str]:
    """What in ``run_dir``'s ``profile_export.jsonl`` / ``profile_export_aiperf.json`` breaks aiperf 0.13's schema."""
    out = []
    lines = (run_dir / "profile_export.jsonl").read_text().splitlines()
    if not lines:
        out.append("profile_export.jsonl is empty (aiperf's loader refuses it)")
    for n, line in enumerate(lines):
        rec = json.loads(line)
        for key in ("metadata", "metrics"):
            if not isinstance(rec.get(key), dict):
                out.append(f"line {n}: no {key}")
        meta = rec.get("metadata") or {}
        for key, typ in AIPERF_RECORD_REQUIRED.items():
            if not isinstance(meta.get(key), typ):
                out.append(f"line {n}: metadata.{key} missing or not {typ.__name__}")
        if meta.get("benchmark_phase") not in ("warmup", "profiling"):
            out.append(f"line {n}: benchmark_phase {meta.get('benchmark_phase')!r}")
        for tag, mv in (rec.get("metrics") or {}).items():
            if set(mv) != {"value", "unit"} or mv["unit"] != AIPERF_UNITS.get(tag):
                out.append(f"line {n}: metric {tag} {mv} (aiperf's unit: {AIPERF_UNITS.get(tag)})")
        if rec.get("error") is not None and not isinstance(rec["error"].get("message"), str):
            out.append(f"line {n}: error without a message")
    doc = json.loads((run_dir / "profile_export_aiperf.json").read_text())
    for tag, unit in AIPERF_UNITS.items():
        if tag in ("output_token_throughput_per_user",) and tag not in doc:
            continue
        res = doc.get(tag)
        if not isinstance(res, dict) or res.get("unit") != unit or set(res) - AIPERF_STAT_KEYS:
            out.append(f"profile_export_aiperf.json: {tag} {res} (aiperf's unit: {unit})")
    cfg = doc.get("input_config") or {}
    for key in AIPERF_CONFIG_REQUIRED:
        if not cfg.get(key):
            out.append(f"input_config.{key} is required")
    if len(cfg.get("datasets") or []) != 1 or not all(d.get("name") for d in cfg.get("datasets") or []):
        out.append("input_config.datasets: exactly one, with a name")
    if cfg.get("endpoint", {}).get("type") == "template" and not cfg["endpoint"].get("template", {}).get("body"):
        out.append("input_config.endpoint: a template endpoint needs template.body")
    prof = [p for p in cfg.get("phases") or [] if p.get("name") == "profiling"]
    if not prof or not isinstance(prof[0].get("concurrency"), int) or not isinstance(prof[0].get("requests"), int):
        out.append("input_config.phases: no profiling phase with concurrency and requests (the plot's x axis)")
    if not ((cfg.get("models") or {}).get("items") or [{}])[0].get("name"):
        out.append("input_config.models.items[0].name is required")
    return out


def test_aiperf_export_follows_aiperfs_schema(tmp_path):
    from pipeline.stages.fetch import train_tokenizer
    from pipeline.triton import client
    from pipeline.triton.client import EntryPoint, RequestRecord

    tok = train_tokenizer(512)
    prompts = ["Continue this text: the capital of France", "Continue this text: a long road", "x"]
    recs = [RequestRecord(0, sent=1.0, sent_ns=10**18, first=1.2, done=2.0, chunk_times=[1.2, 1.5, 1.9],
                          responses=4, text="Paris is the capital of France.", worker=0),
            RequestRecord(1, sent=1.0, sent_ns=10**18 + 5, first=1.4, done=1.8, chunk_times=[1.4, 1.8],
                          responses=3, text="A road goes on.", worker=1),
            RequestRecord(2, sent=1.0, sent_ns=10**18 + 9, done=1.1, error="StatusCode.UNAVAILABLE", worker=1)]
    client.count_output_tokens(recs, tok)
    level = {"workload": "chat", "concurrency": 2, "records": recs, "wall_s": 1.5,
             "summary": client.summarize(recs, 1.5), "prompts": prompts, "max_tokens": 16,
             "entry": EntryPoint("tensorrt_llm", "llmapi", batched=False), "http_url": "http://127.0.0.1:8000"}
    run_dir = tmp_path / "aiperf" / "chat" / "concurrency_2"
    bench.aiperf_export(run_dir, level, tok)
    assert aiperf_schema_problems(run_dir) == []
    doc = json.loads((run_dir / "profile_export_aiperf.json").read_text())
    assert doc["input_config"]["phases"] == [{"name": "profiling", "type": "concurrency", "concurrency": 2,
                                              "requests": 3}]
    assert doc["request_count"]["avg"] == 2 and doc["error_request_count"]["avg"] == 1
    assert doc["total_output_tokens"]["avg"] == recs[0].output_tokens + recs[1].output_tokens
    assert '"sampling_param_max_tokens": 16' in doc["input_config"]["endpoint"]["template"]["body"]
    lines = [json.loads(x) for x in (run_dir / "profile_export.jsonl").read_text().splitlines()]
    assert [x["metadata"]["worker_id"] for x in lines] == ["worker_0", "worker_1", "worker_1"]
    assert lines[2]["error"]["message"] == "StatusCode.UNAVAILABLE"
    assert "output_sequence_length" not in lines[2]["metrics"]
    assert lines[0]["metrics"]["output_sequence_length"]["value"] == recs[0].output_tokens
    assert [json.loads(x)["text"] for x in (run_dir / "prompts.jsonl").read_text().splitlines()] == prompts

    # negative controls: a record without its end time, a metric in seconds, a config without phases
    bad = tmp_path / "bad"
    shutil.copytree(run_dir, bad)
    lines[0]["metadata"].pop("request_end_ns")
    lines[1]["metrics"]["request_latency"]["unit"] = "s"
    (bad / "profile_export.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    doc["input_config"].pop("phases")
    (bad / "profile_export_aiperf.json").write_text(json.dumps(doc))
    problems = aiperf_schema_problems(bad)
    assert any("line 0: metadata.request_end_ns missing" in p for p in problems)
    assert any("line 1: metric request_latency" in p for p in problems)
    assert "input_config.phases is required" in problems


def test_the_build_summary_carries_the_bench_verdict_and_baseline():
    from pipeline.report import bench_gate as _bench_gate

    g = bench.gates(_cfg("bench.gates.regression_on_cpu=true"), _result(),
                    {"status": "unreachable", "source": "s3://b", "version": None, "detail": "publish.dest=s3://b: x"})
    result = bench.bench_result({"model": "ensemble", "layout": "reference", "workloads": {}, "answers": [],
                                 "gates": g}).model_dump(mode="json")  # what run() keeps in its manifest
    line = _bench_gate({"stages": [{"stage": "bench", "result": result}]})
    assert line == ("Bench gate: no-baseline (entry point ensemble). Regression baseline: **unreachable**: "
                    "publish.dest=s3://b: x; nothing compared.")
    assert _bench_gate({"stages": [{"stage": "bench", "result": {}}]}) is None


def test_the_build_summary_counts_the_levels_compared_with_a_found_baseline():
    from pipeline.report import bench_gate as _bench_gate

    r = dict(_result(), model="ensemble", layout="inflight_batcher_llm", answers=[])
    r["gates"] = bench.gates(_cfg(), r, _found(_result()))
    result = bench.bench_result(r).model_dump(mode="json")  # what run() keeps in its manifest
    assert result["gates"]["compared_with_previous_levels"] == 2
    line = _bench_gate({"stages": [{"stage": "bench", "result": result}]})
    assert line.endswith("Regression baseline: v1 (2 levels compared; reported only)."), line
    # negative control: a baseline that shares no level with this run compares none
    r["gates"] = bench.gates(_cfg(), r, _found({"workloads": {"chat": {"levels": [_level(4, 1.0, 1.0)]}}}))
    line = _bench_gate({"stages": [{"stage": "bench", "result": bench.bench_result(r).model_dump(mode="json")}]})
    assert "(0 levels compared; reported only)" in line, line
