"""fetch's GGUF conversion on a tiny GGUF file written here with gguf-py: transformers reads the file three times
(config, tokenizer, weights); fetch has them share one parse."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline import hardware
from pipeline.stages import fetch

TOKENS = ["<s>", "</s>", *(chr(c) for c in range(97, 123)), "ab", "abc"]


def _tiny_llama_gguf(path):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3] + [1] * (len(TOKENS) - 2))
    w.add_token_merges(["a b", "ab c"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(TOKENS), 16), "output_norm.weight": (16,),
              "blk.0.attn_norm.weight": (16,), "blk.0.ffn_norm.weight": (16,), "blk.0.attn_q.weight": (16, 16),
              "blk.0.attn_k.weight": (8, 16), "blk.0.attn_v.weight": (8, 16), "blk.0.attn_output.weight": (16, 16),
              "blk.0.ffn_gate.weight": (32, 16), "blk.0.ffn_up.weight": (32, 16), "blk.0.ffn_down.weight": (16, 32)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def counted_reads(monkeypatch):
    """gguf-py's reader, counting the files it parses."""
    import gguf

    parsed = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            parsed.append(str(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    return parsed


def test_the_conversion_parses_the_file_once(tmp_path, counted_reads):
    src = tmp_path / "tiny.gguf"
    _tiny_llama_gguf(src)
    cfg = hardware.compose([f"model.source=gguf://{src}", "model.dtype=float32"])
    ctx = SimpleNamespace(cfg=cfg, out=tmp_path / "out", paths={"store": tmp_path / "store"})
    ctx.out.mkdir()
    ctx.paths["store"].mkdir()
    result = fetch._from_gguf(ctx, str(src))
    assert counted_reads == [str(src)]
    hf_cfg = json.loads((ctx.out / "config.json").read_text())
    assert hf_cfg["num_hidden_layers"] == 1 and hf_cfg["hidden_size"] == 16 and "quantization_config" not in hf_cfg
    assert (ctx.out / "model.safetensors").is_file() and result["params"] > 0
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(ctx.out).convert_ids_to_tokens([29]) == ["abc"]


def test_negative_control_transformers_alone_parses_it_three_times(tmp_path, counted_reads):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tmp_path / "tiny.gguf"
    _tiny_llama_gguf(src)
    AutoTokenizer.from_pretrained(tmp_path, gguf_file=src.name)
    AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=src.name)
    assert len(counted_reads) == 3
