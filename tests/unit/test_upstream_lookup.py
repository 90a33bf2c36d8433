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
