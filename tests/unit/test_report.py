"""The build report: Markdown and JSON files, the console summary, the plan tables, and ``BuildReport.to_dict``."""
from __future__ import annotations

import json

import pytest

from pipeline import report
from pipeline.runner.executor import BuildReport

LEVEL = {"concurrency": 2, "request_count": 8, "error_count": 0, "ttft_p50_ms": 12.34, "ttft_p95_ms": 20.0,
         "itl_p50_ms": None, "itl_p95_ms": None, "latency_p95_ms": 80.0, "latency_p99_ms": 90.0,
         "output_tokens_per_s": 150.25, "requests_per_s": 3.456}
ACCURACY = {"gate_measures": "quantized_vs_unquantized",
            "quantized_vs_unquantized": {"kl_mean": 0.01234, "top1_agreement": 0.9876, "ppl_ratio": 1.0123},
            "fake_quant_vs_unquantized": {}, "exported_vs_fake_quant": {"kl_mean": 0.00012},
            "unquantized_vs_fake_quant": {}, "export_proof": {}, "export_check": "pass", "thresholds": {},
            "gate": "pass", "breaches": []}
QUANTIZE = {"format": "fp8", "kv_cache": "fp8", "accuracy": ACCURACY}
BENCH = {"model": "ensemble", "layout": "reference", "workloads": {"chat": [LEVEL]}, "answers_passed": 2,
         "answers": 2, "gates": {"verdict": "pass", "breaches": [], "regressions": [], "regressions_gated": False,
                                 "baseline": {"status": "none", "source": "s3://b", "version": None,
                                              "detail": "no bundle published yet"}}}


def _row(stage: str, status: str, result: dict | None = None, size: int = 2048) -> dict:
    return {"stage": stage, "status": status, "seconds": 1.5, "stage_wall_s": 9.25, "peak_rss_mb": None,
            "bytes": size, "output": f"/o/{stage}", "fingerprint": "f" * 64, "result": result or {}}


def _report(*, published: dict | None, bench: bool = True) -> BuildReport:
    rows = [_row("fetch", "cached"), _row("quantize", "ran", QUANTIZE, 3 * 2**30)]
    if bench:
        rows.append(_row("bench", "ran", BENCH))
    return BuildReport(model="tiny-qwen3", quant="fp8", kv_cache="fp8", target="cpu", runtime="reference",
                       total_s=12.5, stages=rows, log="/l/run.log", finished="2026-11-30T20:00:00+00:00",
                       published=published)


def test_to_dict_is_the_report_json_in_its_key_order():
    d = _report(published=None).to_dict()
    assert list(d) == ["model", "quant", "kv_cache", "published", "target", "runtime", "total_s", "stages", "log",
                       "finished"]
    assert d["stages"][1]["result"] is QUANTIZE


def test_write_puts_markdown_and_json_under_the_artifact_label(tmp_path):
    summary = _report(published={"url": "s3://b/v1", "uploaded_files": 7, "latest_moved": True}).to_dict()
    md = report.write(summary, tmp_path / "reports")
    assert md == tmp_path / "reports" / "tiny-qwen3.fp8-kvfp8.cpu.reference.md"
    assert json.loads(md.with_suffix(".json").read_text()) == summary
    text = md.read_text()
    assert text.startswith("# build report: tiny-qwen3 · fp8 (KV fp8) · cpu · reference\n")
    assert "| fetch | cached | 1.5 (built in 9.25) | - | 2.0 KB | `/o/fetch` |" in text
    assert "| quantize | ran | 1.5 | - | 3.0 GB | `/o/quantize` |" in text
    assert "Published `s3://b/v1` (7 files uploaded; `latest` moved)." in text
    assert "| chat | 2 | 8 | 0 | 12.3 | - | 80.0 | 150.2 | 3.46 |" in text
    assert "Bench gate: pass (entry point ensemble). Regression baseline: none" in text
    assert ("Accuracy (held-out): quantized vs unquantized KL 0.0123, top-1 0.988, perplexity ratio 1.012; export "
            "check pass (KL 0.0001 vs fake-quant).") in text


def test_markdown_leaves_out_what_did_not_happen():
    """Negative control: no bench stage, no upload and no accuracy give no bench table, gate, publish or accuracy
    line; a gate that did not pass says latest did not move."""
    summary = _report(published=None, bench=False).to_dict()
    summary["stages"][1]["result"] = {"format": "none", "kv_cache": "none", "note": "unquantized"}
    text = report.markdown(summary)
    assert "| workload |" not in text and "Bench gate" not in text and "Published" not in text
    assert "Accuracy" not in text
    moved_not = report.markdown(_report(published={"url": "u", "uploaded_files": 0, "latest_moved": False},
                                        bench=False).to_dict())
    assert "`latest` not moved: a gate did not pass" in moved_not


