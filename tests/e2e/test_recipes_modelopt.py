"""ModelOpt's PTQ recipes by name (``quant.recipe``, pipeline/quant/recipes.py), held to ModelOpt itself.

For every recipe ModelOpt 0.47 ships under ``modelopt_recipes/general/ptq/``: what plan derives (the recipe's
quantizers inserted on a stand-in, read back by ModelOpt's ``get_quant_config``, no calibration) must be what
ModelOpt's real flow writes -- ``mtq.quantize`` with calibration, then ``export_hf_checkpoint`` -- into
``hf_quant_config.json`` and the safetensors of a tiny model on this CPU; and the format the plan maps it to must
declare that export's ``quant_algo`` / ``kv_cache_quant_algo`` (and, for the KV cache, whether it exports scales).
Recipes whose calibration has no CPU kernel must fail here exactly as ``recipes.CUDA_ONLY`` says. Planted: a wrong
registry mapping and a wrong derivation are caught by the same comparisons. Then the plan-time refusals."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from pipeline import hardware
from pipeline.formats import FORMATS, KV_FORMATS
from pipeline.quant import recipes

pytest.importorskip("modelopt")

SHIPPED = recipes.shipped()
DOCS = Path(__file__).resolve().parents[2] / "docs" / "formats.md"


def _export(name: str, model_type: str) -> dict | Exception:
    """ModelOpt's own flow on a tiny ``model_type`` model: the recipe's config through ``mtq.quantize`` (calibrated
    on two random rows) and ``export_hf_checkpoint`` -> hf_quant_config.json's ``quantization`` (+ whether any
    k_scale/v_scale tensor was written), or the exception it raised."""
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from safetensors import safe_open

    model = recipes.probe_model(model_type)
    rows = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as d, recipes._quiet():
        try:
            mtq.quantize(model, recipes.quant_config(recipes.PREFIX + name, scratch=f"{d}/lw"), lambda m: m(rows))
            export_hf_checkpoint(model, export_dir=f"{d}/out")
        except Exception as exc:  # noqa: BLE001 -- compared with CUDA_ONLY by the caller
            return exc
        out = Path(d, "out")
        q = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
        assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_algo"] == q["quant_algo"]
        keys = [k for p in out.glob("*.safetensors") for k in safe_open(str(p), "pt").keys()]
        q["kv_scales_exported"] = any(k.endswith((".k_scale", ".v_scale")) for k in keys)
        return q


def derivation_disagreements(d: recipes.Derived, exported: dict) -> list[str]:
    """Where plan's derivation differs from the real export."""
    out = [f"{k}: derived {getattr(d, k)!r}, exported {exported.get(k)!r}"
           for k in ("quant_algo", "kv_cache_quant_algo", "group_size") if getattr(d, k) != exported.get(k)]
    if set(d.exclude_modules) != set(exported.get("exclude_modules") or ()):
        out.append(f"exclude_modules: derived {sorted(d.exclude_modules)}, exported {exported.get('exclude_modules')}")
    if d.kv_cache_quant_algo and d.kv_constant_amax == exported["kv_scales_exported"]:
        out.append(f"KV amax: derived constant={d.kv_constant_amax}, but the export "
                   f"{'has' if exported['kv_scales_exported'] else 'has no'} k_scale/v_scale")
    return out


def mapping_disagreements(m: recipes.Mapped, exported: dict) -> list[str]:
    """Where the format modules plan maps a recipe to would expect another export than ModelOpt wrote."""
    out = []
    if m.format is not None:
        spec = FORMATS[m.format]
        if spec.quant_algo != exported.get("quant_algo"):
            out.append(f"quant={m.format} declares quant_algo {spec.quant_algo}, the export has "
                       f"{exported.get('quant_algo')}")
        elif spec.group_size is not None and spec.export_group(None) != exported.get("group_size"):
            out.append(f"quant={m.format} declares blocks of {spec.group_size}, the export "
                       f"{exported.get('group_size')}")
    if m.kv_cache is not None:
        kv = KV_FORMATS[m.kv_cache]
        if kv.quant_algo != exported.get("kv_cache_quant_algo"):
            out.append(f"quant.kv_cache={m.kv_cache} declares {kv.quant_algo}, the export has "
                       f"{exported.get('kv_cache_quant_algo')}")
        elif kv.quant_algo and kv.constant_amax == exported["kv_scales_exported"]:
            out.append(f"quant.kv_cache={m.kv_cache} (constant_amax={kv.constant_amax}) but the export "
                       f"{'has' if exported['kv_scales_exported'] else 'has no'} k_scale/v_scale")
    return out


