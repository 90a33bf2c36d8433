"""ModelOpt's KV presets by name (pipeline/quant/modelopt.py ``quant_config`` / ``kv_preset``) and the fake-quant
model evaluated with the KV scales the deployment applies (``kv_as_served``)."""
from __future__ import annotations

import pytest
import torch

from pipeline.quant import modelopt

pytest.importorskip("modelopt")


def _kv_entry(cfg):
    return [e for e in cfg["quant_cfg"] if e.get("quantizer_name") == "*[kv]_bmm_quantizer"][-1]["cfg"]


def test_kv_presets_are_modelopts_by_name():
    cast, calibrated = modelopt.quant_config("fp8", "fp8_cast"), modelopt.quant_config("fp8", "fp8")
    assert _kv_entry(cast).get("use_constant_amax") is True
    assert not _kv_entry(calibrated).get("use_constant_amax")  # negative control: fp8 calibrates
    assert _kv_entry(modelopt.quant_config("none", "nvfp4_cast"))["num_bits"] == (2, 1)
    assert _kv_entry(modelopt.quant_config("none", "nvfp4_cast")).get("use_constant_amax") is True


def _tiny_calibrated(kv: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=128,
                                         architectures=["Qwen3ForCausalLM"])).eval()
    rows = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    modelopt.calibrate(model, "fp8", kv, None, rows, 4)
    return model


def test_fake_quant_kv_is_evaluated_as_served_and_restored_for_the_export():
    model = _tiny_calibrated("fp8")
    qs = [m.k_bmm_quantizer for m in model.modules() if hasattr(m, "k_bmm_quantizer")]
    calibrated = [float(q._amax) for q in qs]
    assert all(a < 448 for a in calibrated)  # so scale 1.0 differs from what calibration found
    with modelopt.kv_as_served(model, "fp8") as n:
        assert n == 2 * len(qs) and [float(q._amax) for q in qs] == [448.0] * len(qs)  # the LLM API's scale 1.0
    assert [float(q._amax) for q in qs] == calibrated  # the export writes the calibrated scales
    with modelopt.kv_as_served(model, "nvfp4") as n:  # no served rule: nothing changes
        assert n == 0
    cast = _tiny_calibrated("fp8_cast")
    with modelopt.kv_as_served(cast, "fp8_cast") as n:  # constant amax: already the served 448
        assert n == 0
