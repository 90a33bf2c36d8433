"""A tokenizer small enough to make in a millisecond, for tests that render a repository around a stand-in checkpoint:
the package stage writes XGrammar's tokenizer info from the checkpoint's tokenizer, so it must load."""
from __future__ import annotations


def tiny_tokenizer():
    """A fast (``tokenizers``) word-level tokenizer of a few words, with an end token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<|endoftext|>", "<|im_end|>", "the", "capital", "of", "France", "is", "Paris", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
