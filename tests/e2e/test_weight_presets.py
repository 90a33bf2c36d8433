"""Each new weight preset's reference dequantizer against ModelOpt's fake quant on one small linear layer (CPU):
ModelOpt 0.47 quantizes the layer with the format's preset, its export functions (``quant_utils``) produce the tensors
the unified export writes, and the format module's ``dequantize`` must give back the fake-quant weight (for
w4a8_nvfp4_fp8, the weight its ``round_as_exported`` stored). Negative
control: the same tensors with the per-tensor or per-block scale doubled do not. The whole-model export proofs are in
tests/e2e/test_export_proof.py (CPU) and tests/gpu/test_gpu.py (CUDA)."""
from __future__ import annotations

import copy

import pytest
import torch

from pipeline.formats import FORMATS

CPU_PRESETS = ["fp8_per_channel_per_token", "mxfp8", "w4a16_nvfp4", "w4a8_nvfp4_fp8"]  # nvfp4_awq: CUDA (tests/gpu)


def _exported(fmt: str):
    """(the layer's fake-quant weight, the export's tensors) for a seeded 64 × 128 linear layer."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export.quant_utils import (get_quantization_format, get_weight_scaling_factor,
                                                   get_weight_scaling_factor_2, to_quantized_weight)

    from pipeline.quant import proof

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 64, bias=False))
    x = torch.randn(16, 128)
    spec = FORMATS[fmt]
    mtq.quantize(model, copy.deepcopy(getattr(mtq, spec.preset)), lambda m: m(x))
    if spec.cpu_fallback:
        spec.cpu_fallback(model)
    layer = model[0]
    if spec.round_as_exported:
        spec.round_as_exported(proof.quantized_linears(model))
    with torch.no_grad():
        # a format that rounds its weights as exported (w4a8_nvfp4_fp8: ModelOpt's fake quant and its export scale
        # the blocks differently) is held to the rounded weight, the network the quantize stage evaluates
        fake = layer.weight.float().clone() if spec.round_as_exported else layer.weight_quantizer(layer.weight).float()
        algo = get_quantization_format(layer)
        if fmt == "mxfp8":
            from modelopt.torch.quantization.qtensor.mxfp8_tensor import MXFP8QTensor

            ws = MXFP8QTensor.get_weights_scaling_factor_from_quantizer(layer.weight, layer.weight_quantizer)
            return fake, {"weight": to_quantized_weight(layer.weight, ws, algo), "weight_scale": ws}
        ws, ws2 = get_weight_scaling_factor(layer), get_weight_scaling_factor_2(layer)
        t = {"weight": to_quantized_weight(layer.weight, ws, algo, ws2, spec.group_size), "weight_scale": ws}
        if ws2 is not None:
            t["weight_scale_2"] = ws2
        return fake, t


@pytest.mark.parametrize("fmt", CPU_PRESETS)
def test_the_dequantizer_reproduces_modelopts_fake_quant_and_a_doubled_scale_does_not(fmt):
    spec = FORMATS[fmt]
    fake, t = _exported(fmt)
    err = (spec.dequantize(t, spec.group_size) - fake).abs().max().item()
    assert err <= 1e-6 * fake.abs().max().item(), (fmt, err)
    bad = dict(t)
    key = "weight_scale_2" if "weight_scale_2" in t else "weight_scale"
    bad[key] = t[key] + 1 if t[key].dtype == torch.uint8 else t[key] * 2  # MXFP8: one more in the E8M0 exponent
    wrong = spec.dequantize(bad, spec.group_size)
    assert torch.allclose(wrong, 2 * fake), fmt  # the control is caught: every value is twice the fake-quant one