def _derived(name: str) -> recipes.Derived:
    """The derivation on a dense stand-in, or an MoE one for a recipe that quantizes no dense weight."""
    d = recipes.derive(recipes.PREFIX + name, "qwen3")
    return d if d.quant_algo is not None else recipes.derive(recipes.PREFIX + name, "qwen3_moe")


def test_the_docs_table_lists_every_shipped_recipe_as_derived():
    assert len(SHIPPED) == 24, SHIPPED  # ModelOpt 0.47.0's general/ptq/; a new release: update docs/formats.md
    section = DOCS.read_text().split("## ModelOpt recipes (`quant.recipe`)", 1)[1]
    rows = {cells[0].strip("` "): [c.strip() for c in cells[1:]]
            for cells in (line.strip("|").split(" | ") for line in section.splitlines() if line.startswith("| `"))}
    assert sorted(rows) == list(SHIPPED)
    for name in SHIPPED:
        d = _derived(name)
        m = recipes.to_formats(d)
        algo = f"`{d.quant_algo}`" + (f" ({d.group_size})" if d.group_size else "") + (", partial" if m.partial else "")
        kv = (f"`{d.kv_cache_quant_algo}`" + (" (constant amax)" if d.kv_constant_amax else "")
              if d.kv_cache_quant_algo else "—")
        fmt = f"`{m.format}` / `{m.kv_cache}`" if m.format else "—"
        assert rows[name][:4] == [d.algorithm, algo, kv, fmt], name
        assert rows[name][4].startswith("refused") == bool(m.problems), name


# Recipes that differ from one checked in the unit tier only in the calibration schedule (layer by layer,
# offloaded), a vision-tower exclusion, or calibrated FP8 KV where the unit tier has the same scope with the cast KV
# (the calibrated/cast difference itself is checked on fp8_default) run in the slow tier (``make test-slow``), to keep
# this file to a few seconds.
SLOW = {"nvfp4_experts_only-kv_fp8_layerwise", "nvfp4_experts_only-kv_fp8_layerwise_offload",
        "nvfp4_mlp_only-novit-kv_fp8", "nvfp4_experts_only-kv_fp8", "nvfp4_mlp_only-kv_fp8", "nvfp4_omlp_only-kv_fp8",
        "nvfp4_default-kv_fp8"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in SHIPPED])
def test_plan_derives_what_modelopts_export_writes(name):
    d = _derived(name)  # an experts_only recipe on the MoE architecture it is for
    got = _export(name, d.probe)
    if isinstance(got, Exception):  # no CPU kernel: must be the recorded reason, nothing else
        why = recipes.CUDA_ONLY.get(d.algorithm)
        assert why is not None, f"{name} ({d.algorithm}) fails on CPU, and CUDA_ONLY does not say so: {got!r}"
        snippet = "amax must be a CUDA tensor" if d.algorithm == "gptq" else "triton"
        assert snippet in str(got) and snippet in why, (name, got)
        return
    assert d.algorithm not in recipes.CUDA_ONLY, f"{name} calibrated on CPU: CUDA_ONLY[{d.algorithm!r}] is stale"
    assert derivation_disagreements(d, got) == []
    assert mapping_disagreements(recipes.to_formats(d), got) == []


