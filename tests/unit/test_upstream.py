"""The recorded upstream interface (``pipeline/upstream``): container pairs, the loader, the config.pbtxt template
parser that refreshes and verifies the record (negative controls on small hand-written configs), and, where
TensorRT-LLM is installed, the recorded build surface against the live package."""
from __future__ import annotations

import pytest

from pipeline import upstream
from pipeline.errors import UserError
from pipeline.upstream import refresh
from pipeline.upstream.pbtxt import parse_template
from tests.helpers.requires import requires_trtllm

# Hand-written in the shape of upstream's postprocessing template (two inputs, one output, two parameters)
POSTPROCESSING = """
name: "postprocessing"
backend: "python"
max_batch_size: ${triton_max_batch_size}
dynamic_batching {}
input [
  { name: "TOKENS_BATCH" data_type: TYPE_INT32 dims: [ -1, -1 ] },
  { name: "SEQUENCE_LENGTH" data_type: TYPE_INT32 dims: [ -1 ] }
]
output [ { name: "OUTPUT" data_type: TYPE_STRING dims: [ -1 ] } ]
parameters { key: "tokenizer_dir" value: { string_value: "${tokenizer_dir}" } }
parameters { key: "skip_special_tokens" value: { string_value: "${skip_special_tokens}" } }
instance_group [ { count: ${postprocessing_instance_count} kind: KIND_CPU } ]
"""


def test_container_pairs_are_nvidias_compatibility_matrix():
    pairs = upstream.container_pairs()
    # rows of NVIDIA's Release Compatibility Matrix (container trtllm-python-py3), server 4b54459 docs
    assert {k: pairs["nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"][k] for k in
            ("trtllm", "tensorrt", "triton", "cuda", "cuda_driver", "min_driver")} == {
        "trtllm": "1.1.0", "tensorrt": "10.13.3.9", "triton": "2.64.0", "cuda": "13.0.2.006",
        "cuda_driver": "580.95.05", "min_driver": "575"}
    assert pairs["nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3"]["trtllm"] == "1.0.0"
    assert pairs["nvcr.io/nvidia/tritonserver:25.06-trtllm-python-py3"]["tensorrt"] == "10.10.0.31"
    assert pairs["nvcr.io/nvidia/tritonserver:26.03-trtllm-python-py3"]["trtllm"] == "1.2.0"
    assert pairs["nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"]["min_driver"] is None  # no page gives it
    tags = sorted(p["tag"] for p in pairs.values())
    expected = [f"{y}.{m:02d}" for y in (24, 25, 26) for m in range(1, 13)]
    assert tags == [t for t in expected if "24.12" <= t <= "26.07"]  # every tag from 24.12 to the newest listed
    assert upstream.container_for("1.2.1") == "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"  # newest of four
    assert upstream.container_for("1.1.0") == "nvcr.io/nvidia/tritonserver:26.02-trtllm-python-py3"
    assert upstream.trtllm_for("nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3") == "1.0.0"
    assert upstream.trtllm_for("example.com/unknown:1") is None
    src = upstream.container_source("nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3")
    assert "compatibility.html" in src["trtllm"] and "row 25.12" in src["trtllm"]
    assert "TRITON_VERSION on r25.12" in src["triton"] and "rel-25-12.html" in src["min_driver"]
    assert src.keys() == set(upstream.FIGURES)
    with pytest.raises(UserError, match="no serving container recorded for TensorRT-LLM 9.9.9"):
        upstream.container_for("9.9.9")


def test_a_wrong_pair_is_refused():
    good = "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"
    assert upstream.check_pair("1.2.1", good) == []
    # negative controls: 25.12 ships 1.1.0, not 1.2.1 (the old record's mistake); an image not in the matrix
    (wrong,) = upstream.check_pair("1.2.1", "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3")
    assert "ships TensorRT-LLM 1.1.0" in wrong and "26.07-trtllm-python-py3" in wrong
    (unknown,) = upstream.check_pair("1.2.1", "nvcr.io/nvidia/tritonserver:25.12-py3", "serve.image")
    assert unknown.startswith("serve.image=") and "not a recorded" in unknown


