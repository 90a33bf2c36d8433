"""config.json as TensorRT-LLM 1.2's transformers 4.57 reads it: the legacy RoPE keys (``rope_theta``,
``rope_scaling``) added to a config that transformers 5 saved with ``rope_parameters`` only, without changing what
transformers 5 reads from it. (What 4.57 itself reads is checked in tests/e2e/test_legacy_rope.py, which installs it.)"""
from __future__ import annotations

import json

import pytest

from pipeline import hf_config

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def saved_by_transformers_5(tmp_path, model_type: str, **kw):
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **kw).save_pretrained(tmp_path)
    return tmp_path / "config.json"


@pytest.mark.parametrize("model_type, kw, theta, scaling", [
    ("qwen3", {"rope_theta": 1_000_000.0}, 1_000_000.0, None),
    ("llama", {"rope_theta": 500_000.0, "rope_scaling": dict(LLAMA3)}, 500_000.0, LLAMA3),
])
def test_the_legacy_keys_are_added_and_transformers_5_reads_the_same(tmp_path, model_type, kw, theta, scaling):
    from transformers import AutoConfig

    path = saved_by_transformers_5(tmp_path, model_type, **kw)
    before = json.loads(path.read_text())
    assert "rope_theta" not in before and "rope_scaling" not in before  # what transformers 5 writes
    assert hf_config.write_legacy_rope(path)
    after = json.loads(path.read_text())
    assert after["rope_theta"] == theta and after["rope_scaling"] == scaling
    assert after["rope_parameters"] == before["rope_parameters"]
    # transformers 5 (the project's) reads the same RoPE parameters from the file either way
    assert AutoConfig.from_pretrained(tmp_path).rope_parameters == before["rope_parameters"]
    assert not hf_config.write_legacy_rope(path)  # once added, nothing more to do


def test_a_config_that_has_the_keys_or_no_rope_is_left_as_it_is():
    legacy = {"model_type": "qwen2", "rope_theta": 1e6, "rope_scaling": None}
    assert hf_config.with_legacy_rope(legacy) == legacy
    assert hf_config.with_legacy_rope({"model_type": "gpt2"}) == {"model_type": "gpt2"}
    nested = {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}}
    assert hf_config.with_legacy_rope(nested)["text_config"]["rope_theta"] == 5e5
