"""Typed stage results: a stage's model dumps to exactly the dict its manifest held before results were typed, and a
manifest's ``result`` loads back into the model."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pipeline import results

# Results as a tiny build wrote them into its manifests (model=tiny-qwen3, reference runtime on CPU), trimmed where
# a part repeats; the key order is the one the stages write.
COMPARISON = {"kl_mean": 0.0931, "kl_max": 0.3259, "top1_agreement": 0.7565, "ppl_ref": 21757.79,
              "ppl_test": 20909.30, "ppl_ratio": 0.961, "tokens": 768}
ROW = {"concurrency": 1, "request_count": 2, "error_count": 0, "ttft_p50_ms": 147.27, "ttft_p95_ms": 147.86,
       "itl_p50_ms": 52.55, "itl_p95_ms": 59.36, "latency_p95_ms": 460.85, "latency_p99_ms": 461.37,
       "output_tokens_per_s": 15.33, "requests_per_s": 2.19}
BASELINE = {"status": "none", "source": "/tmp/x/published", "version": None, "detail": "no bundle published yet"}
MANIFEST_RESULTS = {
    "fetch": {"kind": "synthetic", "seed": 0, "params": 426752, "generated_on": "cpu",
              "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
    "quantize": {
        "format": "fp8", "kv_cache": "fp8", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "group_size": None,
        "exclude_modules": ["lm_head"], "block_size": None, "modelopt_version": "0.47.0", "device": "cpu",
        "cpu_nvfp4_fallback_quantizers": 0, "fp8_layers_rounded_as_exported": 14, "batch_size": 8,
        "bytes_per_param": 1.3092, "notes": [],
        "calibration": {"dataset": "builtin", "sha256": "23" * 32, "rows": 24, "requested_rows": 24, "short": False,
                        "seq_len": 128, "tokens": 3072, "tokens_per_s": 1111.3},
        "heldout": {"rows": 6, "seq_len": 128},
        "accuracy": {"gate_measures": "the exported checkpoint, reloaded as served", "quantized_vs_unquantized":
                     COMPARISON, "fake_quant_vs_unquantized": COMPARISON, "exported_vs_fake_quant": COMPARISON,
                     "unquantized_vs_fake_quant": COMPARISON, "export_proof": {"problems": [], "problem_count": 0},
                     "export_check": "pass", "thresholds": {"kl_max": 0.1, "top1_min": 0.85, "ppl_ratio_max": 1.05},
                     "gate": "warn", "breaches": ["KL 0.0931 > 0.1"]},
        "timings_s": {"load_s": 0.098, "calibrate_s": 2.764}},
    "build": {"engine_dir": "engine", "check": {"prompt": "The capital of France is", "completion": " A com",
                                                "tokens": 8, "requested_tokens": 8, "pass": True, "load_s": 0.04,
                                                "tokens_per_s": 9.68}},
    "package": {"layout": "inflight_batcher_llm", "entry_points": ["ensemble", "tensorrt_llm_bls"],
                "models": ["ensemble", "preprocessing", "postprocessing", "tensorrt_llm_bls", "tensorrt_llm"],
                "engine_dir": "tensorrt_llm/1/engine", "runtime": "reference", "trtllm_line": "1.2.1",
                "max_batch_size": 8, "decoupled": True},
    "bench": {"model": "ensemble", "layout": "inflight_batcher_llm", "workloads": {"chat": [ROW], "rag": [ROW]},
              "answers_passed": 0, "answers": 0,
              "gates": {"verdict": "pass", "breaches": [], "regressions": [], "regressions_gated": False,
                        "baseline": BASELINE}},
    "eval_baseline": {"verdict": "n/a", "lm_eval": "0.4.13", "wall_s": 21.5,
                      "scores": {"pipeline_facts": {"metric": "acc", "score": 0.7259, "items": 135}}},
    "evaluate": {"verdict": "pass", "strict": False, "lm_eval": "0.4.13", "wall_s": 20.1, "baseline_wall_s": 21.5,
                 "endpoint": "http://127.0.0.1:9000/v1", "baseline": "smollm2-135m.cpu-eval_baseline-0123456789ab",
                 "task_files": {"pipeline_facts.yaml": "ab" * 32},
                 "tasks": {"pipeline_facts": {"metric": "acc", "baseline": 0.7259, "quantized": 0.7185,
                                              "difference": -0.0074, "ci_low": -0.03, "ci_high": 0.0148,
                                              "confidence": 0.95, "items": 135, "max_drop": 0.05,
                                              "verdict": "pass", "explanation": "..."}}},
    "publish": {"signed": False, "files": 49, "bytes": 1574382, "version": "v89aff715c3bb",
                "gates": {"accuracy": "warn", "export_check": "pass", "bench": "pass",
                          "bench_detail": {"verdict": "pass", "breaches": [], "regressions": [],
                                           "regressions_gated": False, "compared_with_previous_levels": 0,
                                           "baseline": BASELINE}, "eval": "pass"}},
}


@pytest.mark.parametrize("stage", list(MANIFEST_RESULTS))
def test_a_manifest_result_round_trips_byte_for_byte(stage):
    raw = MANIFEST_RESULTS[stage]
    model = results.load(stage, raw)
    assert isinstance(model, results.RESULTS[stage])
    assert json.dumps(model.model_dump(mode="json"), indent=2) == json.dumps(raw, indent=2)


def test_results_are_read_by_attribute():
    q = results.load("quantize", MANIFEST_RESULTS["quantize"])
    assert q.accuracy.gate == "warn" and q.calibration.sha256 == "23" * 32
    b = results.load("bench", MANIFEST_RESULTS["bench"])
    assert b.gates.baseline.status == "none" and b.workloads["chat"][0].ttft_p95_ms == 147.86
    assert results.load("publish", MANIFEST_RESULTS["publish"]).gates.bench_detail.verdict == "pass"


def test_only_the_given_keys_are_dumped_and_numbers_keep_their_type():
    """Each model source has its own keys: the others stay out of the manifest (and read as None)."""
    local = results.FetchResult(kind="local", path="/models/x", architectures=None, model_type="llama")
    assert local.model_dump(mode="json") == {"kind": "local", "path": "/models/x", "architectures": None,
                                             "model_type": "llama"}
    assert local.resolved_sha is None
    unquantized = {"format": "none", "kv_cache": "none", "quant_algo": None, "kv_cache_quant_algo": None,
                   "note": "unquantized: the fetched checkpoint, unchanged"}
    assert results.load("quantize", unquantized).model_dump(mode="json") == unquantized
    row = results.BenchRow.model_validate({**ROW, "output_tokens_per_s": 0, "ttft_p50_ms": None})
    assert json.dumps(row.model_dump(mode="json")["output_tokens_per_s"]) == "0"  # not 0.0


@pytest.mark.parametrize("stage,bad", [
    ("package", {**MANIFEST_RESULTS["package"], "layuot": "llmapi"}),  # an unknown key
    ("bench", {**MANIFEST_RESULTS["bench"], "gates": {**MANIFEST_RESULTS["bench"]["gates"], "verdict": "maybe"}}),
    ("fetch", {"kind": "ftp"}),
    ("build", {"check": {}}),  # engine_dir missing
])
def test_a_malformed_result_is_refused(stage, bad):
    with pytest.raises(ValidationError):
        results.load(stage, bad)


def test_a_stage_reads_its_inputs_typed_and_only_the_declared_ones(tmp_path):
    from pipeline.errors import StageFailed
    from pipeline.runner.contract import Context, Stage

    st = Stage(name="publish", run=lambda ctx: None, reads=(), inputs=("bench",))
    ctx = Context(cfg=None, stage=st, out=tmp_path, final=tmp_path, inputs={}, paths={},
                  manifests={"bench": {"result": MANIFEST_RESULTS["bench"]}, "build": {"result": {}}})
    assert isinstance(ctx.result("bench"), results.BenchResult) and ctx.result("bench").gates.verdict == "pass"
    with pytest.raises(KeyError, match="does not declare build"):
        ctx.result("build")
    ctx.manifests["bench"] = {"result": {**MANIFEST_RESULTS["bench"], "gates": {"verdict": "maybe"}}}
    with pytest.raises(StageFailed, match=r"the bench stage's recorded result is unreadable \(gates.verdict"):
        ctx.result("bench")
