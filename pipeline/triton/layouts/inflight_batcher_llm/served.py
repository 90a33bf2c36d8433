"""What an ``inflight_batcher_llm`` repository says about its model, for the front end: the tokenizer is
preprocessing's ``tokenizer_dir`` and text prompts are tokenized with its ``add_special_tokens``; the context length
is the reference model's ``max_seq_len`` parameter, else the engine's ``build_config.max_seq_len``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from pipeline.errors import UserError
from pipeline.triton.layouts.contract import Reading, params, resolve, special_tokens_flag, to_int
from pipeline.triton.layouts.record import ENGINE_REL


def read(repo: Path, model_dirs: Mapping[str, Path]) -> Reading:
    if "preprocessing" not in model_dirs:
        raise UserError(f"{repo}: an inflight_batcher_llm repository without preprocessing/ (its tokenizer)")
    pre = params(repo / "preprocessing" / "config.pbtxt")
    if not pre.get("tokenizer_dir"):
        raise UserError(f"{repo}/preprocessing/config.pbtxt: no tokenizer_dir parameter")
    llm = params(repo / "tensorrt_llm" / "config.pbtxt") if "tensorrt_llm" in model_dirs else {}
    max_seq = to_int(llm.get("max_seq_len"))
    if max_seq is None:
        engine = resolve(repo, llm.get("gpt_model_path") or ENGINE_REL) / "config.json"
        try:
            max_seq = to_int((json.loads(engine.read_text()).get("build_config") or {}).get("max_seq_len"))
        except (OSError, ValueError):
            max_seq = None
    return Reading(tokenizer_dir=resolve(repo, pre["tokenizer_dir"]), max_seq_len=max_seq,
                   add_special_tokens=special_tokens_flag(pre.get("add_special_tokens")))
