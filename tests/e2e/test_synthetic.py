"""A synthetic checkpoint as transformers reads it: sharded with its index, tied weights written once, the embedding's
padding row zero and norms one, as transformers' own initialisation does (tests/unit/test_synthetic.py: the
generator itself)."""
from __future__ import annotations

import json

import pytest
import torch

from pipeline import synthetic


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                               pad_token_id=3, initializer_range=0.1, architectures=["Qwen3ForCausalLM"],
                               tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out = tmp_path_factory.mktemp("ckpt")
    old = synthetic.SHARD_BYTES
    synthetic.SHARD_BYTES = 60_000  # several shards from a tiny model
    try:
        made = synthetic.write_checkpoint(model, out, seed=5, std=0.1, device="cpu")
    finally:
        synthetic.SHARD_BYTES = old
    model.config.save_pretrained(out)
    return out, made


def test_the_checkpoint_loads_in_transformers_as_written(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    out, made = tiny_checkpoint
    assert made["shards"] > 1 and (out / "model.safetensors.index.json").is_file()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in out.glob("model-*.safetensors")}
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    sd = model.state_dict()
    emb = sd["model.embed_tokens.weight"]
    assert torch.equal(emb, synthetic.noise(synthetic.tensor_key(5, "model.embed_tokens.weight"), tuple(emb.shape),
                                            0.1, torch.bfloat16, "cpu").index_fill_(0, torch.tensor([3]), 0))
    assert torch.count_nonzero(emb[3]) == 0  # the padding row, as transformers initialises it
    assert torch.equal(sd["model.norm.weight"], torch.ones_like(sd["model.norm.weight"]))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, written once
    assert made["params"] == sum(p.numel() for p in model.parameters())