def test_a_planted_wrong_mapping_or_derivation_is_caught(monkeypatch):
    name = "nvfp4_default-kv_fp8_cast"
    d = recipes.derive(recipes.PREFIX + name, "qwen3")
    got = _export(name, "qwen3")
    assert mapping_disagreements(recipes.to_formats(d), got) == []
    # a registry that maps NVFP4 exports to the fp8 format module, and the cast KV preset to the calibrated one
    monkeypatch.setattr(recipes, "BY_ALGO", {**recipes.BY_ALGO, "NVFP4": FORMATS["fp8"]})
    monkeypatch.setattr(recipes, "kv_format", lambda algo, constant: "fp8")
    planted = recipes.to_formats(d)
    assert (planted.format, planted.kv_cache) == ("fp8", "fp8")
    found = mapping_disagreements(planted, got)
    assert any("quant=fp8 declares quant_algo FP8, the export has NVFP4" in p for p in found), found
    assert any("quant.kv_cache=fp8 (constant_amax=False) but the export has no k_scale" in p for p in found), found
    # a derivation that read the block size or the KV amax mode wrong
    wrong = recipes.Derived(**{**d.__dict__, "group_size": 32, "kv_constant_amax": False})
    found = derivation_disagreements(wrong, got)
    assert any(p.startswith("group_size: derived 32, exported 16") for p in found), found
    assert any(p.startswith("KV amax: derived constant=False") for p in found), found


# ------------------------------------------------------------------------------------------------- plan refusals
def _problems(*overrides: str) -> list[str]:
    from pipeline.stages import quantize

    cfg = hardware.compose(["model=tiny-qwen3", *overrides])
    return quantize.recipe_problems(cfg)


def test_a_servable_recipe_with_its_format_passes():
    assert _problems("quant.recipe=general/ptq/fp8_default-kv_fp8_cast.yaml", "quant.kv_cache=fp8_cast",
                     "target=h100", "runtime=trtllm_llmapi") == []
    assert _problems("quant=nvfp4", "quant.kv_cache=fp8_cast", "quant.recipe=general/ptq/nvfp4_default-kv_fp8_cast",
                     "target=b200", "runtime=trtllm_llmapi") == []


def test_an_nvfp4_recipe_is_refused_for_hopper_naming_why_and_what_works():
    found = _problems("quant.recipe=general/ptq/nvfp4_default-kv_fp8_cast", "target=h100", "runtime=trtllm_llmapi")
    assert len(found) == 1, found
    assert found[0].startswith("quant.recipe=general/ptq/nvfp4_default-kv_fp8_cast exports NVFP4 (quant=nvfp4) with "
                               "FP8 KV (quant.kv_cache=fp8_cast): nvfp4 needs Blackwell"), found
    assert "for h100 use fp8" in found[0]


def test_a_recipe_that_disagrees_with_quant_names_the_settings():
    found = _problems("quant.recipe=general/ptq/fp8_default-kv_fp8_cast", "target=cpu")  # quant.kv_cache=fp8
    assert len(found) == 1 and "set quant=fp8 quant.kv_cache=fp8_cast with it" in found[0], found


def test_unknown_and_non_ptq_recipes_are_refused_with_close_names():
    found = _problems("quant.recipe=general/ptq/nvfp4_defalt-kv_fp8")
    assert len(found) == 1 and "ModelOpt ships no PTQ recipe of that name" in found[0], found
    assert "close: general/ptq/nvfp4_default-kv_fp8," in found[0]
    found = _problems("quant.recipe=general/auto_quantize/nvfp4_fp8_at_5p4bits")
    assert found and "is a ModelOpt auto_quantize recipe, not a PTQ recipe" in found[0], found