def test_refresh_reads_nvidias_matrix_table_and_refuses_another_shape(tmp_path):
    table = ("## Container Name: trtllm-python-py3\n\n"
             "| Triton release version | NGC Tag | Python version | Torch version | TensorRT version | "
             "TensorRT-LLM version | CUDA version | CUDA Driver version | Size |\n"
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
             "| 26.07 | nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3 | Python 3.12.3 | 2.10.0a0 | 10.14.1.48 | "
             "1.2.1 | 13.1.0.036 | 590.44.01 | 14.20 GB |\n\n## Container Name: vllm-python-py3\n")
    rows = refresh.parse_matrix(table)
    assert rows["nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"]["trtllm"] == "1.2.1"
    assert rows["nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"]["python"] == "3.12.3"
    with pytest.raises(UserError, match="columns are"):
        refresh.parse_matrix(table.replace("TensorRT-LLM version | ", ""))
    with pytest.raises(UserError, match="not NVIDIA's compatibility matrix"):
        refresh.parse_matrix("# something else")
    recorded = upstream.container_pairs()["nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"]
    assert {k: recorded[k] for k in ("trtllm", "tensorrt", "cuda", "cuda_driver")} == {
        k: rows["nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"][k] for k in ("trtllm", "tensorrt", "cuda",
                                                                                    "cuda_driver")}


def test_containers_verb_names_the_source_of_every_figure(capsys):
    assert refresh.main(["containers"]) == 0
    out = capsys.readouterr().out
    block = out.split("nvcr.io/nvidia/tritonserver:25.11-trtllm-python-py3\n", 1)[1].split("nvcr.io", 1)[0]
    assert "1.0.3.2510" in block and "TRITON_VERSION on r25.11" in block
    assert "unknown: no NVIDIA page reached gives it" in block  # min_driver of 25.11 not reached


def test_the_default_serving_image_pairs_with_the_default_trtllm_version():
    from pipeline import hardware

    for runtime in ("trtllm_engine", "trtllm_llmapi"):
        cfg = hardware.compose(["model=tiny-qwen3", f"runtime={runtime}"])
        assert upstream.container_for(cfg.runtime.trtllm_version) == cfg.runtime.container == cfg.serve.image
        # the default container ships the default TensorRT-LLM version, per NVIDIA's matrix
        assert upstream.container_pairs()[cfg.runtime.container]["trtllm"] == cfg.runtime.trtllm_version


def test_lines_and_layouts():
    assert upstream.line_for("1.2.1") == upstream.line_for(None) == upstream.line_for("1.1.0") == "1.2.1"
    assert upstream.line_for("1.3.0rc2") == "main"
    ifb = upstream.interface("1.2.1", "inflight_batcher_llm")
    assert set(ifb) == {"ensemble", "preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls"}
    assert set(upstream.interface("main", "llmapi")) == {"tensorrt_llm"}
    with pytest.raises(UserError, match="has no inflight_batcher_llm layout upstream"):
        upstream.interface("main", "inflight_batcher_llm")
    with pytest.raises(UserError, match="no recorded upstream interface"):
        upstream.record("0.9")
    for model in ifb.values():
        assert model["source"]["repo"] == "NVIDIA/TensorRT-LLM" and len(model["source"]["commit"]) == 40


