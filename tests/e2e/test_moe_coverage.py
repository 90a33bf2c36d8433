"""MoE calibration coverage (pipeline/quant/modelopt.py ``ExpertTokens``, ``moe_coverage_problem``): after ModelOpt's
calibration every expert of a tiny synthetic Qwen3-MoE must have been reached by calibration tokens, or the quantize
step fails naming the (layer, expert) and the fix. The planted failure: a router row that can never win top-1."""
from __future__ import annotations

import pytest
import torch

from pipeline.errors import StageFailed
from pipeline.quant import modelopt

pytest.importorskip("modelopt")

EXPERTS = 4


def _tiny_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=128,
                         num_experts=EXPERTS, num_experts_per_tok=1, decoder_sparse_step=1,
                         architectures=["Qwen3MoeForCausalLM"])
    return Qwen3MoeForCausalLM(cfg).eval()


def _rows(seed: int = 1):
    return torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(seed))


def test_every_expert_reached_passes_and_is_counted():
    model = _tiny_moe()
    parts: dict = {}
    modelopt.calibrate(model, "fp8", "none", None, _rows(), 8, parts=parts)
    counts = parts["expert_tokens"]
    assert sorted(counts) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    # every token is routed to one expert (top-1) in each layer, and every expert got some
    assert all(sum(c) == 8 * 32 and min(c) > 0 and len(c) == EXPERTS for c in counts.values()), counts


def test_an_expert_the_router_never_picks_fails_naming_it():
    model = _tiny_moe()
    with torch.no_grad():  # layer 1's router: expert 0 or 1 always wins top-1 by far, expert 3 never does
        w = model.model.layers[1].mlp.gate.weight
        v = torch.randn(w.shape[1], generator=torch.Generator().manual_seed(2))
        w[0], w[1], w[3] = 100 * v, -100 * v, 0.0
    with pytest.raises(StageFailed) as err:
        modelopt.calibrate(model, "fp8", "none", None, _rows(), 8)
    msg = str(err.value)
    assert "layer 1 expert 3" in msg and "layer 0" not in msg, msg
    assert "quant.calib.num_samples" in msg and "moe_calib_experts_ratio" in msg
    assert "layer 1 expert 2" in msg  # 2's row is ordinary, but 0 or 1 always outscores it: also never reached


def test_dense_models_have_no_experts_to_count():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=128,
                                         architectures=["Qwen3ForCausalLM"])).eval()
    counter = modelopt.ExpertTokens(model)
    assert counter.counts == {} and modelopt.moe_coverage_problem(counter, model, 1, 8) is None
