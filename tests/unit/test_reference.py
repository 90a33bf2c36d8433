"""The reference runtime's FP8 fake quantization (the format modules' shared kernel, pipeline/formats/_base.py): the
table lookup that widens e4m3 gives exactly PyTorch's own conversion (tests/e2e/test_reference.py checks fake_fp8
against ModelOpt's kernel bit for bit)."""
from __future__ import annotations

import pytest
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


def _kv_scales(model):
    return {name: (float(m.kv_k_scale), float(m.kv_v_scale), m.kv_format.name) for name, m in model.named_modules()
            if hasattr(m, "kv_format")}


def test_fp8_kv_scales_are_applied_as_tensorrt_llm_applies_them(tmp_path):
    """The LLM API (and the reference runtime) use 1.0 for an FP8 KV cache whatever was calibrated; an engine
    max(k, v, 1). The exported scales themselves are no deployment's (the negative control)."""
    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.runtime import reference
    from tests.helpers import exports

    e = exports.write(tmp_path / "ckpt", "fp8", "fp8")
    tensors = load_file(str(e.shard))
    exported = {}
    for key in [k for k in tensors if k.endswith(("k_proj.k_scale", "v_proj.v_scale"))]:
        tensors[key] = tensors[key] * 100  # k 2.0 / v 3.0 on layer 0: past the FP8 range, where the paths differ
        exported[key] = float(tensors[key])
    save_file(tensors, str(e.shard), metadata={"format": "pt"})
    attn = "model.layers.0.self_attn"
    k, v = exported[f"{attn}.k_proj.k_scale"], exported[f"{attn}.v_proj.v_scale"]
    assert (k, v) == (pytest.approx(2.0), pytest.approx(3.0))
    served = _kv_scales(reference.load(e.dir, dtype=torch.float32))
    assert served[attn] == (1.0, 1.0, "fp8")
    engine = _kv_scales(reference.load(e.dir, dtype=torch.float32, runtime="trtllm_engine"))
    assert engine[attn] == (pytest.approx(3.0), pytest.approx(3.0), "fp8")
    assert served[attn][:2] != (k, v) and engine[attn][:2] != (k, v)  # neither path applies them as exported


def test_a_cast_kv_export_without_scales_is_quantized_at_scale_one(tmp_path):
    """ModelOpt's fp8_cast exports kv_cache_quant_algo FP8 and no k_scale/v_scale: TensorRT-LLM's 1.0 applies, and
    the export proof accepts the missing scales for it while still refusing them missing for calibrated fp8."""
    import torch

    from pipeline.quant import proof
    from pipeline.runtime import reference
    from tests.helpers import exports

    e = exports.write(tmp_path / "cast", "fp8", "fp8_cast")
    served = _kv_scales(reference.load(e.dir, dtype=torch.float32))
    assert sorted(served) == [f"model.layers.{i}.self_attn" for i in range(exports.CONFIG["num_hidden_layers"])]
    assert set(served.values()) == {(1.0, 1.0, "fp8")}
    assert not [p for p in proof.check_structure(e.dir, "fp8", "fp8_cast").problems if "KV" in p or "_scale" in p]
    planted = proof.check_structure(e.dir, "fp8", "fp8").problems  # the same export, claimed calibrated
    assert any("k_proj.k_scale missing" in p for p in planted), planted
