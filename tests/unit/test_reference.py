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


def test_auto_compute_dtype_is_bfloat16_only_where_it_is_native(monkeypatch):
    """``runtime.dtype=auto``: bfloat16 on a GPU and on a CPU that computes it natively, float32 on other CPUs."""
    import torch

    from pipeline.runtime import reference

    flags = set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags |= set(line.split(":", 1)[1].split())
    except OSError:
        pass
    if flags:  # the kernel's own account of the CPU, beside torch's probes
        assert reference.native_bf16() == bool({"avx512_bf16", "amx_bf16"} & flags)
    assert reference.compute_dtype("float16", "cpu") is torch.float16  # an explicit dtype is taken as it is
    assert reference.compute_dtype("auto", "cuda") is torch.bfloat16
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(reference, "native_bf16", lambda native=native: native)
        assert reference.compute_dtype("auto", "cpu") is want and reference.compute_dtype(None, "cpu") is want
