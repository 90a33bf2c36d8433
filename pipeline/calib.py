"""Calibration and held-out text, split deterministically: every fifth document is held out for the accuracy
comparison and never used for calibration.

Sources: the shipped corpus (``builtin``, a few thousand words: for tiny and offline models), a local ``.txt`` /
``.jsonl`` file, a dataset name that ModelOpt's ``modelopt.torch.utils.dataset_utils.get_dataset_samples`` knows
(``cnn_dailymail``, ...) or one of its combos (``cnn_nemotron_v2_mix``), or a Hub dataset ``org/name`` with a
``text`` column.

How much, and of what (``spec``): an explicit ``quant.calib`` setting, else the model's own default
(``model.calib``: the tiny and embedded CPU models keep a small set), else for real checkpoints (``hf://`` and local)
ModelOpt's own PTQ recipe (``RECIPE``), for synthetic and GGUF models ``SMALL``. A local checkpoint whose recipe
dataset cannot be had (no ``datasets`` package, or offline) calibrates on the shipped corpus instead. Every
calibration below the recipe's rows × tokens is recorded as short, with the reasons.
"""
from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import formats
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
# ModelOpt's PTQ recipe, read from examples/hf_ptq/hf_ptq.py at NVIDIA/Model-Optimizer a2fbac7 (0.47.0dev, the
# commit benchmarks/gpu_quant_vs_hfptq.py runs; the project pins nvidia-modelopt 0.47): --calib_size 1024,
# --calib_seq 512, and without --dataset the "cnn_nemotron_v2_mix" combo, which dataset_utils.DATASET_COMBOS expands
# to cnn_dailymail + nemotron-post-training-dataset-v2 with the rows split evenly. hf_ptq uses it for every format
# (AWQ included). hf_ptq truncates one document per row (left padding); this pipeline packs documents end to end
# into full rows, so the recipe's rows × tokens is a floor here, never padding.
RECIPE = {"dataset": "cnn_nemotron_v2_mix", "num_samples": 1024, "seq_len": 512}
RECIPE_SOURCE = "ModelOpt examples/hf_ptq/hf_ptq.py @ NVIDIA/Model-Optimizer a2fbac7"
DATASET_COMBOS = {"cnn_nemotron_v2_mix": ("cnn_dailymail", "nemotron-post-training-dataset-v2")}
# Synthetic and GGUF models without a model.calib of their own: the shipped corpus's small set
SMALL = {"dataset": "builtin", "num_samples": 24, "seq_len": 128}
DEFAULT_REAL_MODEL_DATASET = RECIPE["dataset"]
HUB_EXTRA = "pip install 'llm-pipeline[hub]' (the `datasets` package)"


def is_real(model_source: str) -> bool:
    """An ``hf://`` or local checkpoint (not synthetic, not a packaged GGUF)."""
    return not (model_source == "synthetic" or model_source.startswith("gguf://"))


def resolve(dataset: str, model_source: str) -> str:
    """``auto`` -> ModelOpt's recipe dataset for real models (``hf://`` sources and local checkpoints), the
    shipped corpus for synthetic and packaged GGUF models; anything else as given."""
    if dataset != "auto":
        return dataset
    return DEFAULT_REAL_MODEL_DATASET if is_real(model_source) else "builtin"


def hub_unavailable() -> str | None:
    """Why Hub datasets cannot be loaded here (no ``datasets`` package, or HF offline mode), or None."""
    import importlib.util
    import os

    if importlib.util.find_spec("datasets") is None:
        return f"the `datasets` package is not installed ({HUB_EXTRA})"
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]} (offline)"
    return None


