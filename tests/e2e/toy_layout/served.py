"""The toy's model, for the front end: the checkpoint's own tokenizer, its ``max_seq_len`` parameter, prompts
tokenized with the special tokens (as its model.py does)."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from pipeline.triton.layouts.contract import Reading, params, resolve, to_int


def read(repo: Path, model_dirs: Mapping[str, Path]) -> Reading:
    p = params(repo / "tensorrt_llm" / "config.pbtxt")
    return Reading(tokenizer_dir=resolve(repo, p["checkpoint_dir"]), max_seq_len=to_int(p.get("max_seq_len")),
                   add_special_tokens=True)