def test_record_holds_what_nvidias_clients_send_and_the_backend_requires():
    ens = upstream.tensor_names("1.2.1", "inflight_batcher_llm", "ensemble")
    assert {"exclude_input_in_output", "beam_width", "stop_words", "bad_words", "stream"} <= set(ens)
    assert "batch_index" in upstream.tensor_names("1.2.1", "inflight_batcher_llm", "ensemble", "outputs")
    pre = upstream.tensor_names("1.2.1", "inflight_batcher_llm", "preprocessing")
    assert {"REQUEST_OUTPUT_LEN", "BAD_WORDS_DICT", "STOP_WORDS_DICT"} <= set(pre)
    reads = upstream.reads("1.2.1", "inflight_batcher_llm")
    # gpt_model_type: read with no try/catch (model_instance_state.cc getBatchingTypeFromParams)
    assert set(reads["tensorrt_llm"]["required"]) == {"gpt_model_path", "gpt_model_type", "tokenizer_dir",
                                                      "xgrammar_tokenizer_info_path", "guided_decoding_backend"}
    trt = upstream.interface("1.2.1", "inflight_batcher_llm")["tensorrt_llm"]
    pet = next(t for t in trt["inputs"] if t["name"] == "prompt_embedding_table")
    assert pet["data_type"] == "${prompt_embedding_table_data_type}"  # templated upstream @ 0c8de69
    assert "enable_trt_overlap" in trt["parameters"]
    assert "engine_dir" not in upstream.interface("1.2.1", "inflight_batcher_llm")["tensorrt_llm"]["parameters"]
    llm = upstream.interface("1.2.1", "llmapi")["tensorrt_llm"]
    assert "max_batch_size" not in llm or llm["max_batch_size"] == 0  # from model.yaml's triton_config
    assert upstream.reads("1.2.1", "llmapi")["tensorrt_llm"]["model_yaml"]["required"][0] == "model"


def test_template_parser_keeps_placeholders_where_the_record_keeps_them():
    rec = parse_template(POSTPROCESSING)
    assert rec["max_batch_size"] == "${triton_max_batch_size}"
    assert rec["instance_group"] == {"count": "${postprocessing_instance_count}", "kind": "KIND_CPU"}
    assert [t["name"] for t in rec["inputs"]] == ["TOKENS_BATCH", "SEQUENCE_LENGTH"]
    assert rec["inputs"][0] == {"name": "TOKENS_BATCH", "data_type": "TYPE_INT32", "dims": [-1, -1],
                                "optional": False}
    assert rec["parameters"] == {"skip_special_tokens": "${skip_special_tokens}", "tokenizer_dir": "${tokenizer_dir}"}
    typed = parse_template('name: "m" output [ { name: "logits" data_type: ${logits_datatype} dims: [ -1 ] } ]')
    assert typed["outputs"][0]["data_type"] == "${logits_datatype}"


def test_template_parser_refuses_what_is_not_a_model_config():
    with pytest.raises(UserError, match="not a Triton model config"):
        parse_template('name: "m" input [ { name: "x" data_type: TYPE_NOPE dims: [ 1 ] } ]')
    with pytest.raises(UserError, match="not a Triton model config"):
        parse_template('name: "m" no_such_field: 1')


def test_hand_written_config_matches_the_record_and_each_planted_difference_is_named():
    recorded = upstream.interface("1.2.1", "inflight_batcher_llm")["postprocessing"]
    assert refresh.diff_model("postprocessing", recorded, parse_template(POSTPROCESSING)) == []
    dropped = POSTPROCESSING.replace('  { name: "SEQUENCE_LENGTH" data_type: TYPE_INT32 dims: [ -1 ] }\n', "") \
        .replace("dims: [ -1, -1 ] },", "dims: [ -1, -1 ] }")
    assert refresh.diff_model("postprocessing", recorded, parse_template(dropped)) == [
        "postprocessing: recorded input 'SEQUENCE_LENGTH' is not upstream"]
    retyped = POSTPROCESSING.replace('"TOKENS_BATCH" data_type: TYPE_INT32', '"TOKENS_BATCH" data_type: TYPE_INT64')
    assert refresh.diff_model("postprocessing", recorded, parse_template(retyped)) == [
        "postprocessing: input 'TOKENS_BATCH' data_type recorded 'TYPE_INT32', upstream 'TYPE_INT64'"]
    extra = POSTPROCESSING.replace('output [', 'parameters { key: "new_key" value: { string_value: "" } }\noutput [')
    assert refresh.diff_model("postprocessing", recorded, parse_template(extra)) == [
        "postprocessing: upstream parameter 'new_key' is not recorded"]