@dataclass(frozen=True)
class Spec:
    """What the quantize stage calibrates on: ``dataset`` (resolved), rows × ``seq_len``, where that comes from
    (``basis``), the reasons known before loading that it is short of the recipe, and whether a local checkpoint
    may fall back to the shipped corpus when the recipe's dataset cannot be loaded (``fallback``)."""

    dataset: str
    num_samples: int
    seq_len: int
    basis: str
    short_reasons: tuple[str, ...]
    allow_short: bool
    fallback: bool = False

    @property
    def tokens(self) -> int:
        return self.num_samples * self.seq_len

    def to_json(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "num_samples": self.num_samples, "seq_len": self.seq_len,
                "basis": self.basis, "short_reasons": list(self.short_reasons), "allow_short": self.allow_short,
                "fallback": self.fallback}

    def on_builtin(self, why: str) -> "Spec":
        """This calibration on the shipped corpus instead (the recipe's dataset cannot be had: ``why``)."""
        reason = (f"the recipe's dataset {self.dataset} is unavailable ({why}): calibrating on the shipped corpus "
                  f"instead, as many rows as it holds")
        return Spec("builtin", self.num_samples, self.seq_len, self.basis, (*self.short_reasons, reason), True,
                    False)


def spec(cfg) -> Spec:
    """The calibration a composed config asks for (see the module docstring for the order)."""
    c, m = cfg.quant.calib, cfg.model
    mc = m.get("calib") or {}
    real = is_real(str(m.source))
    base = RECIPE if real else SMALL
    basis = RECIPE_SOURCE if real else "the small default for synthetic and GGUF models"
    if mc and any(mc.get(k) is not None for k in ("dataset", "num_samples", "seq_len")):
        basis = f"model config {m.name} (model.calib)"
    size = {k: (c.get(k) if c.get(k) is not None else mc.get(k) if mc.get(k) is not None else base[k])
            for k in ("num_samples", "seq_len")}
    if any(c.get(k) is not None for k in ("num_samples", "seq_len")):
        basis = "quant.calib"
    auto = str(c.dataset) == "auto"
    dataset = (str(mc["dataset"]) if auto and mc.get("dataset") else resolve(str(c.dataset), str(m.source)))
    reasons = []
    n, seq = int(size["num_samples"]), int(size["seq_len"])
    if n * seq < RECIPE["num_samples"] * RECIPE["seq_len"] or n < RECIPE["num_samples"] or seq < RECIPE["seq_len"]:
        reasons.append(f"{n}×{seq} tokens ({basis}), below ModelOpt's recipe of {RECIPE['num_samples']}×"
                       f"{RECIPE['seq_len']}")
    out = Spec(dataset, n, seq, basis, tuple(reasons), bool(c.allow_short),
               fallback=auto and real and is_hub(dataset) and not str(m.source).startswith("hf://"))
    if out.fallback:
        why = hub_unavailable()
        if why:
            out = out.on_builtin(why)
    return out


# Dense bf16 tensor rates (TFLOP/s, datasheets: NVIDIA A100, L40S, H100/H200 SXM, B200, GB200 per GPU) for the plan's
# calibration estimate; a target not listed gets none.
BF16_TFLOPS = {"a100": 312, "l40s": 362, "h100": 989, "h200": 989, "b200": 2250, "gb200": 2500}
# The quantize stage's calibration ran at 0.33 of the datasheet rate: the Qwen3-14B shape, NVFP4, 512 × 512 on one
# H200 (21.2 s for 2 × 13.24e9 × 262,144 FLOP; docs/benchmarks.md). A format's own search multiplies it (its
# module's calib_factor: AWQ's, pipeline/formats/_base.py).
CALIB_EFFICIENCY = 0.33


def estimate_s(params_b: float, tokens: int, target: str, fmt: str, gpus: int = 1) -> float | None:
    """Seconds the calibration forward passes take on ``target`` (2 × params FLOP per token), or None when the
    target's rate or the model's size is unknown. The model is split over ``gpus`` (pipeline order: no faster)."""
    rate = BF16_TFLOPS.get(target)
    if not rate or params_b <= 0:
        return None
    s = 2 * params_b * 1e9 * tokens / (rate * 1e12 * CALIB_EFFICIENCY)
    return s * formats.FORMATS[fmt].calib_factor


