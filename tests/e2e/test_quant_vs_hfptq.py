"""``python -m benchmarks gpu_quant_vs_hfptq``: its step accounting and verdicts on hand-made records, and its CPU half (the
checkpoint, the calibration rows given to hf_ptq, the pipeline's quantize stage) on the tiny model. hf_ptq.py itself
needs a CUDA GPU (its main() refuses without one): on CPU its wrapper is checked to run hf_ptq.py's own ``__main__``
block, which stops there."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HF_PTQ = REPO / ".devcarry" / "hf_ptq"


@pytest.fixture(scope="module")
def bench():
    from benchmarks import gpu_quant_vs_hfptq

    return gpu_quant_vs_hfptq


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


def test_hfptq_calibrate_is_the_whole_mono_quantize_with_its_forward_loop_inside(bench):
    events = [_ev("import", 0.0, 5.0), _ev("mono_quantize", 22.0, 40.0), _ev("forward_loop", 23.0, 38.5),
              _ev("post_quantize", 41.0, 60.0)]
    assert bench.hfptq_calibrate(events) == {"calibrate_s": 18.0, "forward_loop_s": 15.5}
    steps = bench.hfptq_steps(events, exit_s=61.0)
    assert steps["mono_quantize"] == 2.5 and steps["forward_loop"] == 15.5  # own times: the loop is nested
    # the verdict uses the whole call (18 s), not mono_quantize's own 2.5 s
    prep, ours, hf = _records(ours_cal=19.0)
    hf.update(steps_s=steps, **bench.hfptq_calibrate(events))
    assert bench.compare(prep, ours, hf, GPU)["targets"]["calibrate_vs_hfptq"]["ratio"] == round(19 / 18, 3)
    assert bench.hfptq_calibrate([_ev("import", 0.0, 5.0)]) == {"calibrate_s": None, "forward_loop_s": None}


def _records(ours_s=80.0, hf_s=100.0, torch_gib=40.0, smi_gib=45.0, ours_cal=15.0, hf_cal=16.0, floor=10.0):
    w = 25 * 2**30
    prep = {"weight_bytes": w, "shape": "14b", "calibration": {"rows": 512, "seq_len": 512, "text": "calib.txt",
                                                               "identical_after_retokenizing": 512},
            "extension_build": {"process_s": 50.0},
            "bf16_floor": {"floor_s": floor, "floor_batch_size": 128, "runs": [{"batch_size": 128, "forward_s": floor}],
                           "params": 13.9e9, "tokens": 262144, "floor_tflops": 730.0, "arithmetic_floor_s": 9.2,
                           "max_memory_allocated": 27 * 2**30}}
    ours = {"returncode": 0, "stage_s": ours_s, "process_s": ours_s + 10, "torch_peak_gib": torch_gib,
            "nvidia_smi_peak_gib": smi_gib, "host_peak_rss_gib": 70.0, "host_peak_anon_rss_gib": 8.0,
            "batch_size": 128, "steps_s": {"load_s": 10.0, "calibrate_s": ours_cal},
            "export_check_parts_s": {"reload_s": 5.0}}
    hf = {"returncode": 0, "process_s": hf_s, "torch_peak_gib": 58.0, "nvidia_smi_peak_gib": 60.0,
          "host_peak_rss_gib": 62.0, "host_peak_anon_rss_gib": 5.0, "batch_size": 364, "args": ["--qformat", "fp8"],
          "steps_s": {"load_model": 9.0, "mono_quantize": hf_cal, "export_quantized": 40.0},
          "upstream_commit": "a2fbac7bad8"}
    return prep, ours, hf


GPU = {"name": "NVIDIA H200", "memory_gib": 139.8}


def test_the_verdicts_are_the_targets_side_by_side(bench):
    prep, ours, hf = _records()
    c = bench.compare(prep, ours, hf, GPU)
    t = c["targets"]
    assert t["calibrate_vs_hfptq"] == {"ratio": round(15 / 16, 3), "max": 1.1, "met": True}
    assert t["stage_vs_hfptq_process"] == {"ratio": 0.8, "max": 0.9, "met": True}
    assert t["calibrate_vs_bf16_floor"] == {"ratio": 1.5, "max": 1.6, "met": True}
    assert t["peak_vs_hfptq_peak"]["ratio"] == 0.75 and t["peak_vs_device_memory"]["ratio"] == round(45 / 139.8, 3)
    assert c["all_targets_met"] and c["ours"]["torch_peak_over_weights"] == round(40 / 25, 3)
    # negative controls: each target fails on its own planted miss
    misses = {"calibrate_vs_hfptq": dict(ours_cal=17.7), "stage_vs_hfptq_process": dict(ours_s=91.0),
              "calibrate_vs_bf16_floor": dict(ours_cal=16.5, hf_cal=16.0), "peak_vs_hfptq_peak": dict(smi_gib=61.0)}
    for key, kw in misses.items():
        got = bench.compare(*_records(**kw), GPU)
        assert not got["targets"][key]["met"] and not got["all_targets_met"], key
    assert not bench.compare(*_records(smi_gib=126.0), {**GPU, "memory_gib": 139.8})["targets"][
        "peak_vs_device_memory"]["met"]  # 0.90 x 139.8 = 125.8
    prep, ours, hf = _records()
    hf["returncode"] = 1
    failed = bench.compare(prep, ours, hf, GPU)
    assert failed["time_ratio"] is None and not failed["all_targets_met"]  # a failed run has no ratio
    assert failed["targets"]["calibrate_vs_bf16_floor"]["met"]  # the stage's own floor ratio stands without it


def test_the_section_states_the_targets_the_floor_and_the_dirty_tree(bench):
    prep, ours, hf = _records(ours_s=150.0)
    doc = {"date": "2026-12-01T01:00:00+00:00", "commit": "abc+dirty", "gpu": GPU, "quant": "nvfp4",
           "prepare": prep, "ours": ours, "hfptq": hf, "compare": bench.compare(prep, ours, hf, GPU)}
    text = "\n".join(bench.render(doc))
    assert "commit abc+dirty (uncommitted changes in the tree that ran)" in text
    assert "nvfp4 weights + fp8 KV cache (for b200, calibrated here)" in text
    assert "| whole stage / hf_ptq's process | 1.50× | ≤ 0.9× | **not met** |" in text
    assert "| pipeline quantize stage | 150.0 | 15.0 | 128 | 40.00 (1.60×) | 45.00 (1.80×) | 8.0 |" in text
    assert "| bf16 forward floor (same rows, unquantized) | — | 10.0 | 128 |" in text
    assert "export 40.0" in text and "load 9.0" in text
    assert "calibrate step's parts" not in text  # an older record without them
    ours["calibrate_parts_s"] = {"forward_loop_s": 12.5, "forward_loops": 1, "batches_s": [4.0, 3.0, 3.0, 2.5],
                                 "insert_and_finish_s": 2.5}
    hf.update(calibrate_s=16.0, forward_loop_s=14.0)
    text = "\n".join(bench.render({**doc, "compare": bench.compare(prep, ours, hf, GPU)}))
    assert ("The stage: forward loop 12.5 s (1 loop; the first loop's batches 4.0, 3.0, 3.0, 2.5 s, the first "
            "loading ModelOpt's CUDA extensions), quantizer insertion and finish 2.5 s; hf_ptq.py: forward loop "
            "14.0 s of its 16.0 s.") in text


@pytest.mark.slow
def test_the_cpu_half_runs_on_the_tiny_model_with_the_stages_own_rows(tmp_path):
    script = [sys.executable, "-m", "benchmarks", "gpu_quant_vs_hfptq", "--root", str(tmp_path), "--shape",
              "tiny", "--rows", "24", "--seq", "128", "--hf-ptq", str(HF_PTQ)]
    proc = subprocess.run([*script, "--step", "prepare"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    prep = json.loads((tmp_path / "prepare.json").read_text())
    rows = [json.loads(line)["text"] for line in (tmp_path / "calib_rows.jsonl").read_text().splitlines()]
    assert len(rows) == prep["calibration"]["rows"] == 24
    assert prep["calibration"]["identical_after_retokenizing"] == 24
    proc = subprocess.run([*script, "--step", "ours"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = json.loads((tmp_path / "ours-fp8.json").read_text())
    assert ours["export_check"] == "pass" and ours["quant_algo"] == "FP8" and ours["kv_cache_quant_algo"] == "FP8"
    assert set(ours["steps_s"]) >= {"load_s", "calibrate_s", "export_s", "export_check_s"}
    assert ours["gpu_memory"]["calibrated_model_freed_before_proof"] is True
    assert not list((tmp_path / ".store").glob("*quantize-*/checkpoint/*.safetensors"))  # measured, then deleted
    if not (HF_PTQ / "hf_ptq.py").is_file():
        pytest.skip("ModelOpt's examples/hf_ptq is not in .devcarry/hf_ptq (git-ignored upstream code)")
    proc = subprocess.run([*script, "--step", "hfptq"], cwd=REPO, capture_output=True, text=True, timeout=600)
    hf = json.loads((tmp_path / "hfptq-fp8.json").read_text())
    assert proc.returncode == 1 and "GPU is required" in hf["error"]  # hf_ptq.py's own main() ran, and refused
    assert hf["steps_s"]["import"] > 0
