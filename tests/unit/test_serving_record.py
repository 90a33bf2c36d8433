"""What a bundle says to expect: `pipeline diff`'s serving rows (pipeline/bundle/diffing.py serving_rows) and the bench
report's note on the reference runtime (pipeline/stages/bench/bench_md.py)."""
from __future__ import annotations

import copy

from pipeline import bundle
from pipeline.stages.bench import bench_md as report


def _manifest(batch: int, tpot: float) -> dict:
    serving = {"settings": {"max_batch_size": {"value": batch, "source": "derived", "why": "profile"},
                            "max_seq_len": {"value": 11264, "source": "derived", "why": "pool"}},
               "profile": {"chosen": {"tp": 1, "batch": batch}},
               "predictions": {"trtllm_tables": "1.3.0rc20", "workloads": {"typical": {
                   "kv_fp8": {"ttft_ms": 281.75, "tpot_ms": tpot, "tokens_per_s_per_gpu": 2221.7, "memory_gb": 46.8},
                   "kv_bf16": {"ttft_ms": 294.8, "tpot_ms": 31.3, "tokens_per_s_per_gpu": 2003.5, "memory_gb": 56.8}}}},
               "model": "aiconfigurator-core==0.12.0"}
    return {"capacity": {"tp": 1, "serving": serving}}


def test_diff_shows_the_serving_settings_profile_and_predictions_and_a_planted_change():
    a = _manifest(64, 28.2)
    rows = {name: (o, n) for name, o, n in bundle.serving_rows(a, copy.deepcopy(a))}
    assert rows["serving max_batch_size"] == (64, 64) and rows["profile batch"] == (64, 64)
    assert rows["predicted tpot_ms"] == (28.2, 28.2)  # the chosen KV dtype's (listed first), not bf16's
    assert rows["predicted from TensorRT-LLM tables"] == ("1.3.0rc20", "1.3.0rc20")
    assert rows["performance model"] == ("aiconfigurator-core==0.12.0",) * 2
    changed = {name: (o, n) for name, o, n in bundle.serving_rows(a, _manifest(32, 19.7)) if o != n}
    assert set(changed) == {"serving max_batch_size", "profile batch", "predicted tpot_ms"}
    # a bundle from before the serving plan: its rows are empty, not an error
    assert all(o is None for _, o, _ in bundle.serving_rows({"capacity": None}, a))


def test_every_reference_bench_table_says_it_measures_the_serving_path_and_a_trtllm_one_does_not():
    level = {"concurrency": 1, "request_count": 2, "error_count": 0,
             "output_token_throughput": {"avg": 10.0}, "request_throughput": {"avg": 1.0},
             **{k: {"p50": 1.0, "p95": 2.0, "p99": 3.0} for k in ("time_to_first_token", "inter_token_latency",
                                                                  "request_latency")}}
    r = {"model": "ensemble", "layout": "inflight_batcher_llm", "launcher": "local", "answers": [],
         "gates": {"verdict": "pass", "breaches": [], "baseline": None},
         "workloads": {w: {"prompt_words": 24, "max_tokens": 16, "levels": [level]} for w in ("chat", "rag")}}
    ref = report.markdown("m", {**r, "runtime": "reference"})
    tables = ref.count("| concurrency |")
    assert tables == 2 and ref.count("not a performance measurement") == tables + 1  # the header and each table
    trt = report.markdown("m", {**r, "runtime": "trtllm_llmapi"})
    assert "not a performance measurement" not in trt  # the negative control


def test_a_trtllm_bench_is_held_against_the_prediction_at_the_same_concurrency_and_warns_beyond_the_tolerance():
    pred = {"trtllm_tables": "1.3.0rc20", "model": "aiconfigurator-core==0.12.0", "workloads": {"chat": {
        "by_concurrency": {"8": {"ttft_ms": 60.0, "tpot_ms": 15.0, "tokens_per_s_per_gpu": 500.0}}}}}

    def level(c: int, ttft: float, itl: float, tps: float) -> dict:
        return {"concurrency": c, "time_to_first_token": {"p50": ttft}, "inter_token_latency": {"p50": itl},
                "output_token_throughput": {"avg": tps}}

    r = {"runtime": "trtllm_llmapi", "workloads": {"chat": {"levels": [level(1, 9.0, 9.0, 9.0),
                                                                        level(8, 66.0, 14.0, 1050.0)]}}}
    vs = report.against_prediction(r, pred, gpus=2)
    assert {(x["concurrency"], x["figure"]) for x in vs["rows"]} == {(8, "TTFT p50 ms"), (8, "ITL p50 ms"),
                                                                      (8, "output tokens/s")}  # c=1: no prediction
    assert vs["warnings"] == []  # within ±30% (tokens/s: 2 GPUs x 500 predicted)
    r["workloads"]["chat"]["levels"][1]["inter_token_latency"]["p50"] = 30.0  # planted: twice the predicted TPOT
    vs = report.against_prediction(r, pred, gpus=2)
    assert len(vs["warnings"]) == 1 and "ITL p50 ms measured 30.0, predicted 15.0" in vs["warnings"][0]
    assert report.against_prediction({**r, "runtime": "reference"}, pred, gpus=2) is None  # an emulator: no check
