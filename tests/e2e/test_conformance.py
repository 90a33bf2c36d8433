"""Every layout the package stage writes, decoupled and not, against upstream's recorded interface
(``pipeline/upstream``, read from NVIDIA's triton_backend config.pbtxt files), as the shipped lint
(``pipeline.triton.lint``, which the package stage runs) reports it: the same tensors with the same data type, dims,
optional flag, ragged batching and reshape, upstream's ensemble steps, every parameter the backend reads without a
fallback filled, and the llmapi layout's batch size and transaction policy in model.yaml. Negative controls plant
one difference each; the shipped lint must name it."""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from pipeline import hardware, upstream
from pipeline.catalog import ENGINE_REL
from pipeline.triton.repository import render_repository
from pipeline.triton import lint
from pipeline.upstream.pbtxt import parse_template

CASES = {  # name: (overrides, layout); the engine/LLM-API repositories are for a GPU target, rendered here only
    "engine": (["model=qwen32b", "quant=fp8", "target=h100", "runtime=trtllm_engine"], "inflight_batcher_llm"),
    "reference": (["model=tiny-qwen3", "quant=fp8", "target=cpu", "runtime=reference"], "inflight_batcher_llm"),
    "llmapi": (["model=qwen32b", "quant=nvfp4", "target=b200", "runtime=trtllm_llmapi"], "llmapi"),
    "reference-llmapi": (["model=tiny-qwen3", "quant=fp8", "target=cpu", "runtime=reference", "serve.layout=llmapi"],
                         "llmapi"),
}


_RENDERED: dict[tuple, Path] = {}


def render(tmp: Path, case: str, decoupled: bool, *extra: str) -> Path:
    """A copy (under ``tmp``) of the repository the package stage renders for ``case``: rendered once per session
    and settings (under the session's base temp, so a later session renders again), copied per test."""
    key = (case, decoupled, extra)
    src = _RENDERED.get(key)
    if src is None or not src.is_dir():
        where = Path(tempfile.mkdtemp(prefix="rendered-", dir=tmp.parent))  # unique, also across sessions
        src = _RENDERED[key] = _render(where / "repo", case, decoupled, *extra)
    repo = tmp / f"{case}-{decoupled}"
    shutil.copytree(src, repo)
    return repo


def _render(repo: Path, case: str, decoupled: bool, *extra: str) -> Path:
    overrides, _ = CASES[case]
    eng = repo / ENGINE_REL
    eng.mkdir(parents=True)
    from tests.helpers.tokenizers import tiny_tokenizer

    tiny_tokenizer().save_pretrained(eng)  # the package stage writes xgrammar's tokenizer info from it
    if "runtime=trtllm_engine" in overrides:
        (eng / "config.json").write_text(json.dumps({"version": "1.2.1", "build_config": {"max_batch_size": 8},
                                                     "pretrained_config": {"mapping": {"world_size": 1}}}))
        (eng / "rank0.engine").write_bytes(b"stand-in")  # TensorRT-LLM cannot build one here
    render_repository(hardware.compose([*overrides, f"serve.decoupled={str(decoupled).lower()}", *extra]), repo)
    model_py = repo / "tensorrt_llm" / "1" / "model.py"
    if not model_py.is_file():  # the llmapi reference model.py is copied by the package stage; lint needs its presence
        model_py.write_text("")
    return repo


def differences(repo: Path, line: str = "1.2.1") -> list[str]:
    """Every way the repository differs from the recorded upstream interface, as the package stage's lint reports it
    (``pipeline.triton.lint``: the shipped check, never one written here)."""
    return lint.lint(repo, trtllm_version=line)


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_every_layout_conforms_to_the_recorded_upstream_interface(tmp_path, case, decoupled):
    repo = render(tmp_path, case, decoupled)
    layout = CASES[case][1]
    assert lint.layout_of({p.parent.name: p.parent for p in repo.glob("*/config.pbtxt")}) == layout
    assert differences(repo) == []
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


ENSEMBLE = "ensemble/config.pbtxt"
TRTLLM = "tensorrt_llm/config.pbtxt"


