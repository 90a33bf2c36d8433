"""Strict ``config.pbtxt`` rendering and schema checking against Triton's protobuf ``ModelConfig``."""
from __future__ import annotations

import string
from pathlib import Path
from typing import Any

from pipeline.errors import UserError

MODELS_DIR = Path(__file__).resolve().parent / "models"


def render(template: str, values: dict[str, Any], *, name: str = "template") -> str:
    """Fill every ``${placeholder}``; a missing or an unused value is an error (never a leftover ``${...}``)."""
    tmpl = string.Template(template)
    if not tmpl.is_valid():
        raise UserError(f"{name}: malformed placeholder in template")
    wanted = set(tmpl.get_identifiers())
    missing = sorted(wanted - set(values))
    unused = sorted(set(values) - wanted)
    if missing:
        raise UserError(f"{name}: no value for placeholder(s) {', '.join(missing)}")
    if unused:
        raise UserError(f"{name}: value(s) given for unknown placeholder(s) {', '.join(unused)}")
    return tmpl.substitute({k: _pbtxt_value(v) for k, v in values.items()})


def _pbtxt_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def parse_model_config(text: str, *, name: str = "config.pbtxt"):
    """Parse text against Triton's ModelConfig protobuf schema (shipped in tritonclient). Raises UserError."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    cfg = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as exc:
        raise UserError(f"{name}: not a valid Triton model config: {exc}") from exc
    return cfg
