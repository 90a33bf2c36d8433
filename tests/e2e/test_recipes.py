"""A ModelOpt recipe by name end to end on CPU (``quant.recipe``, pipeline/quant/recipes.py): ``plan`` shows what the
export of ``general/ptq/fp8_default-kv_fp8_cast`` carries, then ``python -m pipeline build until=quantize`` on the
tiny synthetic model calibrates with the recipe and exports exactly that, under the recipe's own label; the stage's
result (what bundle.json's ``quant.recipe`` is made from), its manifest and accuracy.json record which recipe ran.
The per-recipe derivations and refusals are in tests/e2e/test_recipes_modelopt.py; bundle.json's record in
tests/unit/test_bundle.py."""
from __future__ import annotations

import json

import pytest

from pipeline import hardware
from tests.conftest import TINY, run_cli

pytestmark = pytest.mark.e2e

RECIPE = "general/ptq/fp8_default-kv_fp8_cast"
ARGS = [*TINY, "target=cpu", "runtime=reference", f"quant.recipe={RECIPE}.yaml", "quant.kv_cache=fp8_cast",
        "quant.calib.num_samples=8", "quant.calib.seq_len=64"]
LABEL = "tiny-qwen3.fp8-kvfp8_cast.recipe-fp8_default-kv_fp8_cast"  # the recipe's own, not the fp8 preset's


def test_plan_shows_the_recipes_export_and_quantize_runs_it(tmp_path, capsys):
    from pipeline.cli.build import cmd_plan

    doc = cmd_plan(hardware.compose([*ARGS, f"paths.root={tmp_path}"]), as_json=True)
    capsys.readouterr()
    assert [s["output"] for s in doc["stages"] if s["stage"] == "quantize"][0].rsplit("/", 1)[1].startswith(
        f"{LABEL}-quantize-")
    rec = doc["recipe"]
    assert (rec["recipe"], rec["quant_algo"], rec["kv_cache_quant_algo"], rec["kv_constant_amax"]) == \
        (RECIPE, "FP8", "FP8", True)
    assert (rec["format"], rec["kv_format"], rec["problems"], rec["partial"]) == ("fp8", "fp8_cast", [], [])

    proc = run_cli("build", *ARGS, "until=quantize", root=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"recipe: ModelOpt {RECIPE} (max calibration)" in proc.stderr
    out = next((tmp_path / ".store").glob(f"{LABEL}-quantize-*"))
    ckpt = out / "checkpoint"
    q = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert (q["quant_algo"], q["kv_cache_quant_algo"]) == ("FP8", "FP8")
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"]) == ("modelopt", "FP8")  # ModelOpt's config.json form of it
    assert (qc["kv_cache_scheme"]["type"], qc["kv_cache_scheme"]["num_bits"]) == ("float", 8)
    keys = "".join(p.read_text(errors="ignore")[:20000] for p in ckpt.glob("*.safetensors"))  # the JSON header
    assert "weight_scale" in keys and "k_scale" not in keys  # FP8 weights; the cast KV exports no KV scales
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["quant"]["recipe"] == f"{RECIPE}.yaml"  # the bundle's manifests/quantize.json
    result = manifest["result"]
    assert result["quant_algo"] == "FP8" and result["kv_cache"] == "fp8_cast" and manifest["label"] == LABEL
    # the record publish copies into bundle.json's quant.recipe: the derivation agrees with the real export
    rec = result["recipe"]
    assert (rec["name"], rec["algorithm"], rec["probe"], rec["format"], rec["kv_cache"]) == \
        (RECIPE, "max", "qwen3", "fp8", "fp8_cast")
    assert (rec["quant_algo"], rec["kv_cache_quant_algo"], rec["kv_constant_amax"], rec["partial"]) == \
        (q["quant_algo"], q["kv_cache_quant_algo"], True, [])
    assert sorted(rec["exclude_modules"]) == sorted(q["exclude_modules"])
    acc = json.loads((out / "accuracy.json").read_text())
    assert acc["recipe"]["name"] == RECIPE and acc["recipe"]["algorithm"] == "max"
