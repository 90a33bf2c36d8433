"""The KV-capacity planner, against hand-computed numbers."""
from __future__ import annotations

from pipeline import capacity, config

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
    qwen32b = capacity.shape_from(dict(config.compose(["model=qwen32b"]).model.shape))
    small = capacity.plan(qwen32b, "none", "fp8", 24, 8, max_seq_len=2048)  # 65 GB of bf16 weights on 24 GB GPUs
    assert small.fits and small.tp == 4
    none = capacity.plan(qwen32b, "none", "fp8", 24, 2, max_seq_len=2048)
    assert not none.fits
    crowded = capacity.plan(qwen32b, "fp8", "fp8", 80, 8, max_batch_size=512, max_seq_len=32768)
    assert crowded.warnings and "exceeds the KV pool" in crowded.warnings[0]
