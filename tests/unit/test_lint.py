"""``pipeline lint`` against the recorded upstream interface: a rendered repository of each layout is clean,
decoupled or not; a copy with one upstream tensor removed, one required parameter missing, or one llmapi rule broken
fails naming it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline import hardware
from pipeline.errors import UserError
from pipeline.catalog import ENGINE_REL
from pipeline.triton.repository import render_repository
from pipeline.triton import lint

CASES = {
    "engine": ["model=qwen32b", "quant=fp8", "target=h100", "runtime=trtllm_engine"],
    "engine-unary": ["model=qwen32b", "quant=fp8", "target=h100", "runtime=trtllm_engine", "serve.decoupled=false"],
    "llmapi": ["model=qwen32b", "quant=nvfp4", "target=b200", "runtime=trtllm_llmapi", "serve.llm_instance_count=2"],
    "reference-llmapi-unary": ["model=tiny-qwen3", "quant=fp8", "target=cpu", "runtime=reference",
                               "serve.layout=llmapi", "serve.decoupled=false"],
}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Path]:
    from tests.helpers.tokenizers import tiny_tokenizer

    base = tmp_path_factory.mktemp("lint-repos")
    tokenizer = tiny_tokenizer()  # the package stage writes xgrammar's tokenizer info from it
    out = {}
    for name, overrides in CASES.items():
        repo = base / name
        eng = repo / ENGINE_REL
        eng.mkdir(parents=True)
        tokenizer.save_pretrained(eng)
        if "runtime=trtllm_engine" in overrides:
            (eng / "config.json").write_text(json.dumps({
                "version": "1.2.1", "build_config": {"max_batch_size": 8},
                "pretrained_config": {"mapping": {"world_size": 1}}}))
            (eng / "rank0.engine").write_bytes(b"stand-in")  # TensorRT-LLM cannot build one here
        render_repository(hardware.compose(overrides), repo)
        model_py = repo / "tensorrt_llm" / "1" / "model.py"
        if not model_py.is_file():  # the llmapi reference model.py is written elsewhere; lint needs only its presence
            model_py.write_text("")
        out[name] = repo
    return out


def copy(rendered, name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(rendered[name], dst)
    return dst


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def drop_line(path: Path, needle: str) -> None:
    lines = path.read_text().splitlines(keepends=True)
    hit = [x for x in lines if needle in x]
    assert len(hit) == 1, hit
    path.write_text("".join(x for x in lines if x is not hit[0]))


@pytest.mark.parametrize("name", list(CASES))
def test_rendered_repositories_are_clean_decoupled_or_not(rendered, name):
    assert lint.lint(rendered[name], trtllm_version="1.2.1") == []


def test_a_removed_upstream_tensor_is_named(rendered, tmp_path):
    repo = copy(rendered, "engine", tmp_path)
    drop_line(repo / "preprocessing" / "config.pbtxt", '"STOP_WORDS_DICT"')
    findings = lint.lint(repo)
    assert any(f.startswith('preprocessing/config.pbtxt: upstream input "STOP_WORDS_DICT" is missing') for f in findings)
    assert any("maps input \"STOP_WORDS_DICT\", which the model does not have" in f for f in findings)


def test_a_removed_output_and_a_renamed_input_are_named(rendered, tmp_path):
    repo = copy(rendered, "engine-unary", tmp_path)
    drop_line(repo / "tensorrt_llm_bls" / "config.pbtxt", '{ name: "batch_index"')
    edit(repo / "tensorrt_llm_bls" / "config.pbtxt", 'name: "exclude_input_in_output"', 'name: "exclude_input"')
    findings = lint.lint(repo)
    assert 'tensorrt_llm_bls/config.pbtxt: upstream output "batch_index" is missing' in "\n".join(findings)
    assert any('"exclude_input" is not in upstream\'s interface' in f for f in findings)
    assert any('upstream input "exclude_input_in_output" is missing' in f for f in findings)


@pytest.mark.parametrize("key", ["gpt_model_path", "gpt_model_type", "tokenizer_dir", "xgrammar_tokenizer_info_path",
                                 "guided_decoding_backend"])
def test_a_missing_required_parameter_is_named(rendered, tmp_path, key):
    repo = copy(rendered, "engine", tmp_path)
    drop_line(repo / "tensorrt_llm" / "config.pbtxt", f'key: "{key}"')
    findings = lint.lint(repo)
    assert any(f.startswith(f'tensorrt_llm/config.pbtxt: required parameter "{key}" is missing') for f in findings), \
        findings


@pytest.mark.parametrize("key,good,bad,says", [
    ("kv_cache_free_gpu_mem_fraction", "0.9", "1.0", "must be < 1"),
    ("batch_scheduler_policy", "guaranteed_no_evict", "static", "not one of max_utilization, guaranteed_no_evict"),
    ("enable_kv_cache_reuse", "true", "yes", "cannot convert it"),
])
def test_a_parsed_value_the_backend_refuses_is_named(rendered, tmp_path, key, good, bad, says):
    repo = copy(rendered, "engine", tmp_path)
    edit(repo / "tensorrt_llm" / "config.pbtxt", f'key: "{key}" value: {{ string_value: "{good}" }}',
         f'key: "{key}" value: {{ string_value: "{bad}" }}')
    findings = lint.lint(repo)
    assert any(f.startswith(f"tensorrt_llm/config.pbtxt: {key}={bad!r}") and says in f for f in findings), findings


def test_an_empty_engine_path_is_named(rendered, tmp_path):
    repo = copy(rendered, "engine", tmp_path)
    edit(repo / "tensorrt_llm" / "config.pbtxt", f'string_value: "/models/{ENGINE_REL}" }} }}\nparameters {{ key: '
         f'"encoder_model_path"', 'string_value: "" } }\nparameters { key: "encoder_model_path"')
    assert any("gpt_model_path is empty" in f for f in lint.lint(repo))


def test_a_wrong_type_dims_or_optional_flag_is_named(rendered, tmp_path):
    repo = copy(rendered, "engine", tmp_path)
    path = repo / "ensemble" / "config.pbtxt"
    edit(path, '{ name: "stop_words" data_type: TYPE_STRING dims: [ -1 ]',
         '{ name: "stop_words" data_type: TYPE_STRING dims: [ 1 ]')
    edit(path, '{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }',
         '{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] optional: true }')
    findings = lint.lint(repo)
    assert 'ensemble/config.pbtxt: input "stop_words" dims [1], upstream has [-1]' in findings
    assert 'ensemble/config.pbtxt: input "max_tokens" optional=true, upstream has optional=false' in findings


def test_an_engine_from_another_trtllm_names_the_matching_container(rendered, tmp_path):
    repo = copy(rendered, "engine", tmp_path)
    cfg = repo / ENGINE_REL / "config.json"
    cfg.write_text(cfg.read_text().replace('"1.2.1"', '"1.1.0"'))
    findings = lint.lint(repo, container="nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3")
    assert findings == ["tensorrt_llm/config.pbtxt: engine built by TensorRT-LLM 1.1.0, serving container has 1.2.1; "
                        "rebuild with 1.2.1 or serve with nvcr.io/nvidia/tritonserver:26.02-trtllm-python-py3"]
    assert lint.lint(repo, container="nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3") == []  # ships 1.1.0


@pytest.mark.parametrize("change, expected", [
    ({"model": "engine"}, "tensorrt_llm/1/model.yaml: model 'engine' is relative"),
    ({"model": "/wrong/mount/x"}, "tensorrt_llm/1/model.yaml: model /wrong/mount/x is outside the repository"),
    ({"model": "/models/tensorrt_llm/1/nowhere"}, "does not exist in the repository"),
    ({"triton_config": {"max_batch_size": 0}}, "triton_config needs max_batch_size and decoupled"),
])
def test_llmapi_model_yaml_rules(rendered, tmp_path, change, expected):
    repo = copy(rendered, "llmapi", tmp_path)
    path = repo / "tensorrt_llm" / "1" / "model.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **change}))
    findings = lint.lint(repo)
    assert len(findings) == 1 and expected in findings[0], findings


def test_llmapi_config_must_leave_batching_to_model_yaml_and_name_each_instances_gpus(rendered, tmp_path):
    repo = copy(rendered, "llmapi", tmp_path)
    path = repo / "tensorrt_llm" / "config.pbtxt"
    edit(path, 'backend: "python"', 'backend: "python"\nmax_batch_size: 8')
    edit(path, 'string_value: "0;1"', 'string_value: "0"')
    findings = lint.lint(repo)
    assert any("sets max_batch_size/model_transaction_policy" in f for f in findings)
    assert any("2 instances need 2 GPU sets in gpu_device_ids" in f for f in findings)


def test_llmapi_layout_against_the_newest_line_names_what_it_lacks(rendered):
    findings = lint.lint(rendered["reference-llmapi-unary"], line="main")
    assert any('upstream input "image_url" is missing' in f for f in findings)


# ------------------------------------------------------------------------------------------------ loadability
def test_a_model_without_a_version_directory_is_named(rendered, tmp_path):
    """Triton refuses a model with no version directory ("at least one version must be available"): the empty
    ``ensemble/1/`` that a file-only copy loses."""
    repo = copy(rendered, "engine", tmp_path)
    shutil.rmtree(repo / "ensemble" / "1")
    findings = lint.lint(repo, trtllm_version="1.2.1")
    assert findings == ["ensemble/: no version directory (ensemble/1/); Triton refuses the model (\"at least one "
                        "version must be available\"): create ensemble/1/"]


def test_a_stray_directory_in_the_repository_is_named(rendered, tmp_path):
    repo = copy(rendered, "engine", tmp_path)
    (repo / "notes").mkdir()
    findings = lint.lint(repo, trtllm_version="1.2.1")
    assert len(findings) == 1 and findings[0].startswith("notes/: a directory without config.pbtxt"), findings


@pytest.mark.parametrize("bls, llm", [("true", "false"), ("false", "true")])
def test_a_bls_and_a_model_in_different_decoupled_modes_are_named(rendered, tmp_path, bls, llm):
    """The BLS calls ``tensorrt_llm`` with its own decoupled flag: a decoupled BLS over a unary model (or the
    reverse) fails at run time, so lint refuses the mix; each repository alone is valid (the clean cases above)."""
    repo = copy(rendered, "engine", tmp_path)
    for name, mode in (("tensorrt_llm_bls", bls), ("tensorrt_llm", llm)):
        p = repo / name / "config.pbtxt"
        text = p.read_text()
        assert "decoupled: true" in text
        p.write_text(text.replace("decoupled: true", f"decoupled: {mode}"))
    findings = lint.lint(repo, trtllm_version="1.2.1")
    want = (f"tensorrt_llm_bls/config.pbtxt: decoupled: {bls}, but tensorrt_llm is "
            f"{'decoupled' if llm == 'true' else 'unary'}")
    assert len(findings) == 1 and findings[0].startswith(want), findings


def test_a_bls_batch_size_above_the_models_is_named(rendered, tmp_path):
    repo = copy(rendered, "engine", tmp_path)
    p = repo / "tensorrt_llm_bls" / "config.pbtxt"
    text = p.read_text()
    assert "max_batch_size: 8" in text
    p.write_text(text.replace("max_batch_size: 8", "max_batch_size: 64", 1))
    findings = lint.lint(repo, trtllm_version="1.2.1")
    assert any("tensorrt_llm_bls/config.pbtxt: max_batch_size 64 exceeds tensorrt_llm's 8" in f for f in findings)


def _drop_a_brace(text: str) -> str:
    i = text.index("}")
    return text[:i] + text[i + 1:]


def _unquote_a_path(text: str) -> str:
    """A path value written without its quotes: the parse error quotes the line, slashes and all."""
    import re

    m = re.search(r'string_value:\s*"([^"]*/[^"]*)"', text)
    assert m, "no path value to unquote"
    return text[: m.start()] + f"string_value: {m.group(1)}" + text[m.end():]


@pytest.mark.parametrize("layout, damage", [("engine", _drop_a_brace), ("llmapi", _drop_a_brace),
                                            ("engine", _unquote_a_path)])
def test_a_parse_error_is_reported_once(rendered, tmp_path, layout, damage):
    """One missing brace (or one unquoted path, whose error message holds slashes of its own) is one finding, not
    every ensemble step and output that follows from the unparsed model; in the llmapi layout the unparsed model
    leaves the layout unknown, and that is still the only finding."""
    repo = copy(rendered, layout, tmp_path)
    p = repo / "tensorrt_llm" / "config.pbtxt"
    p.write_text(damage(p.read_text()))
    findings = lint.lint(repo, trtllm_version="1.2.1")
    assert len(findings) == 1 and findings[0].startswith("tensorrt_llm/config.pbtxt: not a valid Triton model"), \
        findings


def _plant_wrong_type(path: Path, kind: str, tensor: str) -> tuple[str, str]:
    """Give ``tensor`` (an input or output of ``path``) another data type; -> (the type it had, the planted one)."""
    import re

    block = "input" if kind == "inputs" else "output"
    text = path.read_text()
    # the tensor's own entry inside the input [...] / output [...] list (an ensemble's step maps repeat its name)
    start = re.search(rf"^{block}\s*\[", text, re.M).end()
    m = re.compile(rf'name:\s*"{re.escape(tensor)}"\s+data_type:\s*(TYPE_\w+)').search(text, start)
    assert m, (path, tensor)
    old = m.group(1)
    new = "TYPE_FP64" if old != "TYPE_FP64" else "TYPE_INT8"
    path.write_text(text[: m.start(1)] + new + text[m.end(1):])
    return old, new


def _typed_tensors(layout: str, line: str = "1.2.1"):
    """(model, kind, tensor): the first tensor of each kind of every recorded model whose data type upstream fixes
    (a templated ``${...}`` type is the deployer's choice)."""
    from pipeline import upstream

    for model, rec in upstream.interface(line, layout).items():
        for kind in ("inputs", "outputs"):
            fixed = [t["name"] for t in rec.get(kind, []) if not str(t["data_type"]).startswith("${")]
            if fixed:
                yield model, kind, fixed[0]


@pytest.mark.parametrize("case, layout", [("engine", "inflight_batcher_llm"), ("llmapi", "llmapi")])
def test_a_planted_wrong_data_type_is_named_for_every_model_of_each_layout(rendered, tmp_path, case, layout):
    """The data-type comparison with the record, one planted type per model and direction; each must be named with
    the upstream type, and no other difference from upstream for that tensor."""
    planted = list(_typed_tensors(layout))
    assert {m for m, _, _ in planted} >= ({"tensorrt_llm"} if layout == "llmapi" else
                                          {"ensemble", "preprocessing", "postprocessing", "tensorrt_llm",
                                           "tensorrt_llm_bls"})
    for model, kind, tensor in planted:
        repo = tmp_path / f"{model}-{kind}"
        shutil.copytree(rendered[case], repo)
        old, new = _plant_wrong_type(repo / model / "config.pbtxt", kind, tensor)
        findings = lint.lint(repo, trtllm_version="1.2.1")
        want = f'{model}/config.pbtxt: {kind[:-1]} "{tensor}" is {new}, upstream has {old}'
        assert want in findings, (want, findings)
        about = [f for f in findings if f.startswith(f'{model}/config.pbtxt: {kind[:-1]} "{tensor}"')
                 and "upstream has" in f]
        assert about == [want], about  # its dims, reshape and optional flag still match


def test_a_missing_model_of_the_layout_is_named_and_an_optional_one_is_not(rendered, tmp_path):
    repo = copy(rendered, "engine", tmp_path)
    shutil.rmtree(repo / "postprocessing")
    shutil.rmtree(repo / "preprocessing")
    findings = lint.lint(repo, trtllm_version="1.2.1")
    for model in ("preprocessing", "postprocessing"):
        assert f"{model}/config.pbtxt: missing; upstream's inflight_batcher_llm layout has a \"{model}\" model" \
            in findings, findings
    assert 'ensemble/config.pbtxt: step 0 uses model "preprocessing", which is not in the repository' in findings
    # upstream's BLS model is an alternative entry point, not a model every repository must have
    repo = copy(rendered, "engine", tmp_path / "no-bls")
    shutil.rmtree(repo / "tensorrt_llm_bls")
    assert lint.lint(repo, trtllm_version="1.2.1") == []


def test_a_broken_ensemble_step_does_not_stop_the_other_models_checks(rendered, tmp_path):
    repo = copy(rendered, "engine", tmp_path)
    p = repo / "preprocessing" / "config.pbtxt"
    text = p.read_text()
    i = text.index("}")
    p.write_text(text[:i] + text[i + 1:])
    drop_line(repo / "tensorrt_llm" / "config.pbtxt", 'key: "tokenizer_dir"')
    findings = lint.lint(repo, trtllm_version="1.2.1")
    assert findings[0].startswith("preprocessing/config.pbtxt: not a valid Triton model") and len(findings) == 2
    assert findings[1].startswith('tensorrt_llm/config.pbtxt: required parameter "tokenizer_dir" is missing')


def test_the_container_picks_the_line_only_when_no_version_is_given(rendered):
    image = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"  # ships TensorRT-LLM 1.2.1
    repo = rendered["llmapi"]
    newest = lint.lint(repo, trtllm_version="1.3.0")  # the main line's record
    assert newest != [] and lint.lint(repo, container=image) == []
    assert lint.lint(repo, trtllm_version="1.3.0", container=image) == newest


def test_a_path_that_is_not_a_directory_is_refused(tmp_path):
    with pytest.raises(UserError) as err:
        lint.lint(tmp_path / "nope")
    assert str(err.value) == f"{tmp_path / 'nope'}: no such directory"


def test_a_model_the_record_says_nothing_it_reads_about_is_compared_on_its_tensors(rendered, monkeypatch):
    monkeypatch.setattr(lint.upstream, "reads", lambda line, layout: {})  # a record line without a reads section
    assert lint.lint(rendered["engine"], trtllm_version="1.2.1") == []


def test_the_serving_mount_given_is_the_one_paths_are_checked_against(rendered):
    assert lint.lint(rendered["engine"], trtllm_version="1.2.1") == []
    elsewhere = lint.lint(rendered["engine"], trtllm_version="1.2.1", repo_mount="/srv/repo")
    assert elsewhere and all("/srv/repo" in f for f in elsewhere), elsewhere


def test_a_config_with_bytes_that_are_not_utf8_is_read_not_refused(rendered, tmp_path):
    repo = copy(rendered, "engine", tmp_path)
    p = repo / "postprocessing" / "config.pbtxt"
    p.write_bytes(p.read_bytes() + b"\n# \xff\n")
    assert lint.lint(repo, trtllm_version="1.2.1") == []


def test_a_config_with_bytes_that_are_not_utf8_is_still_checked_for_loading(rendered, tmp_path):
    """The loadability rules read the config as the parse did (undecodable bytes replaced), not skip it."""
    repo = copy(rendered, "engine", tmp_path)
    p = repo / "tensorrt_llm_bls" / "config.pbtxt"
    edit(p, "max_batch_size: 8", "max_batch_size: 64")
    p.write_bytes(p.read_bytes() + b"\n# \xff\n")
    findings = lint.lint(repo, trtllm_version="1.2.1")
    assert any(f.startswith("tensorrt_llm_bls/config.pbtxt: max_batch_size 64 exceeds tensorrt_llm's 8")
               for f in findings), findings


def test_guided_decoding_is_rendered_as_upstreams_workflow_and_a_planted_mistake_in_it_is_named(rendered, tmp_path):
    """tensorrtllm_backend docs/guided_decoding.md: the C++ backend takes guided_decoding_backend xgrammar and the
    tokenizer info file NVIDIA's generate_xgrammar_tokenizer_info.py writes; the LLM API takes it in model.yaml."""
    import yaml

    repo = copy(rendered, "engine", tmp_path)
    cfg = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert 'key: "guided_decoding_backend" value: { string_value: "xgrammar" }' in cfg
    info = json.loads((repo / "tensorrt_llm" / "1" / "xgrammar_tokenizer_info.json").read_text())
    assert set(info) == {"encoded_vocab", "tokenizer_str", "stop_token_ids"} and "<|im_end|>" in info["encoded_vocab"]
    edit(repo / "tensorrt_llm" / "config.pbtxt", 'string_value: "xgrammar"', 'string_value: "llguidance"')
    info.pop("tokenizer_str")
    (repo / "tensorrt_llm" / "1" / "xgrammar_tokenizer_info.json").write_text(json.dumps(info))
    findings = "\n".join(lint.lint(repo, trtllm_version="1.2.1"))
    assert "guided_decoding_backend 'llguidance' is not one TensorRT-LLM's Triton backend takes (xgrammar" in findings
    assert "xgrammar_tokenizer_info.json lacks tokenizer_str" in findings
    (repo / "tensorrt_llm" / "1" / "xgrammar_tokenizer_info.json").unlink()
    assert "does not exist (the C++ backend refuses to load)" in "\n".join(lint.lint(repo, trtllm_version="1.2.1"))

    repo = copy(rendered, "llmapi", tmp_path)
    doc = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert doc["guided_decoding_backend"] == "xgrammar"
    doc["guided_decoding_backend"] = "outlines"
    (repo / "tensorrt_llm" / "1" / "model.yaml").write_text(yaml.safe_dump(doc))
    assert any("guided_decoding_backend 'outlines' is not one the LLM API takes (xgrammar, llguidance" in f
               for f in lint.lint(repo, trtllm_version="1.2.1"))
