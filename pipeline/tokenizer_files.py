"""The files that make up a Hugging Face tokenizer, in one list: what fetch downloads with the config, what quantize
copies next to the exported checkpoint and what build links next to an engine (Triton's ``tokenizer_dir``)."""
from __future__ import annotations

import fnmatch

# glob patterns, matched against a file name
TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "*.model", "*.tiktoken",
                   "chat_template.*")
# a directory holds a loadable tokenizer when it has one of these
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def is_tokenizer_file(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in TOKENIZER_GLOBS)