def test_verify_a_checkout_reports_missing_models_and_differences(tmp_path):
    layout = tmp_path / "all_models" / "inflight_batcher_llm"
    (layout / "postprocessing").mkdir(parents=True)
    (layout / "postprocessing" / "config.pbtxt").write_text(
        POSTPROCESSING.replace("TYPE_STRING", "TYPE_INT8"))
    out = refresh.verify_checkout(tmp_path, "1.2.1", ["inflight_batcher_llm"])
    assert "inflight_batcher_llm/postprocessing: output 'OUTPUT' data_type recorded 'TYPE_STRING', upstream " \
           "'TYPE_INT8'" in out
    assert any(f.startswith("inflight_batcher_llm/tensorrt_llm: recorded, but the checkout has no") for f in out)
    with pytest.raises(UserError, match="no llmapi/"):
        refresh.verify_checkout(tmp_path, "1.2.1", ["llmapi"])


def test_refresh_rewrites_the_layout_from_a_checkout(tmp_path, monkeypatch):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(upstream.DATA, data, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(upstream, "DATA", data)
    upstream._load.cache_clear()
    try:
        ckpt = tmp_path / "ckpt" / "triton_backend" / "all_models" / "llmapi" / "tensorrt_llm"
        ckpt.mkdir(parents=True)
        ckpt.joinpath("config.pbtxt").write_text(
            'name: "tensorrt_llm"\nbackend: "python"\ninput [ { name: "text_input" data_type: TYPE_STRING '
            'dims: [ -1 ] } ]\noutput [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]\n')
        refresh.refresh_checkout(tmp_path / "ckpt", "main", "llmapi", "f" * 40)
        upstream._load.cache_clear()
        got = upstream.interface("main", "llmapi", extended=False)["tensorrt_llm"]
        assert [t["name"] for t in got["inputs"]] == ["text_input"] and got["source"]["commit"] == "f" * 40
        assert upstream.reads("main", "llmapi")["tensorrt_llm"]["model_yaml"]  # hand-recorded parts are kept
        # so is this project's extension of the model (its guide inputs), marked as such
        ext = upstream.interface("main", "llmapi")["tensorrt_llm"]["inputs"][1:]
        assert [t["name"] for t in ext] == ["guided_decoding_guide_type", "guided_decoding_guide"]
        assert all(t["extension"] for t in ext)
    finally:
        upstream._load.cache_clear()


def test_verify_command_exit_status(tmp_path):
    assert refresh.main(["verify"]) == 2
    (tmp_path / "llmapi" / "tensorrt_llm").mkdir(parents=True)
    (tmp_path / "llmapi" / "tensorrt_llm" / "config.pbtxt").write_text('name: "tensorrt_llm"\nbackend: "python"\n')
    assert refresh.main(["verify", "--checkout", str(tmp_path), "--line", "main"]) == 1


@requires_trtllm
def test_recorded_build_surface_matches_the_installed_tensorrt_llm():
    assert refresh.verify_installed("1.2.1") == []


# Hand-written in the shape of upstream's ensemble and tensorrt_llm templates: every field the record keeps, each
# once templated and once literal, so a record that drops, renames or mistypes one of them differs.
EVERY_FIELD = """
name: "ensemble"
platform: "ensemble"
max_batch_size: 8
model_transaction_policy { decoupled: ${decoupled_mode} }
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] reshape: { shape: [ ] } },
  { name: "embedding" data_type: ${embedding_type} dims: [ ${hidden} ] optional: true allow_ragged_batch: true }
]
output [
  { name: "text_output" data_type: ${out_type} dims: [ -1 ] },
  { name: "scores" data_type: TYPE_FP32 dims: [ 2, 3 ] reshape: { shape: [ 6 ] } }
]
instance_group [ { count: ${first_count} kind: KIND_GPU }, { count: ${second_count} kind: KIND_CPU } ]
dynamic_batching { max_queue_delay_microseconds: ${delay} }
"""


def test_template_parser_records_every_field_it_keeps():
    rec = parse_template(EVERY_FIELD)
    assert rec == {
        "name": "ensemble", "platform": "ensemble", "max_batch_size": 8, "decoupled": "${decoupled_mode}",
        "inputs": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1], "optional": False,
                    "reshape": []},
                   {"name": "embedding", "data_type": "${embedding_type}", "dims": [1], "optional": True,
                    "allow_ragged_batch": True}],
        "outputs": [{"name": "text_output", "data_type": "${out_type}", "dims": [-1]},
                    {"name": "scores", "data_type": "TYPE_FP32", "dims": [2, 3], "reshape": [6]}],
        "parameters": {},
        "instance_group": {"count": "${first_count}", "kind": "KIND_GPU"},  # the first group's placeholder
        "dynamic_batching": {"max_queue_delay_microseconds": "${delay}"}}
    assert all(type(v) is bool for t in rec["inputs"] for k, v in t.items() if k in ("optional",
                                                                                     "allow_ragged_batch"))


