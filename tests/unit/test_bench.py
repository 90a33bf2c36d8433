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

from pipeline import config, hardware
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


def test_plan_refuses_an_entry_point_the_layout_lacks_before_any_work():
    cfg = hardware.compose(["runtime=reference", "serve.layout=llmapi", "bench.model=tensorrt_llm_bls",
                            "serve.launcher=external", "serve.url=127.0.0.1:1"])
    assert bench.check(cfg) == ["bench.model=tensorrt_llm_bls: the llmapi layout has no such entry point "
                                "(it has: tensorrt_llm); set bench.model=auto"]
    bad_front = hardware.compose(["runtime=reference", "serve.openai.entry_point=tensorrt_llm_bls",
                                  "serve.launcher=external", "serve.url=127.0.0.1:1"])
    assert bench.check(bad_front) == []  # the inflight_batcher_llm layout has tensorrt_llm_bls
    bad_front = hardware.compose(["runtime=reference", "serve.layout=llmapi", "serve.openai.entry_point=ensemble",
                                  "serve.launcher=external", "serve.url=127.0.0.1:1"])
    assert bench.check(bad_front) == ["serve.openai.entry_point=ensemble: the llmapi layout's entry point is "
                                      "tensorrt_llm"]
    cfg = hardware.compose(["runtime=reference", "serve.layout=llmapi", "serve.launcher=external",
                            "serve.url=127.0.0.1:1"])
    assert bench.check(cfg) == [] and bench.env_check(cfg) == []


def test_default_sweep_is_a_smoke_on_cpu_and_full_on_gpus_and_explicit_values_win():
    cpu = hardware.compose(["target=cpu", "runtime=reference"]).bench
    assert list(cpu.concurrency) == [1, 8] and cpu.requests_per_level <= 4 and cpu.workloads.chat.max_tokens <= 16
    gpu = hardware.compose(["target=h100", "model=qwen32b"]).bench
    assert list(gpu.concurrency) == [1, 8, 32] and gpu.workloads.chat.max_tokens == 32
    assert gpu.workloads.rag.prompt_words == 300
    mine = hardware.compose(["target=cpu", "runtime=reference", "bench.concurrency=[1,2,3]",
                           "bench.workloads.chat.max_tokens=5"]).bench
    assert list(mine.concurrency) == [1, 2, 3] and mine.workloads.chat.max_tokens == 5
    assert mine.workloads.chat.prompt_words == 24 and mine.workloads.rag.max_tokens == 8
    assert bench.workload_names(mine) == ["chat", "rag"]


# The CPU smoke as docs/stages.md states it (the bench bullet), and as make build on a CPU machine runs it.
CPU_SMOKE = {"concurrency": [1, 8], "requests": [2, 8], "warmup_requests": 1, "chat": (24, 16), "rag": (150, 8),
             "aiperf_levels": "one", "aiperf_profiles": [("chat", 8)]}
CPU_SMOKE_DOC = ("on `target=cpu` a smoke (concurrency 1 and 8, 2 and\n  8 requests, one warm-up request; `chat` 24 "
                 "prompt words and 16 output tokens, `rag` 150 words and 8 tokens; aiperf\n  at one level, "
                 "`bench.aiperf_levels=one`: `chat` at concurrency 8)")


def cpu_smoke_mismatches(b) -> list[str]:
    """How the composed bench config ``b`` differs from :data:`CPU_SMOKE`, one line per setting."""
    from pipeline.stages.bench import load

    got = {"concurrency": list(b.concurrency),
           "requests": [max(int(c), int(b.requests_per_level)) for c in b.concurrency],
           "warmup_requests": int(b.warmup_requests),
           "chat": (b.workloads.chat.prompt_words, b.workloads.chat.max_tokens),
           "rag": (b.workloads.rag.prompt_words, b.workloads.rag.max_tokens),
           "aiperf_levels": b.aiperf_levels.value, "aiperf_profiles": sorted(load.aiperf_levels(b))}
    return [f"{k}: {got[k]!r}, documented {v!r}" for k, v in CPU_SMOKE.items() if got[k] != v]


def test_the_cpu_defaults_compose_to_the_documented_smoke_and_a_planted_change_is_caught():
    from pipeline.stages.bench import load

    text = (config.CONF_DIR.parent / "docs" / "stages.md").read_text()
    assert CPU_SMOKE_DOC in text
    assert cpu_smoke_mismatches(hardware.compose([]).bench) == []  # the embedded default: target cpu
    # negative controls: a planted default or override is named
    assert cpu_smoke_mismatches(hardware.compose(["bench.sweep.cpu.aiperf_levels=all"]).bench) == [
        "aiperf_levels: 'all', documented 'one'",
        "aiperf_profiles: [('chat', 1), ('chat', 8), ('rag', 1), ('rag', 8)], documented [('chat', 8)]"]
    assert cpu_smoke_mismatches(hardware.compose(["bench.sweep.cpu.requests_per_level=3"]).bench) == [
        "requests: [3, 8], documented [2, 8]"]
    # GPUs: aiperf at every level; bench.only picks the first workload aiperf profiles with `one`
    gpu = hardware.compose(["target=h100", "model=qwen32b"]).bench
    assert gpu.aiperf_levels.value == "all" and len(load.aiperf_levels(gpu)) == 6
    rag_only = hardware.compose(["bench.only=[rag]"]).bench
    assert load.aiperf_levels(rag_only) == {("rag", 8)}


