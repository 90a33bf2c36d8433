"""The reference runtime's FP8 fake quantization (the format modules' shared kernel, pipeline/formats/_base.py): the
table lookup that widens e4m3 gives exactly PyTorch's own conversion (tests/e2e/test_reference.py checks fake_fp8
against ModelOpt's kernel bit for bit)."""
from __future__ import annotations

import torch

from pipeline.formats import _base as rt


def test_the_e4m3_table_widens_every_code_as_pytorch_does():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    ours, theirs = rt.e4m3_to_float(codes), codes.float()
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())


def test_fake_fp8_keeps_shape_dtype_and_values():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=g) * 4).to(torch.bfloat16)
    scale = torch.tensor(6.0 / 448)
    q = 448 / (scale * 448)  # as ModelOpt computes it (amax = scale * 448), widened by PyTorch itself
    direct = ((x.float() * q).clamp(-448, 448).to(torch.float8_e4m3fn).float() * (1 / q)).to(torch.bfloat16)
    got = rt.fake_fp8(x, scale)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert torch.equal(got, direct)
    assert not torch.equal(got, x)  # negative control: it does quantize
    assert not torch.equal(rt.fake_fp8(x, scale * 2), direct)  # and the scale matters
