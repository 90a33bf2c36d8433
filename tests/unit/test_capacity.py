"""The KV-capacity planner, against hand-computed numbers."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from pipeline import capacity, hardware

LLAMA31_8B = capacity.Shape(params=8.03e9, num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32,
                            num_kv_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False)


def test_kv_bytes_per_token_hand_computed():
    assert capacity.kv_bytes_per_token(LLAMA31_8B, "bf16") == 128 * 1024
    assert capacity.kv_bytes_per_token(LLAMA31_8B, "fp8") == 64 * 1024
    assert capacity.kv_bytes_per_token(LLAMA31_8B, "bf16", tp=2) == 64 * 1024  # 4 KV heads per rank
    assert capacity.kv_bytes_per_token(LLAMA31_8B, "bf16", tp=16) == 16 * 1024  # 8 heads over 16 ranks: replicated
    assert capacity.kv_bytes_per_token(LLAMA31_8B, "bf16", pp=2) == 64 * 1024  # half the layers per stage


def test_pool_tokens_and_sequences_hand_computed():
    p = capacity.plan(LLAMA31_8B, "fp8", "fp8", 80, 8, tp=1, fraction=0.9, max_num_tokens=8192,
                      input_len=1024, output_len=256)
    embed = 128256 * 4096 * 2
    weights = embed * 2 + (8.03e9 - embed) * 1.0
    act = 1.5e9 + 8192 * (4 * 4096 + 2 * 14336) * 2
    pool = (80e9 - weights - act) * 0.9
    fp8 = p.row("fp8")
    assert abs(p.weights_bytes_per_gpu - weights) < 1 and abs(fp8.pool_bytes - pool) < 1
    assert fp8.max_tokens == int(pool // (64 * 1024)) and fp8.max_sequences == fp8.max_tokens // 1280
    assert p.row("bf16").max_tokens == int(pool // (128 * 1024))


def test_planner_picks_the_smallest_tp_that_fits_and_warns_on_worst_case_demand():
    qwen32b = capacity.shape_from(dict(hardware.compose(["model=qwen32b"]).model.shape))
    small = capacity.plan(qwen32b, "none", "fp8", 24, 8, max_seq_len=2048)  # 65 GB of bf16 weights on 24 GB GPUs
    assert small.fits and small.tp == 4
    none = capacity.plan(qwen32b, "none", "fp8", 24, 2, max_seq_len=2048)
    assert not none.fits
    crowded = capacity.plan(qwen32b, "fp8", "fp8", 80, 8, max_batch_size=512, max_seq_len=32768)
    assert crowded.warnings and "exceeds the KV pool" in crowded.warnings[0]


QWEN32B_SYNTH = {"hidden_size": 5120, "intermediate_size": 25600, "num_heads": 64, "num_kv_heads": 8, "head_dim": 128,
                 "vocab_size": 65536}


def test_row_bytes_hand_computed():
    s = {"hidden_size": 8, "intermediate_size": 16, "num_heads": 2, "num_kv_heads": 1, "head_dim": 4,
         "vocab_size": 10}
    per_token = (3 * 8 + (2 * 2 + 2 * 1) * 4 + 3 * 16) * 2 + 2 * 16 * 4 + 10 * (2 + 4)
    assert capacity.row_bytes(s, 5) == capacity.ROW_SAFETY * (5 * per_token + 2 * 5 * 5 * 4)
    # the logits dominate a large vocabulary: twice the vocabulary, nearly twice the bytes
    big = capacity.row_bytes({**QWEN32B_SYNTH, "vocab_size": 151936}, 128)
    assert 1.5 < big / capacity.row_bytes(QWEN32B_SYNTH, 128) < 2.5


def test_calibration_memory_is_the_weights_plus_the_bounded_batch_and_context():
    assert capacity.memory_estimate(32.8) == {"weights_gb": 65.6, "activations_and_context_gb": 6.56,
                                              "peak_gb": 72.16}
    # small models: the CUDA context and one row exceed a tenth of the weights
    assert capacity.memory_estimate(0.5, row=0.2e9) == {"weights_gb": 1.0, "activations_and_context_gb": 1.2,
                                                        "peak_gb": 2.2}
    # spread over 8 GPUs: a tenth of each GPU's share is below the context each GPU needs
    assert capacity.memory_estimate(32.8, row=0.1e9, devices=8)["activations_and_context_gb"] == 8.8


def test_calibration_fit_on_gpus_names_the_gpus_that_would_do():
    args = dict(device="cuda", target="a10g", memory_gb=24.0)
    problem = capacity.calibration_fit_problem("qwen32b", 32.8, gpus_per_node=1, **args)
    assert problem == ("qwen32b needs ~72 GB to calibrate (65.6 GB of bf16 weights + 6.6 GB of activations and "
                       "CUDA context); target a10g has 1× 24 GB: run quantize on 1× 141 GB GPU or 1× 80 GB GPU or "
                       "2× 48 GB GPUs")
    assert capacity.calibration_fit_problem("qwen32b", 32.8, gpus_per_node=4, **args) is None  # 4 × 24 × 0.92
    assert capacity.calibration_fit_problem("qwen32b", 32.8, gpus_per_node=3, **args) is not None  # 66 GB < 72
    assert capacity.calibration_fit_problem("unknown", 0.0, gpus_per_node=1, **args) is None  # size not declared


def test_one_h100_80gb_calibrates_32b_within_the_bound_but_not_a_larger_model():
    args = dict(device="cuda", target="h100", memory_gb=80.0, gpus_per_node=1)
    row = capacity.row_bytes({**QWEN32B_SYNTH, "vocab_size": 151936}, 128)
    assert capacity.calibration_fit_problem("qwen32b", 32.8, row=row, **args) is None  # 72.2 GB <= 73.6 GB
    problem = capacity.calibration_fit_problem("qwen36b", 36.0, row=row, **args)  # 79.2 GB > 73.6 GB
    assert problem and problem.startswith("qwen36b needs ~79 GB to calibrate")
    assert "target h100 has 1× 80 GB" in problem
    # what the stage peaked at before its batches were bounded (1.52 × the weights) would not have fit
    assert 1.52 * 65.6 > 80 * 0.92


def test_calibration_fit_on_cpu_reads_this_hosts_memory(monkeypatch):
    import psutil

    found = {}
    for total_gb in (24, 100):  # 72 GB needed, 80% of the host usable
        monkeypatch.setattr(psutil, "virtual_memory", lambda t=total_gb: SimpleNamespace(total=t * 10**9))
        found[total_gb] = capacity.calibration_fit_problem("qwen32b", 32.8, device="cpu", target="cpu", memory_gb=0,
                                                           gpus_per_node=1)
    assert found[100] is None
    assert "target cpu calibrates on this host, which has 24 GB of memory and no GPU" in found[24]


def test_bytes_per_param_of_an_export_counts_packed_4_bit_weights_twice(tmp_path):
    save_file({"a.weight": torch.zeros(64, 32, dtype=torch.bfloat16)}, str(tmp_path / "bf16.safetensors"))
    assert capacity.bytes_per_param(tmp_path) == 2.0
    (tmp_path / "bf16.safetensors").unlink()
    # FP8: one byte per weight, plus a 4-byte scale (not a parameter)
    save_file({"a.weight": torch.zeros(64, 32, dtype=torch.float8_e4m3fn),
               "a.weight_scale": torch.ones((), dtype=torch.float32)}, str(tmp_path / "fp8.safetensors"))
    assert capacity.bytes_per_param(tmp_path) == round((64 * 32 + 4) / (64 * 32), 4)
    (tmp_path / "fp8.safetensors").unlink()
    # 4-bit packed two per byte in uint8, with bf16 group scales of 16
    save_file({"a.weight": torch.zeros(64, 16, dtype=torch.uint8),
               "a.weight_scale": torch.ones(64, 2, dtype=torch.bfloat16)}, str(tmp_path / "w4.safetensors"))
    assert capacity.bytes_per_param(tmp_path) == round((64 * 16 + 64 * 2 * 2) / (64 * 32), 4)
    assert capacity.bytes_per_param(tmp_path / "empty") is None


QWEN14B = {"hidden_size": 5120, "intermediate_size": 17408, "num_heads": 40, "num_kv_heads": 8, "head_dim": 128,
           "vocab_size": 65536}


def _batch_plan(shape, weights, free, total, rows=512, seq=512):
    """capacity.batch_plan for one GPU with ``free`` of ``total`` bytes free after ``weights`` bytes of bf16 weights."""
    return capacity.batch_plan("auto", shape=shape, weight_bytes={"cuda:0": int(weights)},
                               free={"cuda:0": {"free": int(free), "total": int(total)}}, dtype_bytes=2, seq_len=seq,
                               device="cuda", rows=rows, eval_seq_len=128, eval_rows=6)


def test_batches_are_sized_to_the_free_memory_with_a_margin_and_a_token_cap():
    # 14B shape on an H200: ~115 GB free after 29.5 GB of weights; the token cap (64k tokens = 128 rows) binds
    total = 150.1e9
    p = _batch_plan(QWEN14B, 29.5e9, 115e9, total)
    assert p["budget_bytes"] == int(115e9 - capacity.MARGIN_FRACTION * total)
    assert p["batch_size"] == capacity.BATCH_TOKENS // 512 == 128
    assert 29.5e9 + p["batch_size"] * p["row_bytes"] <= 0.9 * total
    assert p["eval_batch_size"] == 6 and p["eval_row_bytes"] > capacity.row_bytes(QWEN14B, 128, logits=False)
    # 32B on an 80 GB GPU: ~13.9 GB free after the weights; memory binds, and the peak stays under 0.9 × the GPU
    w32, total = 65.6e9, 80e9
    p = _batch_plan({**QWEN32B_SYNTH, "vocab_size": 151936}, w32, total - w32 - 0.5e9, total)
    assert 1 < p["batch_size"] < 128
    assert w32 + 0.5e9 + p["batch_size"] * p["row_bytes"] <= 0.9 * total < w32 + 0.5e9 + (p["batch_size"] + 1) * \
        p["row_bytes"] + capacity.MARGIN_FRACTION * total
    # negative control: sizing to all the free memory (what a probe does) would break the 0.9 bound
    assert w32 + (total - w32 - 0.5e9) > 0.9 * total
    # less free than the margin: one row, never zero
    assert _batch_plan(QWEN14B, 29.5e9, 5e9, total)["batch_size"] == 1


def test_calibration_rows_skip_the_logits_that_evaluation_keeps():
    full, calib = capacity.row_bytes(QWEN14B, 512), capacity.row_bytes(QWEN14B, 512, logits=False)
    assert full - calib == pytest.approx(capacity.ROW_SAFETY * 511 * 65536 * (2 + 4))
