"""Calibration and held-out text: the shipped corpus or a local ``.txt``/``.jsonl`` file, split deterministically.

Every fifth document is held out for the accuracy comparison and never used for calibration.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError

BUILTIN = Path(__file__).resolve().parent / "data" / "corpus.txt"
HELDOUT_EVERY = 5


@dataclass(frozen=True)
class TextSet:
    name: str
    sha256: str  # content hash of the source file: enters the quantize fingerprint and the manifest
    calib: tuple[str, ...]
    heldout: tuple[str, ...]


def is_hub(dataset: str) -> bool:
    """``org/name`` with no file suffix and no such local path: a Hugging Face Hub dataset."""
    p = Path(dataset).expanduser()
    return dataset.count("/") == 1 and not p.suffix and not p.exists()


def dataset_path(dataset: str) -> Path:
    if dataset == "builtin":
        return BUILTIN
    if is_hub(dataset):
        return Path(dataset)
    p = Path(dataset).expanduser()
    if p.suffix not in (".txt", ".jsonl"):
        raise UserError(f"quant.calib.dataset={dataset!r}: give 'builtin', a local .txt/.jsonl file or a Hub "
                        f"dataset org/name")
    if p.is_dir():
        raise UserError(f"quant.calib.dataset: {p} is a directory; give a .txt or .jsonl file")
    if not p.exists():
        raise UserError(f"quant.calib.dataset: file {p} not found")
    try:
        with open(p, "rb"):
            pass
    except OSError as exc:
        raise UserError(f"quant.calib.dataset: cannot read {p}: {exc.strerror}; fix its permissions") from None
    return p.resolve()


def dataset_digest(dataset: str) -> str:
    if is_hub(dataset):  # content unknown until downloaded; the manifest records the content hash
        return f"hub:{dataset}"
    path = dataset_path(dataset)
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise UserError(f"quant.calib.dataset: cannot read {path}: {exc.strerror}") from exc


def _load_hub(dataset: str, limit: int = 4000) -> TextSet:
    try:
        import datasets
    except ImportError as exc:
        raise UserError(f"quant.calib.dataset={dataset}: a Hub dataset needs `pip install datasets` "
                        f"(or give 'builtin' or a local .txt/.jsonl file)") from exc
    try:
        ds = datasets.load_dataset(dataset, split="train")
    except Exception as exc:
        raise UserError(f"quant.calib.dataset={dataset}: cannot load from the Hub ({type(exc).__name__}); "
                        f"offline or gated? use a local .txt/.jsonl file") from exc
    if "text" not in ds.column_names:
        raise UserError(f"quant.calib.dataset={dataset}: no 'text' column (has {', '.join(ds.column_names)})")
    docs = [str(t) for t in ds.select(range(min(limit, len(ds))))["text"] if str(t).strip()]
    raw = "\n\n".join(docs).encode()
    return _split(dataset, hashlib.sha256(raw).hexdigest(), docs, Path(dataset))


def _split(name: str, sha: str, docs: list[str], path: Path) -> TextSet:
    if len(docs) < HELDOUT_EVERY:
        raise UserError(f"quant.calib.dataset: {path} has {len(docs)} documents; need at least {HELDOUT_EVERY}")
    calib = tuple(d for i, d in enumerate(docs) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1)
    held = tuple(d for i, d in enumerate(docs) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1)
    return TextSet(name, sha, calib, held)


def load(dataset: str) -> TextSet:
    if is_hub(dataset):
        return _load_hub(dataset)
    path = dataset_path(dataset)
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except OSError as exc:
        raise UserError(f"quant.calib.dataset: cannot read {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise UserError(f"quant.calib.dataset: {path} is not UTF-8 text") from exc
    if path.suffix == ".jsonl":
        docs = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                docs.append(str(json.loads(line)["text"]))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise UserError(f"quant.calib.dataset: {path}:{i} is not a JSON object with a 'text' field") from exc
    else:
        docs = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    return _split(dataset, hashlib.sha256(raw).hexdigest(), docs, path)


def pack(tokenizer, docs: tuple[str, ...], seq_len: int, num_samples: int, chat_template: bool = False):
    """Tokenize documents end to end (separated by EOS) and cut into ``num_samples`` rows of ``seq_len`` tokens.

    Returns an int64 tensor [n, seq_len] with n <= num_samples (as many full rows as the text holds).
    """
    import torch

    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for d in docs:
        if chat_template and getattr(tokenizer, "chat_template", None):
            d = tokenizer.apply_chat_template([{"role": "user", "content": "Continue the text."},
                                               {"role": "assistant", "content": d}], tokenize=False)
        ids.extend(tokenizer(d, add_special_tokens=False)["input_ids"] + sep)
    n = min(num_samples, len(ids) // seq_len)
    if n == 0:
        raise UserError(f"calibration text has {len(ids)} tokens, fewer than one row of seq_len={seq_len}; "
                        f"lower quant.calib.seq_len or give a larger quant.calib.dataset")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
