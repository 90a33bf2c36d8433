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
        self._built: OrderedDict[str, Guide] = OrderedDict()  # :meth:`built`
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

    def cached(self, guide: Guide) -> bool:
        """Whether ``guide`` was compiled before (then counted as a cache hit)."""
        key = (guide.type, guide.text)
        with self._lock:
            if key not in self._cache:
                return False
            self._cache.move_to_end(key)
            self.hits += 1
            return True

    def compiled(self, guide: Guide, param: str) -> Guide:
        """``guide``, compiled (once; later calls are cache hits); a guide XGrammar refuses is a 400 on ``param``."""
        from pipeline.runtime import guided

        if self.cached(guide):
            return guide
        key = (guide.type, guide.text)
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

    def built(self, key: str, build, param: str) -> Guide:
        """The compiled guide that ``build()`` makes (and checks), built once per ``key`` (a canonical description of
        what it is made from: the tools' guide is built with XGrammar's grammar combinators, which cost as much as a
        compile)."""
        with self._lock:
            guide = self._built.get(key)
            if guide is not None:
                self._built.move_to_end(key)
        if guide is None:
            guide = build()
            with self._lock:
                self._built[key] = guide
                while len(self._built) > CACHE_SIZE:
                    self._built.popitem(last=False)
        return self.compiled(guide, param)

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
        guide = Guide("json_schema", canonical(json_strings(schema)))
        if self.cached(guide):  # checked and compiled before
            return guide
        where = "response_format.json_schema.schema"
        problems = schema_problems(schema)
        if problems:
            raise P.APIError(400, f"{where}: {problems[0]}" + (f" (and {len(problems) - 1} more)"
                                                              if len(problems) > 1 else ""),
                             param="response_format")
        return self.compiled(guide, "response_format")

    def stats(self) -> dict[str, Any]:
        """What compiling guides has cost so far: guides compiled, cache hits, seconds spent, the last compile."""
        return {"compiled": self.compiles, "cache_hits": self.hits, "compile_s": round(self.compile_s, 6),
                "last_compile_s": self.last_compile_s, "cached": len(self._cache)}


# A JSON string's characters without an escape: anything but '"', '\\' and the control characters U+0000-U+001F, which
# JSON requires escaped (RFC 8259 section 7).
UNESCAPED_CHAR = '[^"\\\\\\x00-\\x1f]'


