"""What an ``llmapi`` repository says about its model, for the front end: the tokenizer is the ``engine_dir``
parameter (the reference model's), else ``model.yaml``'s ``tokenizer`` or ``model``, resolved as the python model
resolves it; the context length is the ``max_seq_len`` parameter, else ``model.yaml``'s; text prompts are tokenized
with the special tokens, as the LLM API does."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from pipeline.triton.layouts.contract import Reading, params, resolve, to_int
from pipeline.triton.layouts.record import ENGINE_REL


def read(repo: Path, model_dirs: Mapping[str, Path]) -> Reading:
    import yaml

    yaml_path = repo / "tensorrt_llm" / "1" / "model.yaml"
    doc = yaml.safe_load(yaml_path.read_text()) or {}
    p = params(repo / "tensorrt_llm" / "config.pbtxt")
    tok = p.get("engine_dir") or doc.get("tokenizer") or doc.get("model") or ENGINE_REL
    tok_dir = resolve(repo, str(tok)) if (os.path.isabs(str(tok)) or p.get("engine_dir")) \
        else (yaml_path.parent / str(tok)).resolve()
    if not tok_dir.exists():
        tok_dir = resolve(repo, str(tok))
    return Reading(tokenizer_dir=tok_dir, max_seq_len=to_int(p.get("max_seq_len")) or to_int(doc.get("max_seq_len")),
                   add_special_tokens=True)
