"""A checkpoint of one's own (``model.source=DIR`` or ``hf://org/name@rev``) without a shipped ``conf/model`` file.

Composing ``model.source=...`` keeps the rest of the selected model group (the default, ``smollm2-135m``): its
name, shape and answer checks describe other weights. Here they are taken from the checkpoint itself:

- ``model.name``: kept when given (``model.name=NAME``), else the checkpoint's directory or Hub repository name;
- ``model.shape``: from the checkpoint's ``config.json`` (its text config for multimodal ones), and the parameter
  count from its safetensors headers (a local directory); a shape field given as an override
  (``model.shape.num_layers=...``) that disagrees with ``config.json`` is refused, naming the field;
- ``model.checks``: the group's answer checks are dropped (they test the group's model), unless given.

The tokenizer and weights come with the checkpoint (fetch copies them). An ``hf://`` source is read from the local
Hugging Face cache only (no network at compose time); when its ``config.json`` is not there, the shape stays as
given and fetch reads it.
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

SHAPE_KEYS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
              "vocab_size", "tie_word_embeddings", "model_type")


def group_of(job: list[str], conf_dir: Path) -> str:
    """The model group a list of overrides selects (``model=X``), else the default of ``conf/config.yaml``."""
    for o in job:
        if o.startswith("model="):
            return o.split("=", 1)[1]
    for item in OmegaConf.load(conf_dir / "config.yaml").get("defaults", []):
        if isinstance(item, (dict, DictConfig)) and "model" in item:
            return str(item["model"])
    return ""


def shape_from_config(doc: dict[str, Any]) -> dict[str, Any]:
    """``model.shape`` fields from a Hugging Face ``config.json`` (the text config of a multimodal one)."""
    text = doc.get("text_config") if isinstance(doc.get("text_config"), dict) else doc
    heads = int(text.get("num_attention_heads") or 0)
    hidden = int(text.get("hidden_size") or 0)
    out = {"num_layers": int(text.get("num_hidden_layers") or 0), "hidden_size": hidden,
           "intermediate_size": int(text.get("intermediate_size") or 0), "num_heads": heads,
           "num_kv_heads": int(text.get("num_key_value_heads") or heads),
           "head_dim": int(text.get("head_dim") or (hidden // heads if heads else 0)),
           "vocab_size": int(text.get("vocab_size") or 0),
           "tie_word_embeddings": bool(doc.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
           "model_type": str(doc.get("model_type") or ""),
           "max_position_embeddings": int(text.get("max_position_embeddings") or 0)}
    return {k: v for k, v in out.items() if v or k == "tie_word_embeddings"}


def safetensors_params(d: Path) -> int | None:
    """Parameters in a local checkpoint's ``*.safetensors`` files, from their headers alone (8-byte length, JSON
    header: the format's layout); None when a header cannot be read (fetch names the file)."""
    total = 0
    files = sorted(d.glob("*.safetensors"))
    if not files:
        return None
    for f in files:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > 100 << 20:
                    return None
                header = json.loads(fh.read(n))
        except (OSError, struct.error, ValueError):
            return None
        for name, t in header.items():
            if name == "__metadata__" or not isinstance(t, dict):
                continue
            count = 1
            for s in t.get("shape", []):
                count *= int(s)
            total += count
    return total


def default_name(source: str) -> str:
    """A model name from its source: the Hub repository's name or the directory's, lower case, ``[a-z0-9._-]``."""
    from pipeline.sources import parse_source

    kind, loc, _ = parse_source(source)
    raw = loc.split("/")[-1] if kind == "hf" else Path(loc).expanduser().resolve().name
    return re.sub(r"[^a-z0-9._-]+", "-", raw.lower()).strip("-.") or "model"


def _config_json(source: str) -> tuple[dict[str, Any] | None, str]:
    from pipeline.sources import parse_source

    kind, loc, rev = parse_source(source)
    if kind == "local":
        p = Path(loc).expanduser() / "config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(loc, "config.json", revision=rev)
        if not isinstance(cached, str):
            return None, f"hf://{loc}"
        p = Path(cached)
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError):
        return None, str(p)
    return (doc if isinstance(doc, dict) else None), str(p)


def _given(job: list[str], key: str) -> set[str]:
    """The sub-keys of ``key`` that the overrides ``job`` set (``model.shape.num_layers=2`` -> ``num_layers``;
    ``model.name=x`` -> ``""``)."""
    out = set()
    for o in job:
        k = o.split("=", 1)[0].lstrip("+~")
        if k == key:
            out.add("")
        elif k.startswith(key + "."):
            out.add(k[len(key) + 1:])
    return out


def adopt(cfg: DictConfig, group: str, conf_dir: Path, job: list[str] = ()) -> list[str]:
    """Fill ``cfg.model`` from a checkpoint of one's own (see the module docstring), in place. Returns the problems
    (a given shape that disagrees with the checkpoint's ``config.json``); nothing for a shipped model's own source,
    a synthetic or a GGUF one."""
    from pipeline.sources import parse_source

    source = str(cfg.model.source)
    try:
        kind, loc, _ = parse_source(source)
    except Exception:  # noqa: BLE001 - a malformed source is fetch's check to name
        return []
    if kind not in ("local", "hf"):
        return []
    path = conf_dir / "model" / f"{group}.yaml"
    shipped = OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else {}
    if shipped.get("source") == source:
        return []  # the shipped model itself
    readonly = OmegaConf.is_readonly(cfg)
    OmegaConf.set_readonly(cfg, False)
    try:
        if not _given(job, "model.name"):
            cfg.model.name = default_name(source)
        if not _given(job, "model.checks"):
            cfg.model.checks = []  # the group's answer checks test the group's model
        doc, where = _config_json(source)
        if doc is None:
            return []
        derived = shape_from_config(doc)
        shape_keys = _given(job, "model.shape")
        given = {k: v for k, v in OmegaConf.to_container(cfg.model.shape).items()
                 if k in SHAPE_KEYS and (k in shape_keys or "" in shape_keys)}
        wrong = [f"model.shape.{k}={given[k]} but {where} says {derived[k]}" for k in SHAPE_KEYS
                 if k in given and k in derived and given[k] != derived[k]]
        if wrong:
            return [f"{'; '.join(wrong)}: drop model.shape for a checkpoint of your own (it is read from its "
                    f"config.json) or give the right values"]
        for k, v in derived.items():
            cfg.model.shape[k] = v
        params = safetensors_params(Path(loc).expanduser()) if kind == "local" else None
        if params:
            cfg.model.shape.params_b = params / 1e9
        elif "params_b" not in shape_keys:
            cfg.model.shape.params_b = 0.0  # unknown here (not the group's): fetch reads the weights
        return []
    finally:
        OmegaConf.set_readonly(cfg, readonly)