def test_print_summary_shows_the_tables_and_the_publish_line(tmp_path, capsys):
    summary = _report(published={"url": "s3://b/v1", "uploaded_files": 7, "latest_moved": False}).to_dict()
    report.print_summary(summary, tmp_path / "r.md")
    err = " ".join(capsys.readouterr().out.split())
    assert "stages" in err and "bench (streaming gRPC)" in err and "150.2" in err
    assert "published s3://b/v1 (7 files uploaded; latest not moved: a gate did not pass)" in err
    assert f"total 12.5s · report: {tmp_path / 'r.md'}" in err


def test_print_plan_shows_stages_capacity_and_refusals(capsys):
    cap = {"tp": 2, "tp_chosen_by_planner": True, "pp": 1, "weights_gb_per_gpu": 17.5,
           "kv_cache_free_gpu_mem_fraction": 0.9, "chosen_kv": "fp8", "warnings": ["tight fit"],
           "table": [{"kv_dtype": "fp8", "kv_kib_per_token_per_gpu": 64.0, "kv_pool_gb_per_gpu": 40.0,
                      "max_tokens": 655360, "max_concurrent_sequences": 160}]}
    doc = {"model": "qwen32b", "quant": "fp8", "kv_cache": "fp8", "target": "h100", "runtime": "trtllm_engine",
           "capacity": cap, "not_buildable_here": ["no GPU here"],
           "stages": [{"stage": "fetch", "fingerprint": "a" * 64, "cached": False, "reason": "no output yet",
                       "output": "/o"}]}
    report.print_plan(doc)
    err = " ".join(capsys.readouterr().out.split())
    assert "plan: qwen32b fp8 (KV fp8) on h100 / trtllm_engine" in err and "aaaaaaaaaaaa" in err
    assert "TP=2 (the smallest whose KV pool holds the longest workload), PP=1" in err and "655,360" in err
    assert "fp8 ←" in err
    assert "warning: tight fit" in err and "build here would be refused: no GPU here" in err
    doc["capacity"], doc["not_buildable_here"] = None, []
    report.print_plan(doc)
    err = capsys.readouterr().out
    assert "KV-cache capacity" not in err and "refused" not in err


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KB"), (5 * 2**20, "5.0 MB"),
                                     (2**50, "1024.0 TB")])
def test_human_sizes(n, text):
    assert report.human(n) == text


def test_fmt_marks_a_missing_value():
    assert (report.fmt(None), report.fmt(1.25), report.fmt(1.256, ".2f")) == ("-", "1.2", "1.26")


LONG = "/srv/very/long/output/root/.store/a-model-with-a-long-name.fp8-kvfp8.cpu.reference-bench-0123456789ab"


def test_printed_messages_keep_their_brackets_and_paths_stay_whole(capsys):
    """Without a terminal (capsys): a refusal with rich-markup-looking text reaches the user whole, and every stage
    path is printed on one line of its own, never cut by a table column (negative control: the text is there)."""
    doc = {"model": "m", "quant": "fp8", "kv_cache": "fp8", "target": "cpu", "runtime": "reference",
           "capacity": None, "not_buildable_here": ["the stub needs numpy<2: pip install -e '.[cpu-server]'"],
           "stages": [{"stage": "bench", "fingerprint": "b" * 64, "cached": False, "reason": "[forced]",
                       "output": LONG}]}
    report.print_plan(doc)
    err = capsys.readouterr().out
    assert "pip install -e '.[cpu-server]'" in err and "[forced]" in err
    assert any(line.strip() == f"bench  {LONG}" for line in err.splitlines()), err


def test_the_summary_prints_paths_whole(tmp_path, capsys):
    summary = _report(published={"url": f"file://{LONG}/v1", "uploaded_files": 3, "latest_moved": False,
                                 "latest_not_moved": "the config differs from its matrix entry ([x]: 1 -> 2)"})
    d = summary.to_dict()
    d["stages"][0]["output"] = LONG
    report.print_summary(d, tmp_path / "r.md")
    err = capsys.readouterr().out
    assert any(line.strip().endswith(LONG) for line in err.splitlines()), err
    assert f"published file://{LONG}/v1 (3 files uploaded; latest not moved: the config differs from its matrix " \
           f"entry ([x]: 1 -> 2))" in err


def test_a_reference_bench_says_it_is_not_a_performance_measurement(tmp_path, capsys):
    """The report and the console summary of a bench on the reference runtime carry the note beside the table; a
    TensorRT-LLM runtime's (the control) does not."""
    ref = _report(published=None).to_dict()
    assert "they are not a performance measurement" in report.markdown(ref)
    report.print_summary(ref, tmp_path / "r.md")
    assert "they are not a performance measurement" in " ".join(capsys.readouterr().out.split())
    trt = {**ref, "runtime": "trtllm_llmapi"}
    assert "performance measurement" not in report.markdown(trt)
    report.print_summary(trt, tmp_path / "r.md")
    assert "performance measurement" not in capsys.readouterr().out
