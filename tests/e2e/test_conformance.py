"""Every layout the package stage writes, decoupled and not, against upstream's recorded interface
(``pipeline/upstream``, read from NVIDIA's triton_backend config.pbtxt files): the same tensors with the same data
type, dims, optional flag and reshape, upstream's ensemble steps, every parameter the backend reads without a
fallback filled, and the llmapi layout's batch size and transaction policy in model.yaml. Negative controls plant
one difference each and must be caught."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline import config, upstream
from pipeline.stages.package import ENGINE_REL, render_repository
from pipeline.upstream.pbtxt import parse_template

CASES = {  # name: (overrides, layout); the engine/LLM-API repositories are for a GPU target, rendered here only
    "engine": (["model=qwen32b", "quant=fp8", "target=h100", "runtime=trtllm_engine"], "inflight_batcher_llm"),
    "reference": (["model=tiny-qwen3", "quant=fp8", "target=cpu", "runtime=reference"], "inflight_batcher_llm"),
    "llmapi": (["model=qwen32b", "quant=nvfp4", "target=b200", "runtime=trtllm_llmapi"], "llmapi"),
    "reference-llmapi": (["model=tiny-qwen3", "quant=fp8", "target=cpu", "runtime=reference", "serve.layout=llmapi"],
                         "llmapi"),
}


def render(tmp: Path, case: str, decoupled: bool, *extra: str) -> Path:
    overrides, _ = CASES[case]
    repo = tmp / f"{case}-{decoupled}"
    eng = repo / ENGINE_REL
    eng.mkdir(parents=True)
    (eng / "tokenizer.json").write_text("{}")  # a stand-in: nothing loads it here
    if "runtime=trtllm_engine" in overrides:
        (eng / "config.json").write_text(json.dumps({"version": "1.2.1", "build_config": {"max_batch_size": 8},
                                                     "pretrained_config": {"mapping": {"world_size": 1}}}))
    render_repository(config.compose([*overrides, f"serve.decoupled={str(decoupled).lower()}", *extra]), repo)
    return repo


def _dtype_ok(recorded: str, got: str) -> bool:
    return got == recorded or (recorded.startswith("${") and got.startswith("TYPE_") and got != "TYPE_INVALID")


def differences(repo: Path, layout: str, line: str = "1.2.1") -> list[str]:
    """Every way the repository's configs differ from the recorded upstream interface."""
    out = []
    recorded, reads = upstream.interface(line, layout), upstream.reads(line, layout)
    for model, rec in recorded.items():
        path = repo / model / "config.pbtxt"
        if not path.is_file():
            out.append(f"{model}: missing")
            continue
        got = parse_template(path.read_text())
        for kind in ("inputs", "outputs"):
            want = {t["name"]: t for t in rec[kind]}
            have = {t["name"]: t for t in got[kind]}
            out += [f"{model}: {kind[:-1]} {n} missing" for n in want if n not in have]
            out += [f"{model}: {kind[:-1]} {n} not upstream" for n in have if n not in want]
            for n in want.keys() & have.keys():
                w, h = want[n], have[n]
                if not _dtype_ok(w["data_type"], h["data_type"]):
                    out.append(f"{model}: {n} data_type {h['data_type']} != {w['data_type']}")
                for key in ("dims", "reshape", "optional", "allow_ragged_batch"):
                    if w.get(key) != h.get(key):
                        out.append(f"{model}: {n} {key} {h.get(key)} != {w.get(key)}")
        if rec.get("steps") is not None and got.get("steps") != rec["steps"]:
            out.append(f"{model}: ensemble steps differ from upstream's")
        for key in reads.get(model, {}).get("required", []):
            value = got["parameters"].get(key)
            if value is None or "${" in value:
                out.append(f"{model}: required parameter {key} unset")
            elif key not in reads[model].get("empty_means_unset", []) and not value:
                out.append(f"{model}: required parameter {key} empty")
        for key in ("backend", "platform"):
            if key in rec and not str(rec[key]).startswith("${") and got.get(key) != rec[key]:
                out.append(f"{model}: {key} {got.get(key)} != {rec[key]}")
    return out


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_every_layout_conforms_to_the_recorded_upstream_interface(tmp_path, case, decoupled):
    repo = render(tmp_path, case, decoupled)
    layout = CASES[case][1]
    assert differences(repo, layout) == []
    if layout == "inflight_batcher_llm":
        for model in ("tensorrt_llm", "tensorrt_llm_bls"):
            got = parse_template((repo / model / "config.pbtxt").read_text())
            assert got["decoupled"] is decoupled, model
        params = parse_template((repo / "tensorrt_llm" / "config.pbtxt").read_text())["parameters"]
        assert params["gpt_model_path"] == params["tokenizer_dir"] == f"/models/{ENGINE_REL}"
        assert "engine_dir" not in params or case == "reference"  # the reference model's own checkpoint path
    else:
        got = parse_template((repo / "tensorrt_llm" / "config.pbtxt").read_text())
        assert got["max_batch_size"] == 0 and "decoupled" not in got  # both come from model.yaml, as upstream
        doc = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
        assert doc["triton_config"] == {"max_batch_size": 0, "decoupled": decoupled}
        assert doc["model"] == f"/models/{ENGINE_REL}" and doc["backend"] == "pytorch"