def test_template_parser_records_ensemble_steps_with_sorted_maps():
    steps = EVERY_FIELD.replace("dynamic_batching { max_queue_delay_microseconds: ${delay} }\n", """
ensemble_scheduling {
  step [
    { model_name: "preprocessing" model_version: -1
      input_map { key: "QUERY" value: "text_input" } input_map { key: "ALPHA" value: "embedding" }
      output_map { key: "ZETA" value: "_ids" } output_map { key: "BETA" value: "_len" } },
    { model_name: "postprocessing" model_version: -1
      input_map { key: "TOKENS" value: "_ids" } output_map { key: "OUTPUT" value: "text_output" } }
  ]
}
""")
    rec = parse_template(steps)
    assert "dynamic_batching" not in rec
    assert rec["steps"] == [
        {"model_name": "preprocessing", "input_map": {"ALPHA": "embedding", "QUERY": "text_input"},
         "output_map": {"BETA": "_len", "ZETA": "_ids"}},
        {"model_name": "postprocessing", "input_map": {"TOKENS": "_ids"}, "output_map": {"OUTPUT": "text_output"}}]
    # the maps are recorded in key order (the record's YAML is written sorted)
    assert list(rec["steps"][0]["input_map"]) == ["ALPHA", "QUERY"]
    assert list(rec["steps"][0]["output_map"]) == ["BETA", "ZETA"]
    assert "steps" not in parse_template(EVERY_FIELD)


def test_template_parser_records_literal_fields_as_values():
    rec = parse_template(EVERY_FIELD.replace("${decoupled_mode}", "true").replace("${first_count}", "3")
                         .replace("${second_count}", "5")
                         .replace("${delay}", "250").replace('platform: "ensemble"', 'backend: "python"')
                         .replace("max_batch_size: 8", "max_batch_size: ${mbs}"))
    assert rec["decoupled"] is True and rec["max_batch_size"] == "${mbs}" and rec["backend"] == "python"
    assert "platform" not in rec
    assert rec["instance_group"] == {"count": 3, "kind": "KIND_GPU"} and type(rec["instance_group"]["count"]) is int
    assert rec["dynamic_batching"] == {"max_queue_delay_microseconds": 250}
    assert type(rec["dynamic_batching"]["max_queue_delay_microseconds"]) is int
    plain = parse_template('name: "m" max_batch_size: 4 model_transaction_policy { decoupled: false }')
    assert plain == {"name": "m", "max_batch_size": 4, "decoupled": False, "inputs": [], "outputs": [],
                     "parameters": {}}
    assert type(plain["max_batch_size"]) is int and plain["decoupled"] is False
    # a placeholder that is not the data type of a named tensor is a field placeholder, parsed as 1
    assert parse_template('name: "m" max_batch_size: 0 model_transaction_policy { decoupled: ${d} }')[
        "decoupled"] == "${d}"


def test_template_parser_names_the_file_it_refuses():
    with pytest.raises(UserError, match=r"^config\.pbtxt: not a Triton model config"):
        parse_template("name: 1 2 3")
    with pytest.raises(UserError, match=r"^L/m/config\.pbtxt: not a Triton model config"):
        parse_template("name: 1 2 3", name="L/m/config.pbtxt")


def test_a_templated_data_type_not_tied_to_a_tensor_name_is_recorded_as_invalid():
    # the parser ties a data type placeholder to the name written before it; written the other way round, the type
    # is unknown, and the record says so rather than taking the enum value the stand-in would parse as
    rec = parse_template('name: "m" output [ { data_type: ${t} name: "x" dims: [ 1 ] } ]')
    assert rec["outputs"] == [{"name": "x", "data_type": "TYPE_INVALID", "dims": [1]}]
