"""Calibration and held-out text, split deterministically: every fifth document is held out for the accuracy
comparison and never used for calibration.

Sources: the shipped corpus (``builtin``, a few thousand words: for tiny and offline models), a local ``.txt`` /
``.jsonl`` file, a dataset name that ModelOpt's ``modelopt.torch.utils.dataset_utils.get_dataset_samples`` knows
(``cnn_dailymail``, ...), or a Hub dataset ``org/name`` with a ``text`` column. ``auto`` picks ModelOpt's usual
dataset for real models (``hf://`` and local checkpoints; ModelOpt 0.47's ``get_dataset_dataloader`` defaults to
``cnn_dailymail``, and ``examples/llm_ptq/hf_ptq.py`` mixes it with ``nemotron-post-training-dataset-v2``) and the
shipped corpus for synthetic and packaged GGUF models.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import UserError

BUILTIN = Path(__file__).resolve().parent / "data" / "corpus.txt"
HELDOUT_EVERY = 5


@dataclass(frozen=True)
class TextSet:
    name: str
    sha256: str  # content hash of the source file: enters the quantize fingerprint and the manifest
    calib: tuple[str, ...]
    heldout: tuple[str, ...]


# Datasets ModelOpt 0.47 names in SUPPORTED_DATASET_CONFIG (modelopt/torch/utils/dataset_utils.py): the text ones
MODELOPT_DATASETS = ("cnn_dailymail", "nemotron-post-training-dataset-v2", "nemotron-post-training-dataset-v1",
                     "llama-nemotron-post-training-dataset", "pile", "pg19", "wikipedia", "c4", "wikitext",
                     "open_code_reasoning", "open_math_reasoning")
DEFAULT_REAL_MODEL_DATASET = "cnn_dailymail"
HUB_EXTRA = "pip install 'llm-pipeline[hub]' (the `datasets` package)"


def resolve(dataset: str, model_source: str) -> str:
    """``auto`` -> ModelOpt's usual Hub dataset for real models (``hf://`` sources and local checkpoints), the
    shipped corpus for synthetic and packaged GGUF models; anything else as given."""
    if dataset != "auto":
        return dataset
    if model_source.startswith("hf://") or not (model_source == "synthetic" or model_source.startswith("gguf://")):
        return DEFAULT_REAL_MODEL_DATASET
    return "builtin"


def is_modelopt(dataset: str) -> bool:
    return dataset in MODELOPT_DATASETS and not Path(dataset).exists()


def is_hub(dataset: str) -> bool:
    """A dataset ModelOpt knows by name, or ``org/name`` with no file suffix and no such local path: from the Hub."""
    if is_modelopt(dataset):
        return True
    p = Path(dataset).expanduser()
    return dataset.count("/") == 1 and not p.suffix and not p.exists()


def dataset_path(dataset: str) -> Path:
    if dataset == "builtin":
        return BUILTIN
    if is_hub(dataset):
        return Path(dataset)
    p = Path(dataset).expanduser()
    if p.suffix not in (".txt", ".jsonl"):
        raise UserError(f"quant.calib.dataset={dataset!r}: give 'builtin', a local .txt/.jsonl file, 'auto', a "
                        f"dataset ModelOpt knows ({', '.join(MODELOPT_DATASETS[:2])}, ...) or a Hub dataset org/name")
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


def require_hub_support(dataset: str) -> None:
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise UserError(f"quant.calib.dataset={dataset}: a Hub dataset needs {HUB_EXTRA}; or give a local "
                        f".txt/.jsonl file (quant.calib.dataset=/path/file.jsonl)") from None


def _load_hub(dataset: str, limit: int = 4000) -> TextSet:
    require_hub_support(dataset)
    if is_modelopt(dataset):
        from modelopt.torch.utils.dataset_utils import get_dataset_samples

        try:
            docs = [str(t) for t in get_dataset_samples(dataset, limit) if str(t).strip()]
        except Exception as exc:
            raise UserError(f"quant.calib.dataset={dataset}: cannot load it ({type(exc).__name__}); offline or "
                            f"gated? use a local .txt/.jsonl file") from exc
    else:
        import datasets

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


def load(dataset: str, hub_docs: int = 4000) -> TextSet:
    if is_hub(dataset):
        return _load_hub(dataset, hub_docs)
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


@dataclass(frozen=True)
class Rows:
    """Packed calibration and held-out rows (int64 tensors [n, seq_len]) of one text, with notes on any shortfall."""

    texts: TextSet
    calib: Any
    heldout: Any
    requested: int  # calibration rows asked for
    notes: tuple[str, ...]

    def record(self, calibrate_s: float) -> dict[str, Any]:
        """The ``calibration`` entry of accuracy.json."""
        n = int(self.calib.numel())
        return {"dataset": self.texts.name, "sha256": self.texts.sha256, "rows": len(self.calib),
                "requested_rows": self.requested, "short": len(self.calib) < self.requested,
                "seq_len": self.calib.shape[1], "tokens": n, "tokens_per_s": round(n / max(calibrate_s, 1e-9), 1)}


def rows(tokenizer, dataset: str, *, seq_len: int, num_samples: int, chat_template: bool, allow_short: bool,
         eval_seq_len: int, eval_num_samples: int) -> Rows:
    """Load ``dataset`` and pack its calibration and held-out documents. Fewer calibration rows than requested
    fail (UserError) unless ``allow_short``; a shortfall of either is noted."""
    texts = load(dataset, hub_docs=min(8192, 4 * (num_samples + eval_num_samples)))
    cal = pack(tokenizer, texts.calib, seq_len, num_samples, chat_template=chat_template)
    ev = pack(tokenizer, texts.heldout, eval_seq_len, eval_num_samples)
    if len(cal) < num_samples and not allow_short:
        raise UserError(f"quant.calib: {texts.name} packs into {len(cal)} of the {num_samples} requested rows of "
                        f"{seq_len} tokens; give a larger quant.calib.dataset, lower quant.calib.num_samples, or set "
                        f"quant.calib.allow_short=true")
    notes = tuple(f"{what} text {texts.name} holds {len(got)} of the {want} requested rows of {n} tokens"
                  + (" (accepted: quant.calib.allow_short=true)" if what == "calibration" else
                     "; give a larger quant.calib.dataset for the full amount")
                  for what, got, want, n in (("calibration", cal, num_samples, seq_len),
                                             ("held-out", ev, eval_num_samples, eval_seq_len))
                  if len(got) < want)
    return Rows(texts, cal, ev, num_samples, notes)


# Tokens a chat template adds around one document, at most (role markers, system prompt): a generous bound
CHAT_TEMPLATE_TOKENS = 256


def max_tokens(dataset: str, chat_template: bool = False) -> int | None:
    """An upper bound on the calibration tokens a local text can pack into, for any tokenizer that spends at least
    one byte per token (byte-level BPE, SentencePiece with byte fallback): its calibration documents' UTF-8 bytes,
    plus one separator (and a chat template's tokens) per document. None for Hub datasets (unknown until loaded)."""
    if is_hub(dataset):
        return None
    texts = load(dataset)
    extra = 1 + (CHAT_TEMPLATE_TOKENS if chat_template else 0)
    return sum(len(d.encode()) + extra for d in texts.calib)


def short_problem(dataset: str, num_samples: int, seq_len: int, chat_template: bool, allow_short: bool) -> str | None:
    """Plan-time refusal: a local text that cannot possibly fill num_samples rows of seq_len tokens."""
    if allow_short:
        return None
    bound = max_tokens(dataset, chat_template)
    if bound is None or bound >= num_samples * seq_len:
        return None
    fits = max(1, bound // seq_len)
    name = "the shipped corpus (builtin)" if dataset == "builtin" else dataset
    return (f"quant.calib: {name} holds at most ~{bound} tokens, fewer than the {num_samples}×{seq_len} requested; "
            f"give a larger quant.calib.dataset (a .jsonl file, or a Hub dataset such as "
            f"{DEFAULT_REAL_MODEL_DATASET}), lower quant.calib.num_samples (at most {fits} rows fit), or set "
            f"quant.calib.allow_short=true")
