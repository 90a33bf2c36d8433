"""What the front end knows about the repository it serves: its layout, its model's name and metadata, the
tokenizer (for chat templates, token counts and token-level requests) and the context length.

Everything is read from the repository itself, as the server will load it. What differs per layout is read by the
layout folder's ``served.read`` (``pipeline/triton/layouts/<name>/served.py``) into a :class:`Reading`: the tokenizer
directory (preprocessing's ``tokenizer_dir`` for ``inflight_batcher_llm``, ``model.yaml``'s ``tokenizer``/``model``
for ``llmapi``, each resolved like the python models resolve them: a path under the serving container's mount is
looked up in the repository, :func:`resolve`), the context length where the repository says it (the reference
model's ``max_seq_len`` parameter, the engine's ``build_config.max_seq_len``, ``model.yaml``'s ``max_seq_len``) and
how text prompts are tokenized. The rest is common: the checkpoint's ``max_position_embeddings`` when the layout
found no context length, and the name, quantization, target and version from the bundle's ``bundle.json`` when the
repository is a bundle's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from pipeline.triton import layouts
from pipeline.triton.layouts.contract import Reading, to_int  # noqa: F401 - Reading: what a layout's served.read gives


@dataclass
class ServedModel:
    repo: Path
    layout: str  # inflight_batcher_llm | llmapi
    name: str
    tokenizer_dir: Path
    max_seq_len: int | None
    add_special_tokens: bool  # how the layout tokenizes text prompts (preprocessing's parameter; llmapi: true)
    metadata: dict[str, Any] = field(default_factory=dict)
    created: int = 0
    tokenizer: Any = None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    # --- tokens --------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=...)``. A fast tokenizer is asked directly (its Rust
        ``Tokenizer.encode``, the call ``encode`` ends in, without the batch of one and the checks around it) while
        its backend has no truncation or padding set and splits special tokens as the wrapper would; the ids are the
        same."""
        tok = self.tokenizer
        backend = getattr(tok, "_tokenizer", None) if getattr(tok, "is_fast", False) else None
        if backend is not None and backend.truncation is None and backend.padding is None and \
                backend.encode_special_tokens == bool(getattr(tok, "split_special_tokens", False)):
            return backend.encode(text, add_special_tokens=add_special_tokens).ids
        return tok.encode(text, add_special_tokens=add_special_tokens)

    def encode_prompt(self, text: str) -> list[int]:
        """The prompt's token ids as the layout's own tokenizer step makes them."""
        return self.encode(text, self.add_special_tokens)

    def count(self, text: str) -> int:
        """Tokens of generated text, counted as the bench (and genai-perf, aiperf) count them."""
        return len(self.encode(text, False)) if text else 0

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def pad_id(self) -> int | None:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict | None,
                    tools: list[dict] | None = None) -> str:
        """The conversation in the model's own chat template (with ``tools``, the template's tool section, as
        ``apply_chat_template(tools=...)`` renders it). A leading BOS that the layout's tokenizer step adds again is
        dropped from the text, so the model sees it once."""
        extra = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **extra,
                                                  **(kwargs or {}))
        bos = self.tokenizer.bos_token
        if self.add_special_tokens and bos and text.startswith(bos):
            with_specials = self.tokenizer.encode("", add_special_tokens=True)
            if with_specials and with_specials[0] == self.tokenizer.bos_token_id:
                text = text[len(bos):]
        return text


def _bundle(repo: Path) -> dict[str, Any] | None:
    doc = repo.parent / "bundle.json"
    if repo.name == "triton_repo" and doc.is_file():
        try:
            return json.loads(doc.read_text())
        except (OSError, ValueError):
            return None
    return None


def load(repo: Path, name: str | None = None, load_tokenizer: bool = True) -> ServedModel:
    """Read a model repository (a bundle's ``triton_repo/`` included). Raises ``UserError`` naming what is missing."""
    repo = Path(repo).resolve()
    dirs = {d.name: d for d in repo.iterdir() if d.is_dir()}
    layout = layouts.of_repository(dirs)
    reading = layouts.get(layout).read(repo, dirs)
    tok_dir, max_seq, add_special = reading.tokenizer_dir, reading.max_seq_len, reading.add_special_tokens
    if not tok_dir.is_dir():
        raise UserError(f"{repo}: the tokenizer directory {tok_dir} does not exist")
    if max_seq is None:
        try:
            hf = json.loads((tok_dir / "config.json").read_text())
            max_seq = to_int(hf.get("max_position_embeddings"))
        except (OSError, ValueError):
            max_seq = None
    bundle = _bundle(repo)
    meta: dict[str, Any] = {"layout": layout}
    if bundle:
        meta.update({"version": bundle.get("version"), "quant": bundle.get("quant", {}).get("format"),
                     "kv_cache": bundle.get("quant", {}).get("kv_cache"),
                     "target": bundle.get("target", {}).get("name"), "runtime": bundle.get("runtime", {}).get("name")})
        default_name = (bundle.get("model") or {}).get("name")
    else:
        default_name = None
        try:  # a package stage's output directory: its manifest holds the resolved config
            man = json.loads((repo / "manifest.json").read_text())
            conf = man.get("config") or {}
            default_name = (conf.get("model") or {}).get("name")
            meta.update({"quant": (conf.get("quant") or {}).get("format"),
                         "kv_cache": (conf.get("quant") or {}).get("kv_cache"),
                         "target": (conf.get("target") or {}).get("name"),
                         "runtime": (conf.get("runtime") or {}).get("name"), "label": man.get("label")})
        except (OSError, ValueError, AttributeError):
            pass
    if not default_name:
        hf_name = None
        try:
            hf_name = json.loads((tok_dir / "config.json").read_text()).get("_name_or_path")
        except (OSError, ValueError):
            pass
        default_name = Path(hf_name).name if hf_name else repo.name
    created = int((repo.parent / "bundle.json").stat().st_mtime) if bundle else int(repo.stat().st_mtime)
    model = ServedModel(repo, layout, name or default_name, tok_dir, max_seq, add_special, meta, created)
    meta["max_model_len"] = max_seq
    if load_tokenizer:
        from transformers import AutoTokenizer

        try:
            model.tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
        except Exception as exc:  # transformers raises many kinds here
            raise UserError(f"{tok_dir}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from None
    return model