@pytest.mark.parametrize("recipe, expected", [
    ("nvfp4_experts_only-kv_fp8_cast", "quantizes no weight of a qwen3 model"),  # dense model
    ("mxfp4_mlp_weight_only", "exports quant_algo 'mxfp4', which no format module declares"),
    ("nvfp4_mlp_weight_only", "exports W4A16_NVFP4 in blocks of 32; the w4a16_nvfp4 format"),
    ("nvfp4_default-kv_none-gptq", "calibrates with gptq, which runs on a CUDA GPU only"),
])
def test_recipes_no_format_describes_or_this_machine_cannot_run_are_refused(recipe, expected):
    over = ["quant=nvfp4", "quant.kv_cache=none"] if "gptq" in recipe else []
    found = _problems(f"quant.recipe=general/ptq/{recipe}", "target=cpu", *over)
    assert any(expected in p for p in found), found


def test_a_partly_quantized_export_is_refused_on_the_engine_path_only():
    over = ["quant=nvfp4", "quant.recipe=general/ptq/nvfp4_mlp_only-kv_fp8", "target=b200"]
    assert _problems(*over, "runtime=trtllm_llmapi") == []
    found = _problems(*over, "runtime=trtllm_engine")
    assert len(found) == 1 and "leaves model.layers.*.self_attn* unquantized" in found[0], found


# --------------------------------------------------------------------------------- the recipe names the artifact
def test_a_recipe_build_is_named_apart_from_the_preset_build_of_its_format():
    from pipeline.identity import ArtifactKey
    from pipeline.stages import quantize

    over = ["model=tiny-qwen3", "target=cpu", "runtime=reference", "quant.kv_cache=fp8_cast"]
    key = ArtifactKey.of(hardware.compose([*over, "quant.recipe=general/ptq/fp8_default-kv_fp8_cast.yaml"],
                                          say=False))
    preset = ArtifactKey.of(hardware.compose(over, say=False))
    assert preset.label == "tiny-qwen3.fp8-kvfp8_cast.cpu.reference" and preset.recipe is None
    assert key.label == "tiny-qwen3.fp8-kvfp8_cast.recipe-fp8_default-kv_fp8_cast.cpu.reference"
    assert key.publish_prefix == "tiny-qwen3/fp8-kvfp8_cast.recipe-fp8_default-kv_fp8_cast/cpu/reference"
    assert quantize.STAGE.label(hardware.compose([*over, "quant.recipe=general/ptq/fp8_default-kv_fp8_cast"],
                                                 say=False)) == "tiny-qwen3.fp8-kvfp8_cast.recipe-fp8_default-kv_fp8_cast"
    # the bench looks its regression baseline up under the label its own config view gives: the recipe's
    from pipeline.runner.contract import stage_config
    from pipeline.stages.bench.stage import STAGE as BENCH

    cfg = hardware.compose([*over, "quant.recipe=general/ptq/fp8_default-kv_fp8_cast"], say=False)
    assert ArtifactKey.of(stage_config(cfg, BENCH)).label == key.label


def test_the_record_of_the_recipe_is_the_derivation_and_reads_as_the_results_model():
    from pipeline.identity import recipe_tag
    from pipeline.results import RecipeRecord

    d = recipes.derive(recipes.PREFIX + "nvfp4_mlp_only-kv_fp8_cast", "qwen3")
    rec = RecipeRecord.model_validate(recipes.record(d, recipes.to_formats(d)))
    assert (rec.name, rec.algorithm, rec.quant_algo, rec.kv_cache_quant_algo, rec.group_size) == \
        ("general/ptq/nvfp4_mlp_only-kv_fp8_cast", "max", "NVFP4", "FP8", 16)
    assert (rec.format, rec.kv_cache, rec.kv_constant_amax) == ("nvfp4", "fp8_cast", True)
    assert "model.layers.*.self_attn*" in rec.partial and "lm_head" in rec.exclude_modules
    with pytest.raises(ValueError):  # the record's keys are fixed (bundle.json's schema)
        RecipeRecord.model_validate({**rec.model_dump(), "extra": 1})
    # every shipped name spells itself in the label, filesystem- and URL-safe
    assert [recipe_tag(recipes.PREFIX + n + ".yaml") for n in SHIPPED] == list(SHIPPED)
    assert all(set(n) <= set("abcdefghijklmnopqrstuvwxyz0123456789_-") for n in SHIPPED)
