"""Read upstream ``config.pbtxt`` templates into the record's form.

Upstream ships its configs as templates with ``${name}`` placeholders (filled by its ``fill_template.py``), so a
template is not valid protobuf text as it stands. :func:`parse_template` substitutes each unquoted placeholder with a
value of the right kind, parses the result against Triton's ``ModelConfig`` schema (tritonclient's
``model_config_pb2``), and puts the placeholder's name back where the record keeps it (a data type, a batch size,
an instance count, the decoupled flag). Quoted placeholders (parameter values, the backend name) are strings and
parse as they are.
"""
from __future__ import annotations

import re
from typing import Any

from pipeline.errors import UserError

_PLACEHOLDER = re.compile(r"\$\{(\w+)\}")
# an unquoted placeholder in the position of `key: ${x}` or inside `[ ${x} ]`
_UNQUOTED = re.compile(r"(?P<key>\w+)\s*:\s*(?P<open>\[\s*)?\$\{(?P<name>\w+)\}")
_NAMED_DTYPE = re.compile(r'name\s*:\s*"(?P<tensor>[^"]+)"(?P<body>[^{}]*?)data_type\s*:\s*\$\{(?P<ph>\w+)\}')


def _placeholder_sites(text: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """Return the parseable text, ``{tensor: placeholder}`` for templated data types and ``{field: placeholder}``
    for other templated scalar fields (``max_batch_size``, ``decoupled``, ``count``, ...)."""
    dtypes = {m.group("tensor"): m.group("ph") for m in _NAMED_DTYPE.finditer(text)}
    fields: dict[str, str] = {}

    def sub(m: re.Match) -> str:
        key, name = m.group("key"), m.group("name")
        if key == "data_type":
            return f"{key}: TYPE_INVALID"
        fields.setdefault(key, name)
        return f"{key}: {m.group('open') or ''}1"

    return _UNQUOTED.sub(sub, text), dtypes, fields


def _dims(seq) -> list[int]:
    return [int(d) for d in seq]


def _tensor(t, dtype_name: str, placeholder: str | None, *, is_input: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"name": t.name, "data_type": f"${{{placeholder}}}" if placeholder else dtype_name,
                           "dims": _dims(t.dims)}
    if is_input:
        out["optional"] = bool(t.optional)
        if t.allow_ragged_batch:
            out["allow_ragged_batch"] = True
    if t.HasField("reshape"):
        out["reshape"] = _dims(t.reshape.shape)
    return out


def parse_template(text: str, *, name: str = "config.pbtxt") -> dict[str, Any]:
    """The record of one upstream ``config.pbtxt`` template (or a rendered config): name, platform/backend,
    max_batch_size, decoupled, inputs, outputs, parameter keys (with their template values), instance group,
    dynamic batching and ensemble steps. Raises UserError when the text is not a Triton model config."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    parseable, dtype_ph, field_ph = _placeholder_sites(text)
    cfg = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(parseable, cfg)
    except text_format.ParseError as exc:
        raise UserError(f"{name}: not a Triton model config: {exc}") from exc
    dt = model_config_pb2.DataType.Name
    rec: dict[str, Any] = {"name": cfg.name}
    if cfg.platform:
        rec["platform"] = cfg.platform
    if cfg.backend:
        rec["backend"] = cfg.backend
    rec["max_batch_size"] = (f"${{{field_ph['max_batch_size']}}}" if "max_batch_size" in field_ph
                             else int(cfg.max_batch_size))
    if cfg.HasField("model_transaction_policy"):
        rec["decoupled"] = (f"${{{field_ph['decoupled']}}}" if "decoupled" in field_ph
                            else bool(cfg.model_transaction_policy.decoupled))
    rec["inputs"] = [_tensor(t, dt(t.data_type), dtype_ph.get(t.name), is_input=True) for t in cfg.input]
    rec["outputs"] = [_tensor(t, dt(t.data_type), dtype_ph.get(t.name), is_input=False) for t in cfg.output]
    rec["parameters"] = {k: v.string_value for k, v in sorted(cfg.parameters.items())}
    if cfg.instance_group:
        g = cfg.instance_group[0]
        rec["instance_group"] = {
            "count": f"${{{field_ph['count']}}}" if "count" in field_ph else int(g.count),
            "kind": model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind)}
    if cfg.HasField("dynamic_batching"):
        db = cfg.dynamic_batching
        rec["dynamic_batching"] = {
            "max_queue_delay_microseconds": (f"${{{field_ph['max_queue_delay_microseconds']}}}"
                                             if "max_queue_delay_microseconds" in field_ph
                                             else int(db.max_queue_delay_microseconds))}
    if cfg.HasField("ensemble_scheduling"):
        rec["steps"] = [{"model_name": s.model_name, "input_map": dict(sorted(s.input_map.items())),
                         "output_map": dict(sorted(s.output_map.items()))}
                        for s in cfg.ensemble_scheduling.step]
    return rec


def placeholders(text: str) -> list[str]:
    """Every ``${name}`` in a template, in order of first appearance."""
    seen: list[str] = []
    for m in _PLACEHOLDER.finditer(text):
        if m.group(1) not in seen:
            seen.append(m.group(1))
    return seen
