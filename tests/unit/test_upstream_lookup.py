"""Looking things up in the upstream record: which serving image pairs with a TensorRT-LLM version (the newest tag
when several do, ordered as versions, not as text), what an unknown image or version is told, the recorded lines
and a model's tensor names. Planted pairs stand in for containers.yaml where the choice needs several."""
from __future__ import annotations

import pytest

from pipeline import upstream
from pipeline.errors import UserError

IMG = "nvcr.io/nvidia/tritonserver:{}-trtllm-python-py3"
PAIRS = {IMG.format(t): {"trtllm": v, "tensorrt": "10.0", "triton": "2.0"}
         for t, v in (("24.12", "0.16.0"), ("25.9", "1.0.0"), ("25.10", "1.0.0"), ("25.06", "1.0.0"))}


@pytest.fixture
def pairs(monkeypatch):
    monkeypatch.setattr(upstream, "container_pairs", lambda: PAIRS)


def test_the_newest_tag_pairing_with_a_version_is_chosen_as_versions_order(pairs):
    assert upstream.container_for("1.0.0") == IMG.format("25.10")  # 25.10 > 25.9 > 25.06, not as text
    assert upstream.container_for("0.16.0") == IMG.format("24.12")


def test_a_version_no_image_pairs_with_is_refused_naming_the_recorded_ones(pairs):
    with pytest.raises(UserError) as err:
        upstream.container_for("9.9")
    assert str(err.value) == ("no serving container recorded for TensorRT-LLM 9.9 (recorded: 0.16.0, 1.0.0); set "
                              "runtime.container explicitly")


def test_tags_order_by_their_numbers_and_an_unversioned_tag_sorts_first():
    key = upstream._tag_key
    assert key("nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3") == (25, 10)
    assert key("registry:5000/nvidia/tritonserver:24.12-py3") == (24, 12)  # a registry port is not the tag
    assert key("nvcr.io/nvidia/tritonserver:latest") == (0,)
    assert key("tritonserver:25.10.1-trtllm") == (25, 10, 1)


def test_an_unrecorded_image_has_no_source_and_the_error_names_the_recorded_ones():
    with pytest.raises(UserError) as err:
        upstream.container_source("nvcr.io/x:1")
    recorded = ", ".join(upstream.container_pairs())
    assert str(err.value) == f"container nvcr.io/x:1 is not in the recorded pairs ({recorded})"


def test_the_recorded_lines_and_a_models_tensor_names():
    assert upstream.lines() == tuple(upstream.RECORD_FILES) and isinstance(upstream.lines(), tuple)
    names = upstream.tensor_names("1.2.1", "inflight_batcher_llm", "ensemble")
    assert names[0] == upstream.interface("1.2.1")["ensemble"]["inputs"][0]["name"]
    assert len(names) == len(set(names)) and "text_input" in names
    assert "text_output" in upstream.tensor_names("1.2.1", "inflight_batcher_llm", "ensemble", "outputs")


def test_a_wrong_pair_names_the_setting_and_the_versions_that_have_an_image(pairs):
    # an unrecorded image, a version with an image: the hint is that image
    assert upstream.check_pair("1.0.0", "x:1") == [
        f"runtime.container=x:1 is not a recorded trtllm-python-py3 serving image; recorded for TensorRT-LLM 1.0.0: "
        f"{IMG.format('25.10')}"]
    # a version no image ships: the hint lists the versions that have one
    assert upstream.check_pair("9.9", "x:1", setting="serve.image") == [
        "serve.image=x:1 is not a recorded trtllm-python-py3 serving image; recorded for TensorRT-LLM 9.9: "
        "a TensorRT-LLM version with a recorded image (0.16.0, 1.0.0)"]
    assert upstream.check_pair("0.16.0", IMG.format("25.10")) == [
        f"runtime.container={IMG.format('25.10')} ships TensorRT-LLM 1.0.0 (NVIDIA's compatibility matrix), not "
        f"runtime.trtllm_version=0.16.0; use {IMG.format('24.12')}"]
    assert upstream.check_pair(None, IMG.format("25.10")) == []