def plan_summary(cfg) -> dict[str, Any] | None:
    """The plan's calibration line: dataset, rows × tokens, where the size comes from, the estimated time on the
    target, and why it is short of the recipe (if it is). None when nothing is quantized."""
    if cfg.quant.format.value == "none" and cfg.quant.kv_cache.value == "none":
        return None
    s = spec(cfg)
    fmt = formats.FORMATS[cfg.quant.format.value]
    est = estimate_s(float(cfg.model.shape.params_b or 0), s.tokens, str(cfg.target.name), fmt.name)
    notes = list(s.short_reasons)
    if s.fallback:
        notes.append(f"if {s.dataset} cannot be loaded when the stage runs, it calibrates on the shipped corpus "
                     f"(recorded as short)")
    elif is_hub(s.dataset) and hub_unavailable():
        notes.append(f"{s.dataset} comes from the Hub, and here {hub_unavailable()}")
    return {**s.to_json(), "tokens": s.tokens, "recipe": {**RECIPE, "source": RECIPE_SOURCE},
            "short": bool(s.short_reasons), "estimated_s": None if est is None else round(est, 1),
            "estimate_basis": (f"2 × {cfg.model.shape.params_b} B params × tokens at {CALIB_EFFICIENCY:g} × the "
                               f"{cfg.target.name} datasheet bf16 rate" + (
                                   f", × {fmt.calib_factor:g} for {fmt.calib_factor_reason}"
                                   if fmt.calib_factor != 1 else "")
                               if est is not None else "no rate known for this target"),
            "notes": notes}


def is_modelopt(dataset: str) -> bool:
    return (dataset in MODELOPT_DATASETS or dataset in DATASET_COMBOS) and not Path(dataset).exists()


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

        members = DATASET_COMBOS.get(dataset, (dataset,))
        try:  # a combo: its members' documents interleaved, the rows split evenly as ModelOpt splits them
            per = [[str(t) for t in get_dataset_samples(name, -(-limit // len(members))) if str(t).strip()]
                   for name in members]
            docs = [d for group in itertools.zip_longest(*per) for d in group if d is not None]
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
    spec: Spec | None = None  # what was asked for (the stage's calibration), with the reasons it is short

    def short_reasons(self) -> list[str]:
        out = list(self.spec.short_reasons) if self.spec else []
        if len(self.calib) < self.requested:
            out.append(f"{self.texts.name} packs into {len(self.calib)} of the {self.requested} rows asked for")
        return out

    def record(self, calibrate_s: float) -> dict[str, Any]:
        """The ``calibration`` entry of accuracy.json. ``short``: fewer rows than asked for, or fewer rows × tokens
        than ModelOpt's recipe (``short_reasons`` says why)."""
        n = int(self.calib.numel())
        reasons = self.short_reasons()
        out = {"dataset": self.texts.name, "sha256": self.texts.sha256, "rows": len(self.calib),
               "requested_rows": self.requested, "short": bool(reasons) or len(self.calib) < self.requested,
               "seq_len": self.calib.shape[1], "tokens": n, "tokens_per_s": round(n / max(calibrate_s, 1e-9), 1)}
        if self.spec is not None:
            out.update(basis=self.spec.basis, short_reasons=reasons, recipe={**RECIPE, "source": RECIPE_SOURCE})
        return out


def rows(tokenizer, dataset: str, *, seq_len: int, num_samples: int, chat_template: bool, allow_short: bool,
         eval_seq_len: int, eval_num_samples: int, spec: Spec | None = None) -> Rows:
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
    return Rows(texts, cal, ev, num_samples, notes, spec)


def rows_for(tokenizer, s: Spec, *, chat_template: bool, eval_seq_len: int, eval_num_samples: int) -> Rows:
    """``rows`` for a stage's ``Spec``. A local checkpoint whose recipe dataset cannot be loaded now (offline, gated,
    no ``datasets``) calibrates on the shipped corpus instead, recorded as short with the reason."""
    kw = dict(chat_template=chat_template, eval_seq_len=eval_seq_len, eval_num_samples=eval_num_samples)
    try:
        return rows(tokenizer, s.dataset, seq_len=s.seq_len, num_samples=s.num_samples, allow_short=s.allow_short,
                    spec=s, **kw)
    except UserError as exc:
        if not (s.fallback and is_hub(s.dataset)):
            raise
        s = s.on_builtin(str(exc).split(": ", 1)[-1])
        out = rows(tokenizer, s.dataset, seq_len=s.seq_len, num_samples=s.num_samples, allow_short=True, spec=s, **kw)
        return Rows(out.texts, out.calib, out.heldout, out.requested, (s.short_reasons[-1], *out.notes), s)


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