def test_the_newest_llmapi_layout_is_a_superset_of_1_2_1():
    old = {t["name"] for t in upstream.interface("1.2.1", "llmapi")["tensorrt_llm"]["inputs"]}
    new = {t["name"] for t in upstream.interface("main", "llmapi")["tensorrt_llm"]["inputs"]}
    assert old < new and {"image_url", "lora_id"} <= new - old


def test_llmapi_instances_map_to_one_group_with_gpu_device_ids(tmp_path):
    repo = render(tmp_path, "llmapi", True, "serve.llm_instance_count=2", "build.tp_size=2")
    got = parse_template((repo / "tensorrt_llm" / "config.pbtxt").read_text())
    assert got["instance_group"] == {"count": 2, "kind": "KIND_CPU"}
    assert got["parameters"]["gpu_device_ids"] == "0,1;2,3"


@pytest.mark.parametrize("plant, expected", [
    (('{ name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true },\n', ""),
     "ensemble: input exclude_input_in_output missing"),
    (('{ name: "beam_width" data_type: TYPE_INT32 dims: [ 1 ] optional: true }',
      '{ name: "beam_width" data_type: TYPE_INT64 dims: [ 1 ] optional: true }'),
     "ensemble: beam_width data_type TYPE_INT64 != TYPE_INT32"),
    (('{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }',
      '{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] optional: true }'),
     "ensemble: max_tokens optional True != False"),
    (('output_map { key: "batch_index" value: "batch_index" }\n', ""), "ensemble: ensemble steps differ"),
])
def test_a_planted_ensemble_difference_is_caught(tmp_path, plant, expected):
    repo = render(tmp_path, "reference", True)
    path = repo / "ensemble" / "config.pbtxt"
    text = path.read_text()
    assert plant[0] in text
    path.write_text(text.replace(plant[0], plant[1], 1))
    assert any(d.startswith(expected) for d in differences(repo, "inflight_batcher_llm")), \
        differences(repo, "inflight_batcher_llm")


def test_a_missing_required_parameter_is_caught(tmp_path):
    repo = render(tmp_path, "engine", False)
    path = repo / "tensorrt_llm" / "config.pbtxt"
    line = next(x for x in path.read_text().splitlines() if '"xgrammar_tokenizer_info_path"' in x)
    path.write_text(path.read_text().replace(line + "\n", ""))
    assert differences(repo, "inflight_batcher_llm") == [
        "tensorrt_llm: required parameter xgrammar_tokenizer_info_path unset"]


def test_the_reshape_of_a_scalar_input_is_checked(tmp_path):
    repo = render(tmp_path, "engine", True)
    path = repo / "tensorrt_llm" / "config.pbtxt"
    old = '{ name: "beam_width" data_type: TYPE_INT32 dims: [ 1 ] reshape: { shape: [  ] } optional: true }'
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, old.replace(" reshape: { shape: [  ] }", "")))
    assert differences(repo, "inflight_batcher_llm") == ["tensorrt_llm: beam_width reshape None != []"]