@pytest.mark.parametrize("model, plant, expected", [
    ("ensemble", ('{ name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true },\n', ""),
     f'{ENSEMBLE}: upstream input "exclude_input_in_output" is missing'),
    ("ensemble", ('{ name: "beam_width" data_type: TYPE_INT32 dims: [ 1 ] optional: true }',
                  '{ name: "beam_width" data_type: TYPE_INT64 dims: [ 1 ] optional: true }'),
     f'{ENSEMBLE}: input "beam_width" is TYPE_INT64, upstream has TYPE_INT32'),
    ("ensemble", ('{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }',
                  '{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] optional: true }'),
     f'{ENSEMBLE}: input "max_tokens" optional=true, upstream has optional=false'),
    ("ensemble", ('output_map { key: "batch_index" value: "batch_index" }\n', ""),
     f"{ENSEMBLE}: step 1 (tensorrt_llm) lacks upstream's output_map batch_index -> batch_index"),
    ("ensemble", ('input_map { key: "beam_width" value: "beam_width" }', 'input_map { key: "beam_width" value: '
                  '"num_return_sequences" }'),
     f"{ENSEMBLE}: step 1 (tensorrt_llm) maps input_map beam_width -> num_return_sequences, upstream -> beam_width"),
    ("preprocessing", ('backend: "python"', 'backend: "pytorch"'),
     'preprocessing/config.pbtxt: backend "pytorch", upstream has "python"'),
    ("tensorrt_llm", (' allow_ragged_batch: true', ''),
     f'{TRTLLM}: input "input_ids" allow_ragged_batch=false, upstream has allow_ragged_batch=true'),
])
def test_a_planted_difference_is_caught_by_the_shipped_lint(tmp_path, model, plant, expected):
    repo = render(tmp_path, "reference", True)
    path = repo / model / "config.pbtxt"
    text = path.read_text()
    assert plant[0] in text
    path.write_text(text.replace(plant[0], plant[1], 1))
    found = differences(repo)
    assert any(f.startswith(expected) for f in found), found


@pytest.mark.parametrize("key", ["xgrammar_tokenizer_info_path", "tokenizer_dir", "guided_decoding_backend"])
def test_a_missing_required_parameter_is_caught(tmp_path, key):
    repo = render(tmp_path, "engine", False)
    path = repo / "tensorrt_llm" / "config.pbtxt"
    line = next(x for x in path.read_text().splitlines() if f'"{key}"' in x)
    path.write_text(path.read_text().replace(line + "\n", ""))
    assert [f for f in differences(repo) if "required parameter" in f] == [
        f'{TRTLLM}: required parameter "{key}" is missing; the tensorrtllm model reads it unconditionally '
        f'(triton_backend/inflight_batcher_llm/src/model_instance_state.cc); set it']


def test_an_empty_required_parameter_is_caught_unless_upstream_reads_empty_as_unset(tmp_path):
    repo = render(tmp_path, "engine", False)
    path = repo / "tensorrt_llm" / "config.pbtxt"
    text = path.read_text()
    for key in ("xgrammar_tokenizer_info_path", "guided_decoding_backend"):  # upstream: empty means unset
        text = re.sub(f'key: "{key}" value: {{ string_value: "[^"]*" }}', f'key: "{key}" value: {{ string_value: "" }}',
                      text)
    path.write_text(text)
    assert not any("xgrammar" in f or "guided_decoding" in f for f in differences(repo))
    old = f'key: "tokenizer_dir" value: {{ string_value: "/models/{ENGINE_REL}" }}'
    assert old in text
    path.write_text(text.replace(old, 'key: "tokenizer_dir" value: { string_value: "" }'))
    found = differences(repo)
    assert any(f.startswith(f'{TRTLLM}: required parameter "tokenizer_dir" is empty') for f in found), found


def test_the_reshape_of_a_scalar_input_is_checked(tmp_path):
    repo = render(tmp_path, "engine", True)
    path = repo / "tensorrt_llm" / "config.pbtxt"
    old = '{ name: "beam_width" data_type: TYPE_INT32 dims: [ 1 ] reshape: { shape: [  ] } optional: true }'
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, old.replace(" reshape: { shape: [  ] }", "")))
    assert differences(repo) == [f'{TRTLLM}: input "beam_width" reshape None, upstream has []']
