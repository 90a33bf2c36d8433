"""ArtifactKey: one identity, read from a config, a stage's view, a bundle.json or a build report, and spelled as the
label and the publish prefix that name outputs, reports and published entries."""
from __future__ import annotations

import dataclasses
import json

import pytest
from omegaconf.errors import ConfigAttributeError

from pipeline import bundle, hardware, report

from pipeline.runner import executor as runner
from pipeline.identity import ArtifactKey
from pipeline.runner.contract import Stage

KEY = ArtifactKey(model="tiny-qwen3", quant="int4_awq", kv="fp8", target="h100", runtime="trtllm_llmapi")


def _cfg(tmp_path, *extra):
    return hardware.compose(["model=tiny-qwen3", "quant=int4_awq", "target=h100", "runtime=trtllm_llmapi",
                           f"paths.root={tmp_path}", *extra])


def test_label_and_publish_prefix_spell_the_key():
    assert KEY.label == "tiny-qwen3.int4_awq-kvfp8.h100.trtllm_llmapi"
    assert KEY.checkpoint_label == "tiny-qwen3.int4_awq-kvfp8"
    assert KEY.publish_prefix == "tiny-qwen3/int4_awq-kvfp8/h100/trtllm_llmapi"
    with pytest.raises(dataclasses.FrozenInstanceError):
        KEY.kv = "none"


def test_of_reads_a_config_and_a_view_of_only_the_five_keys(tmp_path):
    cfg = _cfg(tmp_path)
    assert ArtifactKey.of(cfg) == KEY  # enum values (quant.format, runtime.name) become their text
    keys = ("model.name", "quant.format", "quant.kv_cache", "target.name", "runtime.name")
    view = runner.stage_config(cfg, Stage(name="x", run=lambda ctx: None, reads=keys))
    assert ArtifactKey.of(view) == KEY
    # negative control: a view missing one of them refuses
    short = runner.stage_config(cfg, Stage(name="x", run=lambda ctx: None, reads=keys[:-1]))
    with pytest.raises(ConfigAttributeError):
        ArtifactKey.of(short)
    assert ArtifactKey.of(_cfg(tmp_path, "quant.kv_cache=none")) != KEY


def test_of_manifest_and_of_report_give_the_same_key(tmp_path):
    doc = {"model": {"name": "tiny-qwen3", "source": "synthetic"}, "quant": {"format": "int4_awq", "kv_cache": "fp8"},
           "target": {"name": "h100", "sm": 90}, "runtime": {"name": "trtllm_llmapi"}}
    assert ArtifactKey.of_manifest(doc) == KEY
    summary = {"model": "tiny-qwen3", "quant": "int4_awq", "kv_cache": "fp8", "target": "h100",
               "runtime": "trtllm_llmapi"}
    assert ArtifactKey.of_report(summary) == KEY
    assert ArtifactKey.of_report({**summary, "target": "b200"}).label == "tiny-qwen3.int4_awq-kvfp8.b200.trtllm_llmapi"


def test_outputs_reports_and_published_entries_are_named_by_the_key(tmp_path):
    """Every place that names an artifact spells the same key: stage output directories, the quantized checkpoint,
    the build report and the published entry."""
    from pipeline.stages import STAGES

    cfg = _cfg(tmp_path, f"publish.dest={tmp_path / 'pub'}")
    planned = {p.stage.name: p for p in runner.plan(cfg, list(STAGES))}
    for name in ("build", "package", "bench", "publish"):
        assert planned[name].out.name.startswith(f"{KEY.label}-{name}-"), planned[name].out
    assert planned["quantize"].out.name.startswith(f"{KEY.checkpoint_label}-quantize-")
    assert planned["fetch"].out.name.startswith("tiny-qwen3-fetch-")
    _, base = bundle.published_base(cfg)
    assert base == f"{tmp_path / 'pub'}/{KEY.publish_prefix}"
    summary = {"model": KEY.model, "quant": KEY.quant, "kv_cache": KEY.kv, "target": KEY.target,
               "runtime": KEY.runtime, "published": None, "total_s": 0.0, "stages": [], "log": "l", "finished": "f"}
    md = report.write(summary, tmp_path / "reports")
    assert md.name == f"{KEY.label}.md" and json.loads(md.with_suffix(".json").read_text()) == summary


def test_a_recipe_names_the_artifact_apart_from_its_formats_preset_and_every_reader_agrees():
    """quant.recipe adds ``.recipe-<name>`` after ``kv<kv>`` (the publish prefix keeps its four levels, which gc's
    listing globs); the config, bundle.json and the build report all give the same key."""
    from omegaconf import OmegaConf

    key = dataclasses.replace(KEY, recipe="nvfp4_default-kv_fp8_cast")
    assert key.label == "tiny-qwen3.int4_awq-kvfp8.recipe-nvfp4_default-kv_fp8_cast.h100.trtllm_llmapi"
    assert key.checkpoint_label == "tiny-qwen3.int4_awq-kvfp8.recipe-nvfp4_default-kv_fp8_cast"
    assert key.publish_prefix == "tiny-qwen3/int4_awq-kvfp8.recipe-nvfp4_default-kv_fp8_cast/h100/trtllm_llmapi"
    assert key != KEY and key.label != KEY.label
    plain = {"model": {"name": "tiny-qwen3"}, "quant": {"format": "int4_awq", "kv_cache": "fp8"},
             "target": {"name": "h100"}, "runtime": {"name": "trtllm_llmapi"}}
    given = OmegaConf.create(plain)
    given.quant.recipe = "general/ptq/nvfp4_default-kv_fp8_cast.yaml"
    assert ArtifactKey.of(given) == key
    given.quant.recipe = None
    assert ArtifactKey.of(given) == KEY
    doc = {**plain, "quant": {**plain["quant"], "recipe": {"name": "general/ptq/nvfp4_default-kv_fp8_cast"}}}
    assert ArtifactKey.of_manifest(doc) == key
    assert ArtifactKey.of_manifest({**plain, "quant": {**plain["quant"], "recipe": None}}) == KEY
    summary = {"model": "tiny-qwen3", "quant": "int4_awq", "kv_cache": "fp8", "target": "h100",
               "runtime": "trtllm_llmapi",
               "stages": [{"stage": "fetch", "result": {}},
                          {"stage": "quantize", "result": {"recipe": {"name": "general/ptq/nvfp4_default-kv_fp8_cast"}}}]}
    assert ArtifactKey.of_report(summary) == key
    assert ArtifactKey.of_report({**summary, "stages": summary["stages"][:1]}) == KEY


def test_the_recipe_in_a_label_is_filesystem_and_url_safe():
    from pipeline.identity import recipe_tag

    assert recipe_tag("general/ptq/fp8_default-kv_fp8_cast.yml") == "fp8_default-kv_fp8_cast"
    assert recipe_tag("/general/ptq/fp8_default-kv_fp8_cast/") == "fp8_default-kv_fp8_cast"
    assert recipe_tag("general/qad/x.y z") == "general_qad_x_y_z"  # refused by plan; still never a path or a dot
    assert recipe_tag(None) is None and recipe_tag("") is None and recipe_tag("  ") is None