def json_strings(schema: Any) -> Any:
    """``schema`` as it is sent to XGrammar: each string bounded only by ``minLength``/``maxLength`` becomes the
    same bound on a ``pattern`` of JSON's unescaped characters. XGrammar 0.1.25 (TensorRT-LLM's pin) compiles a
    length-bounded string to ``[^"\\\r\n]{m,n}`` (``json_schema_converter.cc``), which lets a raw control character
    (a tab, U+000E) into the string, and the answer is then no JSON a strict parser takes; its unbounded string rule
    excludes them, and so does this pattern. The rest of the schema is left as sent."""
    if isinstance(schema, list):
        return [json_strings(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        shape = SUBSCHEMAS.get(key)
        out[key] = (json_strings(value) if shape in ("one", "list") else
                    {k: json_strings(v) for k, v in value.items()} if shape == "map" and isinstance(value, dict)
                    else value)
    bounded = ("minLength" in out or "maxLength" in out) and "pattern" not in out and "format" not in out
    if bounded and out.get("type") == "string":
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"^{UNESCAPED_CHAR}{{{lo},{'' if hi is None else int(hi)}}}$"
    return out


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


# The keywords XGrammar 0.1.25 enforces (mlc-ai/xgrammar cpp/json_schema_converter.cc @ v0.1.25: VisitSchema and the
# visitors of each type), the annotations it skips because they constrain nothing (GetSchemaCacheIndex's kSkippedKeys,
# plus $id and OpenAPI's discriminator, which only names the const a branch already carries), the keywords it warns
# about and ignores (WarnUnsupportedKeywords), and the string formats it has a grammar for (ParseStringSchema).
ENFORCED = ("type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
            "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
            "pattern", "minLength", "maxLength", "format",
            "items", "prefixItems", "unevaluatedItems", "minItems", "maxItems",
            "properties", "required", "additionalProperties", "unevaluatedProperties", "patternProperties",
            "propertyNames", "minProperties", "maxProperties")
ANNOTATIONS = ("title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment",
               "$schema", "$id", "discriminator")
IGNORED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "multipleOf", "uniqueItems",
           "contains", "minContains", "maxContains")
FORMATS = ("email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
           "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")
TYPES = ("string", "number", "integer", "boolean", "null", "array", "object")
# keyword -> how its value holds subschemas: one schema, a list of them, or a map of them
SUBSCHEMAS = {"items": "one", "additionalProperties": "one", "unevaluatedProperties": "one", "propertyNames": "one",
              "unevaluatedItems": "one", "prefixItems": "list", "anyOf": "list", "oneOf": "list", "allOf": "list",
              "properties": "map", "patternProperties": "map", "$defs": "map", "definitions": "map"}


def schema_problems(schema: Any) -> list[str]:
    """What in a JSON schema XGrammar cannot compile or would not enforce, each naming the keyword and its JSON path
    (``$`` is the schema's root); empty: none. First the schema as JSON Schema itself (``jsonschema``'s meta-schema
    check: a wrong type of value), then every keyword against XGrammar's (:data:`ENFORCED`, :data:`ANNOTATIONS`): one
    it ignores (:data:`IGNORED`) or does not know is refused, because the answer would not be held to it; a
    ``format`` it has no grammar for, a ``type`` that is none, a ``$ref`` that points nowhere, a ``pattern`` it cannot
    compile, and length or format beside a ``pattern`` (XGrammar then keeps only the pattern)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = getattr(exc, "json_path", "$")
        return [f"{exc.message} at {where} (not a valid JSON schema)"]
    out: list[str] = []
    _walk(schema, "$", schema, out)
    return out


def _walk(node: Any, path: str, root: Any, out: list[str]) -> None:
    if isinstance(node, bool):  # false where something may not appear (additionalProperties: false) is a rule
        if not node and path == "$":
            out.append("the schema at $ is false: nothing could match it")
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        at = _join(path, key)
        if key in IGNORED:
            out.append(f"unsupported keyword '{key}' at {at}: XGrammar does not enforce it, so the answer could "
                       f"break it; remove it")
        elif key not in ENFORCED and key not in ANNOTATIONS:
            out.append(f"unsupported keyword '{key}' at {at}: not a JSON-schema keyword XGrammar enforces (it takes "
                       f"{', '.join(ENFORCED)})")
    kinds = node.get("type")
    for kind in (kinds if isinstance(kinds, list) else [kinds] if kinds is not None else []):
        if kind not in TYPES:
            out.append(f"unsupported type {kind!r} at {_join(path, 'type')} (types: {', '.join(TYPES)})")
    fmt = node.get("format")
    if fmt is not None and fmt not in FORMATS:
        out.append(f"unsupported format {fmt!r} at {_join(path, 'format')}: XGrammar has no grammar for it "
                   f"(formats: {', '.join(FORMATS)})")
    if "pattern" in node:
        for key in ("minLength", "maxLength", "format"):
            if key in node:
                out.append(f"keyword '{key}' at {_join(path, key)} is not enforced beside 'pattern' (XGrammar keeps "
                           f"the pattern only); fold it into the pattern")
        problem = _regex_problem(node["pattern"])
        if problem:
            out.append(f"pattern at {_join(path, 'pattern')} does not compile: {problem}")
    ref = node.get("$ref")
    if isinstance(ref, str) and _resolve(root, ref) is None:
        out.append(f"$ref {ref!r} at {_join(path, '$ref')} points nowhere in the schema (only local references, "
                   f"'#/$defs/...', are taken)")
    for key, shape in SUBSCHEMAS.items():
        value = node.get(key)
        if value is None:
            continue
        if shape == "one":
            _walk(value, _join(path, key), root, out)
        elif shape == "list" and isinstance(value, list):
            for i, sub in enumerate(value):
                _walk(sub, f"{_join(path, key)}[{i}]", root, out)
        elif shape == "map" and isinstance(value, dict):
            for name, sub in value.items():
                _walk(sub, _join(_join(path, key), name), root, out)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if key.replace("_", "").replace("$", "").isalnum() else f"{path}[{json.dumps(key)}]"


def _resolve(root: Any, ref: str) -> Any:
    """A local ``$ref`` (``#`` or ``#/a/b``, JSON-pointer escapes taken) in ``root``; None where it points nowhere."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _regex_problem(pattern: Any) -> str | None:
    """Why XGrammar cannot compile ``pattern`` as a regex (None: it can)."""
    import xgrammar

    from pipeline.runtime.guided import first_line

    try:
        xgrammar.Grammar.from_regex(str(pattern))
    except Exception as exc:  # XGrammar raises RuntimeError with the regex converter's message
        return first_line(exc)
    return None
