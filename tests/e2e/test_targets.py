"""Targets end to end: plan-time refusals from the CLI, the TRT-LLM runtimes on a GPU, the local fan-out launchers,
and ``build --json``. Sweeps through ``hydra/launcher=pipeline_slurm`` run on a real Slurm cluster in
``tests/e2e/test_slurm.py``. The in-process rules are in ``tests/unit/`` (test_compat, test_capacity, test_config,
test_trtllm, test_build, test_launcher)."""
from __future__ import annotations

import json
import time

import pytest

from pipeline import config, hardware
from tests.conftest import TINY, run_cli
from tests.helpers.requires import requires_gpu


def test_plan_refuses_nvfp4_on_h100_within_seconds_and_writes_nothing(tmp_path):
    t0 = time.perf_counter()
    proc = run_cli("plan", "model=qwen32b", "quant=nvfp4", "target=h100", root=tmp_path)
    assert time.perf_counter() - t0 < 10
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: nvfp4 needs Blackwell (sm100/sm120); for h100 use fp8 or int4_awq, or target=b200 to calibrate here for Blackwell"
    assert not any(tmp_path.rglob("*"))


def test_plan_json_shows_chosen_tp_and_kv_capacity_table(tmp_path):
    proc = run_cli("plan", "--json", "model=qwen32b", "quant=fp8", "target=h100", "runtime=trtllm_engine",
                   root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    cap = doc["capacity"]
    # TP chosen, not set: the service profile's choice among the TPs that fit (NVIDIA's performance model)
    assert doc["tp"] == cap["tp"] == doc["serving"]["profile"]["chosen"]["tp"] and cap["tp_chosen_by_planner"]
    rows = {r["kv_dtype"]: r for r in cap["table"]}
    tp = cap["tp"]
    assert rows["bf16"]["kv_kib_per_token_per_gpu"] == 256.0 / tp  # 64 layers × 8 KV heads / TP × 128 × 2 × 2 B
    assert rows["fp8"]["kv_kib_per_token_per_gpu"] == 128.0 / tp
    assert rows["fp8"]["max_tokens"] == 2 * rows["bf16"]["max_tokens"] or \
        abs(rows["fp8"]["max_tokens"] - 2 * rows["bf16"]["max_tokens"]) <= 1
    assert any("needs its GPU" in p for p in doc["not_buildable_here"])


def test_plan_refuses_a_model_that_does_not_fit_the_target(tmp_path):
    proc = run_cli("plan", "model=qwen32b", "quant=none", "target=a10g", "build.tp_size=1", root=tmp_path)
    assert proc.returncode == 2 and "does not fit on a10g" in proc.stderr


def test_trtllm_runtime_refused_clearly_without_tensorrt_llm(tmp_path):
    proc = run_cli("build", "model=tiny-qwen3", "target=h100", "runtime=trtllm_llmapi", root=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "needs its GPU" in proc.stderr and "TensorRT-LLM, which is not installed here" in proc.stderr
    assert not any(tmp_path.rglob("*.safetensors"))


@pytest.mark.slow  # ~60 s: two jobs through submitit's local executor
def test_multirun_with_submitit_local_shares_one_quantize(tmp_path):
    root = tmp_path / "sweep"
    proc = run_cli("build", "-m", *TINY, "build.max_batch_size=4,8", "until=package",
                   "hydra/launcher=submitit_local", root=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = "".join(p.read_text() for p in (root / ".store" / "logs").glob("*.log"))
    assert logs.count("stage quantize: ran") == 1
    assert logs.count("stage quantize: cached") == 1
    assert logs.count("stage package: ran") == 2  # one per job: the batch size differs
    assert len(list(root.glob(".store/*-quantize-*/manifest.json"))) == 1


@pytest.mark.slow  # ~40 s: calibration plus a TP=2 TRT-LLM checkpoint export
def test_engine_runtime_gets_a_trtllm_checkpoint_with_the_build_mapping(tmp_path):
    proc = run_cli("build", *TINY, "target=h100", "runtime=trtllm_engine", "build.tp_size=2", "until=quantize",
                   root=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = next(tmp_path.glob(".store/*-quantize-*/manifest.json")).parent
    trt = json.loads((out / "trtllm_checkpoint" / "config.json").read_text())
    assert trt["mapping"]["tp_size"] == 2 and trt["mapping"]["world_size"] == 2
    assert trt["quantization"]["quant_algo"] == "FP8" and trt["quantization"]["kv_cache_quant_algo"] == "FP8"
    # written as TensorRT-LLM's QWenConfig.from_hugging_face would, though tensorrt_llm does not import here
    assert (trt["architecture"], trt["qwen_type"], trt["attn_bias"]) == ("Qwen3ForCausalLM", "qwen3", False)
    assert sorted(p.name for p in (out / "trtllm_checkpoint").glob("rank*.safetensors")) == \
        ["rank0.safetensors", "rank1.safetensors"]
    assert (out / "checkpoint" / "hf_quant_config.json").is_file()  # the unified checkpoint, always
    # the reference runtime's quantize output does not carry it, and is a different (shared) output
    proc = run_cli("plan", "--json", *TINY, root=tmp_path)
    q = next(s for s in json.loads(proc.stdout)["stages"] if s["stage"] == "quantize")
    assert q["output"] != str(out)


def test_sweep_with_every_job_refused_exits_2_naming_them(tmp_path):
    proc = run_cli("plan", "-m", "model=qwen32b", "target=h100,h200", "quant=nvfp4", root=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error: 2 problems: ") and proc.stderr.count("nvfp4 needs Blackwell") == 2


@pytest.mark.slow  # a sweep of its own (a CPU build to its engine stage)
def test_local_sweep_skips_the_jobs_this_machine_cannot_build(tmp_path):
    """The basic launcher runs every job here, so this machine's checks (a GPU of the target's SM) apply before
    launch: the h100 job is listed and left out, the cpu job runs."""
    proc = run_cli("build", "-m", *TINY, "target=cpu,h100", "until=build", root=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped target=h100: target h100 (sm90) needs its GPU to build" in proc.stderr
    assert "hydra/launcher=pipeline_slurm" in proc.stderr
    assert [p.name for p in (tmp_path / "reports").glob("*.json")] == ["tiny-qwen3.fp8-kvfp8.cpu.reference.json"]


def test_target_auto_under_multirun_reaches_each_job_resolved(tmp_path):
    proc = run_cli("plan", "-m", "--json", *TINY, "target=auto", "quant=fp8,none", root=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dec, text, docs = json.JSONDecoder(), proc.stdout.strip(), []
    while text:
        doc, end = dec.raw_decode(text)
        docs.append(doc)
        text = text[end:].strip()
    expected = hardware.detect_target(config.shipped_targets())  # cpu on a machine without an NVIDIA GPU
    assert [(d["quant"], d["target"]) for d in docs] == [("fp8", expected), ("none", expected)]


def test_build_json_prints_the_build_report_on_stdout(tmp_path):
    proc = run_cli("build", "--json", *TINY, "until=fetch", root=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc == json.loads((tmp_path / "reports" / "tiny-qwen3.fp8-kvfp8.cpu.reference.json").read_text())
    assert [r["stage"] for r in doc["stages"]] == ["fetch"] and doc["stages"][0]["status"] == "ran"
    assert "total" in proc.stderr and "report:" in proc.stderr  # the human summary stays on stderr


