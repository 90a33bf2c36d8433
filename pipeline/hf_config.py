"""A checkpoint's ``config.json`` as the transformers of TensorRT-LLM 1.2 reads it.

transformers 5 keeps RoPE settings in ``rope_parameters`` (``{"rope_type": ..., "rope_theta": ..., ...}``) and writes
neither ``rope_theta`` nor ``rope_scaling`` when it saves a config. TensorRT-LLM 1.2 pins transformers 4.57
(``requirements.txt``: ``transformers==4.57.1``), whose ``Qwen3Config``/``LlamaConfig`` read ``rope_theta`` (default
10000.0) and ``rope_scaling`` (default None) and ignore ``rope_parameters``: a checkpoint saved by transformers 5 would
load there with the wrong RoPE base and no scaling, silently. :func:`with_legacy_rope` adds the two keys, derived from
``rope_parameters``; transformers 5 reads the config the same with them (it takes a non-null ``rope_scaling`` as the
RoPE parameters and puts ``rope_theta`` into them), so the file serves both.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def legacy_rope(doc: dict[str, Any], default_theta: float = 10000.0) -> tuple[float, dict | None]:
    """(``rope_theta``, ``rope_scaling``) of a config.json written by transformers 4 (the keys themselves) or 5
    (``rope_parameters``; ``rope_type: default`` is no scaling)."""
    params = doc.get("rope_parameters") or {}
    theta = doc.get("rope_theta", params.get("rope_theta", default_theta))
    scaling = doc.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


def with_legacy_rope(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with top-level ``rope_theta`` and ``rope_scaling`` where it has ``rope_parameters`` only (a text model's
    own config and a multimodal one's ``text_config``); a config that has the keys, or no RoPE settings, is as it
    was."""
    out = dict(doc)
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = with_legacy_rope(out["text_config"])
    params = out.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" not in params:
        return out
    theta, scaling = legacy_rope(out)
    out.setdefault("rope_theta", theta)
    out.setdefault("rope_scaling", scaling)
    return out


def write_legacy_rope(config_json: Path) -> bool:
    """Add the legacy RoPE keys to the file ``config_json`` (rewritten only when something is added; a hard-linked
    input is replaced, not written through). Returns whether it changed."""
    doc = json.loads(config_json.read_text())
    new = with_legacy_rope(doc)
    if new == doc:
        return False
    tmp = config_json.with_name(config_json.name + ".tmp")
    tmp.write_text(json.dumps(new, indent=2, sort_keys=True) + "\n")
    tmp.replace(config_json)
    return True
