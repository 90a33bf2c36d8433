"""benchmarks/gpu_quant_vs_hfptq.py: its step accounting and verdicts on hand-made records, and its CPU half (the
checkpoint, the calibration rows given to hf_ptq, the pipeline's quantize stage) on the tiny model. hf_ptq.py itself
needs a CUDA GPU (its main() refuses without one): on CPU its wrapper is checked to run hf_ptq.py's own ``__main__``
block, which stops there."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HF_PTQ = REPO / ".devcarry" / "hf_ptq"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_quant_vs_hfptq", REPO / "benchmarks" / "gpu_quant_vs_hfptq.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec.loader.exec_module(mod)
    return mod


def _ev(name, start, end):
    return {"name": name, "start": start, "end": end}


def test_hfptq_steps_subtract_nested_calls_and_keep_the_rest_as_other(bench):
    events = [_ev("import", 0.0, 5.0), _ev("load_model", 6.0, 16.0), _ev("get_max_batch_size", 16.5, 18.5),
              _ev("make_calib_dataloader", 18.5, 19.0), _ev("pre_quantize", 19.0, 22.0),
              _ev("mono_quantize", 22.0, 25.0), _ev("export_quantized", 40.0, 80.0), _ev("post_quantize", 26.0, 81.0)]
    steps = bench.hfptq_steps(events, exit_s=82.0)
    assert steps["post_quantize"] == 15.0 and steps["export_quantized"] == 40.0  # 55 s, of which 40 s export
    assert steps["load_model"] == 10.0 and steps["get_max_batch_size"] == 2.0
    assert steps["other"] == pytest.approx(82.0 - (5 + 10 + 2 + 0.5 + 3 + 3 + 55))
    assert sum(steps.values()) == pytest.approx(82.0)
    # negative control: without the nesting rule the export would be counted twice
    assert sum(e["end"] - e["start"] for e in events) > 82.0


def _records(ours_s=120.0, hf_s=100.0, torch_gib=65.0, smi_gib=66.0):
    w = 60 * 2**30
    prep = {"weight_bytes": w, "shape": "32b", "calibration": {"rows": 24, "seq_len": 128,
                                                               "identical_after_retokenizing": 24},
            "extension_build": {"process_s": 50.0}}
    ours = {"returncode": 0, "stage_s": ours_s, "process_s": ours_s + 10, "torch_peak_gib": torch_gib,
            "nvidia_smi_peak_gib": smi_gib, "host_peak_rss_gib": 70.0, "host_peak_anon_rss_gib": 8.0, "batch_size": 24,
            "steps_s": {"load_s": 10.0}, "export_check_parts_s": {"reload_s": 5.0}}
    hf = {"returncode": 0, "process_s": hf_s, "torch_peak_gib": 130.0, "nvidia_smi_peak_gib": 131.0,
          "host_peak_rss_gib": 62.0, "host_peak_anon_rss_gib": 5.0, "batch_size": 512, "args": ["--qformat", "fp8"],
          "steps_s": {"load_model": 9.0, "export_quantized": 40.0}, "upstream_commit": "a2fbac7bad8"}
    return prep, ours, hf


def test_the_verdicts_divide_by_the_weights_and_by_hf_ptqs_time(bench):
    prep, ours, hf = _records()
    c = bench.compare(prep, ours, hf)
    assert c["time_ratio"] == 1.2 and c["time_within_1_2x"]
    assert c["ours"]["torch_peak_over_weights"] == round(65 / 60, 3) and c["memory_within_1_1x"]
    assert c["hfptq"]["nvidia_smi_peak_over_weights"] == round(131 / 60, 3)
    # negative controls: slower than 1.2x, or nvidia-smi above 1.1x (torch within), fail their verdicts
    assert not bench.compare(*_records(ours_s=121.0))["time_within_1_2x"]
    assert not bench.compare(*_records(smi_gib=67.0))["memory_within_1_1x"]
    prep, ours, hf = _records()
    hf["returncode"] = 1
    assert bench.compare(prep, ours, hf)["time_ratio"] is None  # a failed run has no ratio


def test_the_section_states_the_ratio_and_the_peaks(bench):
    prep, ours, hf = _records(ours_s=150.0)
    doc = {"date": "2026-12-01T01:00:00+00:00", "commit": "abc", "gpu": {"name": "NVIDIA H200"}, "prepare": prep,
           "ours": ours, "hfptq": hf, "compare": bench.compare(prep, ours, hf)}
    text = bench.render(doc)
    assert "stage / hf_ptq = 1.50×** (target ≤ 1.2×: not met)" in text
    assert "| pipeline quantize stage | 150.0 | 65.00 (1.08×) | 66.00 (1.10×) |" in text
    assert "export 40.0" in text and "load 9.0" in text


@pytest.mark.slow
def test_the_cpu_half_runs_on_the_tiny_model_with_the_stages_own_rows(tmp_path):
    script = [sys.executable, str(REPO / "benchmarks" / "gpu_quant_vs_hfptq.py"), "--root", str(tmp_path), "--shape",
              "tiny", "--hf-ptq", str(HF_PTQ)]
    proc = subprocess.run([*script, "--step", "prepare"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    prep = json.loads((tmp_path / "prepare.json").read_text())
    rows = [json.loads(line)["text"] for line in (tmp_path / "calib_rows.jsonl").read_text().splitlines()]
    assert len(rows) == prep["calibration"]["rows"] == 24
    assert prep["calibration"]["identical_after_retokenizing"] == 24
    proc = subprocess.run([*script, "--step", "ours"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = json.loads((tmp_path / "ours.json").read_text())
    assert ours["export_check"] == "pass" and ours["quant_algo"] == "FP8" and ours["kv_cache_quant_algo"] == "FP8"
    assert set(ours["steps_s"]) >= {"load_s", "calibrate_s", "export_s", "export_check_s"}
    assert ours["gpu_memory"]["calibrated_model_freed_before_proof"] is True
    assert not list((tmp_path / ".store").glob("*quantize-*/checkpoint/*.safetensors"))  # measured, then deleted
    if not (HF_PTQ / "hf_ptq.py").is_file():
        pytest.skip("ModelOpt's examples/hf_ptq is not in .devcarry/hf_ptq (git-ignored upstream code)")
    proc = subprocess.run([*script, "--step", "hfptq"], capture_output=True, text=True, timeout=600)
    hf = json.loads((tmp_path / "hfptq.json").read_text())
    assert proc.returncode == 1 and "GPU is required" in hf["error"]  # hf_ptq.py's own main() ran, and refused
    assert hf["steps_s"]["import"] > 0