def _conf_with_workload(tmp_path, monkeypatch, entry: str) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(config.CONF_DIR, conf)
    path = conf / "bench" / "default.yaml"
    path.write_text(path.read_text().replace("workloads:\n", f"workloads:\n{entry}\n", 1))
    monkeypatch.setattr(config, "CONF_DIR", conf)


def test_a_new_workload_is_one_config_entry(tmp_path, monkeypatch):
    _conf_with_workload(tmp_path, monkeypatch, "  code: {by_device: {cpu: {prompt_words: 60, max_tokens: 12}}}")
    cfg = hardware.compose(["target=cpu", "runtime=reference"]).bench
    assert bench.workload_names(cfg) == ["code", "chat", "rag"]
    assert (cfg.workloads.code.prompt_words, cfg.workloads.code.max_tokens) == (60, 12)
    assert bench.workload_names(hardware.compose(["target=cpu", "runtime=reference", "bench.only=[rag,code]"]).bench) \
        == ["rag", "code"]
    with pytest.raises(UserError, match="bench.only: unknown workload 'summarise'; choose from: code, chat, rag"):
        hardware.compose(["target=cpu", "runtime=reference", "bench.only=[summarise]"])
    with pytest.raises(UserError, match="bench.workloads.code.max_tokens is not set for target.device=cuda"):
        hardware.compose(["target=h100", "model=qwen32b"])  # no cuda sizes given
    with pytest.raises(UserError, match=r"bench.workloads.code.max_tokens=0 is out of range"):
        hardware.compose(["target=cpu", "runtime=reference", "bench.workloads.code.max_tokens=0"])


def test_a_workload_without_sizes_and_out_of_range_sizes_are_refused(tmp_path, monkeypatch):
    _conf_with_workload(tmp_path, monkeypatch, "  code: {prompt_words: 60}")
    with pytest.raises(UserError, match="bench.workloads.code.max_tokens is not set for target.device=cpu"):
        hardware.compose(["target=cpu", "runtime=reference"])


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
    return hardware.compose(["target=cpu", "runtime=reference", *extra])


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


# ------------------------------------------------------------------------------------------- the aiperf command
def test_the_aiperf_command_parses_in_aiperfs_own_cli(tmp_path):
    """The bench's ``aiperf profile`` line, parsed by aiperf's own CLI (cyclopts + its CLIConfig model): aiperf's
    OpenAI chat endpoint type, streaming, no request template, the level's dataset, count and concurrency."""
    from aiperf.cli import app

    data = tmp_path / "level.jsonl"
    data.write_text('{"text": "x", "output_length": 4}\n')
    cmd = bench.aiperf.command("http://127.0.0.1:9000", "tiny-qwen3", tmp_path, data, 3, 2, tmp_path / "out",
                               True, 7, 120)
    assert cmd[1:4] == ["-m", "aiperf", "profile"]
    _, bound, _ = app.parse_args(cmd[3:], exit_on_error=False)
    c = bound.kwargs["cli_config"].model_dump(exclude_unset=True)
    assert (c["endpoint_type"].value, c["streaming"], c["urls"], c["model_names"]) == \
        ("chat", True, ["http://127.0.0.1:9000"], ["tiny-qwen3"])
    assert (c["request_count"], c["concurrency"], c["input_file"], c["custom_dataset_type"].value) == \
        (3, 2, data, "single_turn")
    assert (c["tokenizer_name"], c["artifact_directory"], c["extra_inputs"]) == \
        (str(tmp_path), tmp_path / "out", [("temperature", 0)])
    assert "custom_endpoint" not in c and "template" not in str(c)
    c2 = app.parse_args(bench.aiperf.command("http://h:1", "m", tmp_path, data, 1, 1, tmp_path, False, 0, 9)[3:],
                        exit_on_error=False)[1].kwargs["cli_config"]
    assert c2.endpoint_type.value == "completions"  # a model benched without its chat template
    # negative control: a flag aiperf does not have is refused by its parser
    with pytest.raises(Exception, match="endpoint-kind"):
        app.parse_args([*cmd[3:], "--endpoint-kind", "chat"], exit_on_error=False)


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
