"""tiny-qwen3 as the fetch stage makes it (conf/model/tiny-qwen3.yaml: its trained byte-level tokenizer and seeded random
weights), loaded by the reference runtime on a device, with its batching engine: what the structured-output tests
decode with on the CPU (tests/unit/test_structured.py) and on CUDA (tests/gpu/test_guided_gpu.py)."""
from __future__ import annotations

from pathlib import Path


def build(out: Path, device: str = "cpu"):
    """-> (model, tokenizer, engine); the caller closes the engine."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline import synthetic
    from pipeline.runtime import decode_engine, reference
    from pipeline.stages.fetch import train_tokenizer

    tok = train_tokenizer(512)
    cfg = AutoConfig.for_model("qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               max_position_embeddings=2048, tie_word_embeddings=False, initializer_range=0.25,
                               vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                               bos_token_id=None, architectures=["Qwen3ForCausalLM"])
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    synthetic.write_checkpoint(meta, out, seed=0, std=0.25, device="cpu")
    meta.config.save_pretrained(out)
    tok.save_pretrained(out)
    model = reference.load(out, dtype=torch.float32, device=device)
    return model, tok, decode_engine.BatchEngine(model, max_batch_size=8)
