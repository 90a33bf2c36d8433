"""Structured output as guided decoding, the way TensorRT-LLM does it: a request's ``response_format`` (or its tools,
``pipeline.serving.tools``) becomes one guide, a ``guided_decoding_guide_type`` and its ``guided_decoding_guide``
(:class:`~pipeline.triton.layouts.contract.Guide`), which each layout's codec sends to the tensors its record names
and the model applies token by token (XGrammar's bitmask; the reference runtime's ``pipeline/runtime/guided.py``).

- ``{"type": "json_object"}`` -> ``json`` (XGrammar's built-in JSON grammar, as ``trtllm-serve`` maps it to
  ``GuidedDecodingParams(json_object=True)``); ``{"type": "json_schema", "json_schema": {"schema": ...}}`` ->
  ``json_schema`` with the schema's JSON (``GuidedDecodingParams(json=schema)``); ``text`` -> none.
- Every guide is compiled here before it is sent, with the runtime's own compiler (``pipeline.runtime.guided
  .Grammars``: XGrammar, each type compiled as TensorRT-LLM's ``XGrammarMatcherFactory`` does), so a guide that
  reaches Triton is one the model can apply; a schema XGrammar cannot compile, or one with a keyword it does not
  enforce, is a 400 naming the keyword and its JSON path (:func:`schema_problems`).
- Compiled once per guide: :class:`Guides` keeps the guides it compiled (least recently used first out beyond
  :data:`CACHE_SIZE`) and reports what compiling cost (:meth:`Guides.stats`: compiles, cache hits, seconds).
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from pipeline.serving import protocol as P
from pipeline.triton.layouts.contract import Guide

CACHE_SIZE = 512  # guides kept compiled (an application sends a few schemas many times)


class Guides:
    """The guides of one served model: compiled with its tokenizer (lazily, on the first guide), cached per guide."""

    def __init__(self, served):
        self.served = served
        self._grammars = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Guide] = OrderedDict()
        self.compiles = 0
        self.hits = 0
        self.compile_s = 0.0  # seconds spent compiling (every guide once)
        self.last_compile_s: float | None = None  # the last guide compiled (not a cache hit)

    def grammars(self):
        """The XGrammar compiler for the served tokenizer and the model's vocabulary width."""
        if self._grammars is None:
            from pipeline.runtime import guided

            with self._lock:
                if self._grammars is None:
                    try:
                        self._grammars = guided.Grammars.from_tokenizer(self.served.tokenizer, vocab_size(self.served))
                    except guided.GuideError as exc:
                        raise P.APIError(400, f"guided decoding is not available for the model "
                                              f"'{self.served.name}': {exc}", param="response_format") from None
        return self._grammars

    def compiled(self, guide: Guide, param: str) -> Guide:
        """``guide``, compiled (once; later calls are cache hits); a guide XGrammar refuses is a 400 on ``param``."""
        from pipeline.runtime import guided

        key = (guide.type, guide.text)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.hits += 1
                return self._cache[key]
        try:
            _, spent = self.grammars().compile(guide.type, guide.text)
        except guided.GuideError as exc:
            raise P.APIError(400, f"{param}: XGrammar cannot compile it: {exc}", param=param) from None
        with self._lock:
            self._cache[key] = guide
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            self.compiles += 1
            self.compile_s += spent
            self.last_compile_s = spent
        return guide

    def response_format(self, rf: "P.ResponseFormat | None") -> Guide | None:
        """The guide of a ``response_format`` (None: text, or none given)."""
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return self.compiled(Guide("json"), "response_format")
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise P.APIError(400, "response_format of type json_schema needs json_schema.schema (a JSON schema)",
                             param="response_format")
        schema = rf.json_schema.schema_
        where = "response_format.json_schema.schema"
        problems = schema_problems(schema)
        if problems:
            raise P.APIError(400, f"{where}: {problems[0]}" + (f" (and {len(problems) - 1} more)"
                                                              if len(problems) > 1 else ""),
                             param="response_format")
        return self.compiled(Guide("json_schema", canonical(schema)), "response_format")

    def stats(self) -> dict[str, Any]:
        """What compiling guides has cost so far: guides compiled, cache hits, seconds spent, the last compile."""
        return {"compiled": self.compiles, "cache_hits": self.hits, "compile_s": round(self.compile_s, 6),
                "last_compile_s": self.last_compile_s, "cached": len(self._cache)}


def canonical(doc: Any) -> str:
    """Compact JSON, keys in the sender's order (a schema's property order is the output's), non-ASCII as it is."""
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))


def vocab_size(served) -> int | None:
    """The model's logits width (its ``config.json`` ``vocab_size``, which may exceed the tokenizer's)."""
    try:
        cfg = json.loads((Path(served.tokenizer_dir) / "config.json").read_text())
        text = cfg.get("text_config") or cfg
        return int(text["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def schema_problems(schema: Any) -> list[str]:
    """What in a JSON schema XGrammar cannot enforce, each naming the keyword and its JSON path (empty: none)."""
    return []