def test_a_tag_without_a_colon_sorts_first():
    assert upstream._tag_key("tritonserver") == (0,)  # no tag at all: not an error


def test_each_figures_source_names_the_page_row_and_commit():
    image = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"  # NVIDIA gives no minimum driver for it
    src = upstream.container_source(image)
    assert src["trtllm"] == ("https://docs.nvidia.com/deeplearning/triton-inference-server/user-guide/docs/"
                             "introduction/compatibility.html (row 26.07; triton-inference-server/server "
                             "docs/introduction/compatibility.md @ 4b54459107)")
    assert src["triton"] == "triton-inference-server/server TRITON_VERSION on r26.07 @ 819ee37770"
    assert src["min_driver"] == "unknown: no NVIDIA page reached gives it"


def test_lines_layouts_and_reads_lookups_and_their_errors():
    assert upstream.line_for("main") == "main" and upstream.line_for("1.3.0rc1") == "main"
    assert upstream.line_for("1.2.0") == "1.2.1" and upstream.line_for(None) == "1.2.1"
    with pytest.raises(UserError) as err:
        upstream.line_for("latest")
    assert str(err.value) == "TensorRT-LLM version 'latest' is not MAJOR.MINOR[.PATCH]"
    with pytest.raises(UserError) as err:
        upstream.record_file("0.9")
    assert str(err.value) == "no recorded upstream interface for TensorRT-LLM '0.9' (recorded: 1.2.1, main)"
    with pytest.raises(UserError) as err:
        upstream.interface("1.2.1", "disaggregated")
    assert str(err.value) == ("TensorRT-LLM 1.2.1 has no disaggregated layout upstream (it has: "
                              "inflight_batcher_llm, llmapi)")
    assert upstream.reads("1.2.1") == upstream.reads("1.2.1", "inflight_batcher_llm")
    assert "tensorrt_llm_bls" in upstream.reads("1.2.1") and "ensemble" not in upstream.reads("1.2.1", "llmapi")
    assert upstream.reads("1.2.1", "no_such_layout") == {}
    llmapi = upstream.tensor_names("1.2.1", "llmapi", "tensorrt_llm")
    assert llmapi == [t["name"] for t in upstream.interface("1.2.1", "llmapi")["tensorrt_llm"]["inputs"]]
    assert llmapi != upstream.tensor_names("1.2.1", "inflight_batcher_llm", "tensorrt_llm")


def test_the_recorded_runtime_lines_and_their_boundaries():
    doc = upstream.runtime_support()
    assert doc["tensorrt_engine"]["last_line"] == "1.2" and doc["llm_api_pytorch"]["default_from"] == "1.0"
    assert doc["llm_api_pytorch"]["serves_from"] == "1.2"
    assert upstream._major_minor("1.2.3rc1") == (1, 2) and upstream._major_minor("not a version") is None
    assert upstream._line("1.2") == (1, 2) and upstream._line("10.13.3") == (10, 13)
    engine = {v: upstream.engine_backend_in(v) for v in ("1.2.99", "1.3.0", "0.9.0", "main", "x")}
    assert engine == {"1.2.99": True, "1.3.0": False, "0.9.0": True, "main": False, "x": False}
    default = {v: upstream.llm_api_default_in(v) for v in ("0.99.0", "1.0.0", "2.0", "main", "x")}
    assert default == {"0.99.0": False, "1.0.0": True, "2.0": True, "main": True, "x": False}
    serves = {v: upstream.llm_api_serves(v) for v in ("1.1.9", "1.2.0", "1.10.0", "main", "x")}
    assert serves == {"1.1.9": False, "1.2.0": True, "1.10.0": True, "main": True, "x": False}
    by_record = {v: upstream.runtime_by_record(v) for v in ("0.16.0", "1.0.0", "1.3.0rc2", "main", "x")}
    assert by_record == {"0.16.0": "trtllm_engine", "1.0.0": "trtllm_llmapi", "1.3.0rc2": "trtllm_llmapi",
                         "main": "trtllm_llmapi", "x": None}
