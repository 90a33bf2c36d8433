"""The quant-format registry covers exactly the formats the config accepts and agrees with the self-contained
reference runtime (copied into model repositories, so it keeps its own list of what it loads) and with the YAML
presets under conf/quant."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from pipeline import compat, schema
from pipeline.quant import formats

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "pipeline" / "runtime" / "reference.py"


def reference_supports() -> tuple[set, set]:
    """SUPPORTED_ALGOS / SUPPORTED_KV as written in the reference runtime's source (read, not imported)."""
    found = {}
    for node in ast.parse(REFERENCE.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id in ("SUPPORTED_ALGOS", "SUPPORTED_KV"):
            found[node.targets[0].id] = ast.literal_eval(node.value)
    return found["SUPPORTED_ALGOS"], found["SUPPORTED_KV"]


def coverage_problems(registry: dict, kv_registry: dict) -> list[str]:
    out = []
    want, want_kv = {f.value for f in schema.QuantFormat}, {k.value for k in schema.KVFormat}
    if set(registry) != want:
        out.append(f"weight formats: registry {sorted(registry)} != schema {sorted(want)}")
    if set(kv_registry) != want_kv:
        out.append(f"KV formats: registry {sorted(kv_registry)} != schema {sorted(want_kv)}")
    algos, kv_algos = reference_supports()
    if {f.quant_algo for f in registry.values()} != algos:
        out.append(f"quant_algo: registry {sorted(map(str, (f.quant_algo for f in registry.values())))} != "
                   f"reference runtime {sorted(map(str, algos))}")
    if {k.quant_algo for k in kv_registry.values()} != kv_algos:
        out.append("kv_cache_quant_algo: registry != reference runtime")
    for name in registry:
        if not (ROOT / "conf" / "quant" / f"{name}.yaml").is_file():
            out.append(f"conf/quant/{name}.yaml is missing")
    return out


def test_registry_covers_schema_and_reference_runtime():
    assert coverage_problems(formats.FORMATS, formats.KV_FORMATS) == []


def test_planted_missing_and_extra_formats_fail():
    missing = {k: v for k, v in formats.FORMATS.items() if k != "int8_sq"}
    assert any("weight formats" in p for p in coverage_problems(missing, formats.KV_FORMATS))
    assert any("quant_algo" in p for p in coverage_problems(missing, formats.KV_FORMATS))
    extra = {**formats.FORMATS, "mxfp4": formats.QuantFormat("mxfp4", "MXFP4_DEFAULT_CFG", "MXFP4", 0.5,
                                                             formats.BLACKWELL, "Blackwell", frozenset())}
    found = coverage_problems(extra, formats.KV_FORMATS)
    assert any("weight formats" in p for p in found) and any("mxfp4.yaml" in p for p in found)
    kv_missing = {k: v for k, v in formats.KV_FORMATS.items() if k != "nvfp4"}
    assert any("KV formats" in p for p in coverage_problems(formats.FORMATS, kv_missing))


@pytest.mark.parametrize("name", sorted(formats.FORMATS))
def test_yaml_preset_names_its_format(name):
    doc = yaml.safe_load((ROOT / "conf" / "quant" / f"{name}.yaml").read_text())
    assert doc["format"] == name
    spec = formats.FORMATS[name]
    assert ("block_size" in doc) == spec.awq  # only AWQ formats take quant.block_size
    assert (spec.quant_algo is None) == (spec.layout is None) == (spec.preset is None)


def test_derived_tables_read_the_registry():
    assert compat.QUANT_SM["nvfp4"].sms == formats.BLACKWELL
    assert compat.RUNTIME_QUANT["trtllm_llmapi"] == set(formats.FORMATS) - {"int8_sq"}
    assert formats.FORMATS["int4_awq"].export_group(None) == formats.AWQ_GROUP
    assert formats.FORMATS["int4_awq"].export_group(64) == 64
    assert formats.FORMATS["nvfp4"].export_group(64) == formats.NVFP4_BLOCK  # the NVFP4 block is fixed
    assert formats.AWQ_FORMATS == ("int4_awq", "w4a8_awq")
