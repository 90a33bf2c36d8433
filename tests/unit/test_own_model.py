"""A checkpoint of one's own (``model.source=DIR``): its name, shape and parameter count come from the checkpoint
(``config.json``, safetensors headers), the default model's answer checks are dropped, a given shape that
disagrees is refused at compose (so in ``plan``), and plan checks the calibration data is on this machine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import hardware
from pipeline.errors import UserError

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "vocab_size": 300, "tie_word_embeddings": False}


@pytest.fixture()
def ckpt(tmp_path) -> Path:
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "My Model_v2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    (d / "tokenizer.json").write_text("{}")
    save_file({"a": torch.zeros(10, 20), "b": torch.zeros(7)}, str(d / "model.safetensors"))
    return d


def test_name_shape_and_parameters_come_from_the_checkpoint(ckpt):
    cfg = hardware.compose([f"model.source={ckpt}"])
    assert cfg.model.name == "my-model_v2"
    s = cfg.model.shape
    assert (s.num_layers, s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, s.head_dim,
            s.vocab_size, s.tie_word_embeddings) == (3, 64, 96, 4, 2, 16, 300, False)
    assert s.params_b == pytest.approx(207 / 1e9)  # 10 x 20 + 7, from the safetensors header
    assert list(cfg.model.checks) == []  # smollm2's "Paris" check tests other weights


def test_a_given_name_is_kept_and_a_matching_shape_is_accepted(ckpt):
    cfg = hardware.compose([f"model.source={ckpt}", "model.name=mine", "model.shape.num_layers=3"])
    assert cfg.model.name == "mine" and cfg.model.shape.num_layers == 3


def test_a_given_shape_that_disagrees_with_config_json_is_refused(ckpt):
    with pytest.raises(UserError, match=r"model\.shape\.num_layers=30 but .*config\.json says 3"):
        hardware.compose([f"model.source={ckpt}", "model.shape.num_layers=30"])


def test_the_shipped_model_keeps_its_own_settings():
    """Negative control: the default model, from its own source, is not touched."""
    cfg = hardware.compose([])
    assert cfg.model.name == "smollm2-135m" and cfg.model.shape.num_layers == 30 and len(cfg.model.checks) == 1


def test_plan_checks_the_calibration_data_is_here(ckpt, monkeypatch):
    from pipeline.stages import quantize

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = hardware.compose([f"model.source={ckpt}", "quant.calib.dataset=cnn_dailymail"])
    problems = quantize.env_check(cfg)
    assert len(problems) == 1 and problems[0].startswith("quant.calib.dataset=cnn_dailymail comes from the Hub")
    assert "quant.calib.dataset=builtin" in problems[0]
    assert quantize.env_check(hardware.compose([f"model.source={ckpt}", "quant.calib.dataset=builtin"])) == []
