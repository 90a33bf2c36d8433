"""Guided decoding with XGrammar as TensorRT-LLM does it, for the reference runtime's decode loop and the front end's
checks (both compile a guide the same way, so a guide the front end accepts is one the runtime can apply).

- :func:`tokenizer_info_doc`: a tokenizer's vocabulary as TensorRT-LLM hands it to XGrammar for the C++ backend
  (NVIDIA/TensorRT-LLM ``tensorrt_llm/llmapi/tokenizer.py`` ``_xgrammar_tokenizer_info``: ``encoded_vocab``, the
  tokens in id order; ``tokenizer_str``, a fast tokenizer's JSON; ``stop_token_ids``, the end id), which
  ``examples/generate_xgrammar_tokenizer_info.py`` writes to ``xgrammar_tokenizer_info.json`` and the
  ``tensorrt_llm`` model's ``xgrammar_tokenizer_info_path`` parameter names.
- :class:`Grammars`: XGrammar's ``TokenizerInfo`` built from that document as TensorRT-LLM's
  ``XGrammarMatcherFactory`` builds it (``tensorrt_llm/_torch/pyexecutor/grammar_matcher.py``: the vocabulary type and
  prefix space detected from ``tokenizer_str``, the model's padded vocabulary size), one ``GrammarCompiler`` with its
  cache, and :meth:`Grammars.compile` per guide type as that factory's ``create`` (``json``: XGrammar's built-in JSON
  grammar; ``json_schema``; ``regex``; ``ebnf_grammar``; ``structural_tag``), each compiled once per guide.
- :class:`Matcher`: one sequence's grammar state: :meth:`Matcher.constrain` masks a logits row to the tokens the
  grammar allows next (XGrammar's token bitmask), :meth:`Matcher.accept` advances it by the chosen token.

Self-contained (xgrammar, torch and the standard library): the package stage copies it beside the reference
runtime's python models as ``reference_guided.py``.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any

# The guide types a request names, as the Triton backend maps guided_decoding_guide_type (NVIDIA/TensorRT-LLM
# triton_backend/inflight_batcher_llm/src/utils.cc getGuidedDecodingParamsFromTensors @ c8c6df08); the LLM API adds
# structural_tag (GuidedDecodingParams in tensorrt_llm/sampling_params.py).
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")
LLM_API_GUIDE_TYPES = (*GUIDE_TYPES, "structural_tag")
INFO_KEYS = ("encoded_vocab", "tokenizer_str", "stop_token_ids")  # xgrammar_tokenizer_info.json


class GuideError(ValueError):
    """A guide that cannot be compiled (its message says why)."""


def tokenizer_info_doc(tokenizer) -> dict[str, Any]:
    """``xgrammar_tokenizer_info.json`` for a Hugging Face tokenizer, as TensorRT-LLM's ``_xgrammar_tokenizer_info``
    makes it: the vocabulary in id order, the fast tokenizer's serialized JSON and ``[eos_token_id]``. A tokenizer
    that is not a fast one is refused, as there (a tiktoken vocabulary aside, which this project does not serve)."""
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise GuideError(f"guided decoding needs a fast tokenizer (tokenizer.json); {type(tokenizer).__name__} "
                         f"is not one")
    vocab = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])]
    return {"encoded_vocab": vocab, "tokenizer_str": tokenizer.backend_tokenizer.to_str(),
            "stop_token_ids": [tokenizer.eos_token_id]}


def read_tokenizer_info(path) -> dict[str, Any]:
    """``xgrammar_tokenizer_info.json`` as written by :func:`tokenizer_info_doc` (or NVIDIA's script)."""
    with open(path) as f:
        doc = json.load(f)
    missing = [k for k in ("encoded_vocab", "stop_token_ids") if k not in doc]
    if missing:
        raise GuideError(f"{path}: no {', '.join(missing)} (write it from the tokenizer: generate_xgrammar_"
                         f"tokenizer_info.py, or re-run package)")
    return doc


class Grammars:
    """XGrammar for one model: its tokenizer info (``doc``: :func:`tokenizer_info_doc`; ``vocab_size``: the model's
    logits width, which may exceed the tokenizer's), a compiler, and the guides compiled so far (``compiled``,
    ``compile_s``: their count and the seconds spent compiling them; a guide seen again is taken from the cache)."""

    def __init__(self, doc: dict[str, Any], vocab_size: int | None = None):
        import xgrammar

        self.xgr = xgrammar
        vocab = doc["encoded_vocab"]
        kind, prefix = xgrammar.VocabType.RAW, False
        if doc.get("tokenizer_str"):
            meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(doc["tokenizer_str"])
            kind, prefix = meta["vocab_type"], meta["add_prefix_space"]
        self.info = xgrammar.TokenizerInfo(vocab, vocab_type=kind, vocab_size=int(vocab_size or len(vocab)),
                                           stop_token_ids=doc["stop_token_ids"], add_prefix_space=prefix)
        self.vocab_size = self.info.vocab_size
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=True)
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], Any] = {}
        self.compiled = 0
        self.compile_s = 0.0

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None) -> "Grammars":
        return cls(tokenizer_info_doc(tokenizer), vocab_size)

    def compile(self, guide_type: str, guide: str | None) -> tuple[Any, float]:
        """(XGrammar's compiled grammar, the seconds this call spent compiling it: 0 when it was compiled before)
        for a guide, as TensorRT-LLM compiles each type. An unknown type or a guide XGrammar cannot compile is a
        :class:`GuideError` with XGrammar's reason."""
        if guide_type not in LLM_API_GUIDE_TYPES:
            raise GuideError(f"unknown guided_decoding_guide_type {guide_type!r} (TensorRT-LLM's: "
                             f"{', '.join(GUIDE_TYPES)})")
        if guide_type != "json" and not guide:
            raise GuideError(f"guide type {guide_type} needs a guide (guided_decoding_guide)")
        key = (guide_type, guide or "")
        with self._lock:
            hit = self._seen.get(key)
        if hit is not None:
            return hit, 0.0
        c = self.compiler
        start = time.perf_counter()
        try:
            if guide_type == "json":
                grammar = c.compile_builtin_json_grammar()
            elif guide_type == "json_schema":
                grammar = c.compile_json_schema(guide)
            elif guide_type == "regex":
                grammar = c.compile_regex(guide)
            elif guide_type == "ebnf_grammar":
                grammar = c.compile_grammar(guide)
            else:
                grammar = c.compile_structural_tag(guide)
        except Exception as exc:  # XGrammar raises RuntimeError/ValueError with the converter's message
            raise GuideError(first_line(exc)) from None
        spent = time.perf_counter() - start
        with self._lock:
            self._seen[key] = grammar
            self.compiled += 1
            self.compile_s += spent
        return grammar, spent

    def matcher(self, guide_type: str, guide: str | None) -> "Matcher":
        grammar, _ = self.compile(guide_type, guide)
        return Matcher(self, grammar)


class Matcher:
    """One sequence's grammar state. Duck-typed for the batching engine (``GenerationRequest.grammar``):
    :meth:`constrain` and :meth:`accept`."""

    __slots__ = ("xgr", "matcher", "bitmask")

    def __init__(self, grammars: Grammars, grammar):
        self.xgr = grammars.xgr
        self.matcher = self.xgr.GrammarMatcher(grammar)
        self.bitmask = self.xgr.allocate_token_bitmask(1, grammars.vocab_size)

    def constrain(self, logits) -> None:
        """Set to -inf, in place, every entry of the 1-D float ``logits`` row the grammar does not allow next (a
        row wider than the bitmask keeps its extra entries masked too)."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        row = logits.view(1, -1)
        self.xgr.apply_token_bitmask_inplace(row, self.bitmask.to(row.device))

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar does not allow it."""
        return bool(self.matcher.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


def first_line(exc: BaseException) -> str:
    """XGrammar's message without the C++ source location it starts with (``[time] /project/cpp/x.cc:75: ...``)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and "]" in text:
        text = text.split("]", 1)[1].strip()
        if ".cc:" in text.split(" ", 1)[0]:
            text = text.split(" ", 1)[1] if " " in text else text
    return text
