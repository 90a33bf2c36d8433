"""The reference runtime's dequantizing loader against ModelOpt's own fake-quant model, on the same calibration.

Tolerance: the export proof's numbers rule with FP8's bounds (conf/quant/fp8.yaml), KL(fq ‖ export) <=
export_kl_abs + export_kl_frac × KL(orig ‖ fq). The fake-quant model is prepared the way the quantize stage prepares
it (ModelOpt's export-time fusion and FP8 weight rounding), so for FP8 the reload reproduces it exactly. Controls show
the comparison fails for a wrong load.
"""
from __future__ import annotations

import json

import pytest
import torch

from pipeline import calib, quality
from pipeline.runtime import reference


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    """tiny-qwen3 from the real fetch code, calibrated FP8 + FP8 KV with ModelOpt, exported."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    from pipeline import hardware
    from pipeline.runner.contract import Context
    from pipeline.quant import modelopt
    from pipeline.stages import fetch

    d = tmp_path_factory.mktemp("ref")
    cfg = hardware.compose(["model=tiny-qwen3"])
    src = d / "src"
    src.mkdir()
    fetch._from_synthetic(Context(cfg=cfg, stage=fetch.STAGE, out=src, final=src, inputs={}, manifests={}, paths={}))
    tok = fetch.train_tokenizer(cfg.model.synthetic.tokenizer_vocab)
    texts = calib.load("builtin")
    cal, ev = calib.pack(tok, texts.calib, 64, 16), calib.pack(tok, texts.heldout, 64, 4)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    base = quality.logits(model, ev)
    mtq.quantize(model, modelopt.quant_config("fp8", "fp8"), lambda m: [m(input_ids=cal[i:i + 4]) for i in
                                                                      range(0, len(cal), 4)])
    modelopt.prepare_reference(model, "fp8", "fp8")
    with modelopt.kv_as_served(model, "fp8"):  # the KV scales the deployment applies, as the quantize stage evaluates
        fq = quality.logits(model, ev)
    out = d / "fp8"
    export_hf_checkpoint(model, export_dir=str(out))
    return {"dir": out, "src": src, "base": base, "fq": fq, "rows": ev}


def _kl_limit(t):
    from pipeline import hardware

    e = hardware.compose(["model=tiny-qwen3", "quant=fp8"]).quant.eval
    return e.export_kl_abs + e.export_kl_frac * quality.compare(t["base"], t["fq"], t["rows"])["kl_mean"]


def test_export_has_fp8_weights_scales_and_kv_scales(tiny_fp8):
    from safetensors import safe_open

    hq = json.loads((tiny_fp8["dir"] / "hf_quant_config.json").read_text())["quantization"]
    assert (hq["quant_algo"], hq["kv_cache_quant_algo"]) == ("FP8", "FP8")
    with safe_open(str(next(tiny_fp8["dir"].glob("*.safetensors"))), "pt") as f:
        keys = set(f.keys())
        w = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        assert w.dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight_scale").dtype == torch.float32
        assert f.get_tensor("model.layers.0.mlp.down_proj.input_scale").dtype == torch.float32
    assert "model.layers.0.self_attn.k_proj.k_scale" in keys and "model.layers.0.self_attn.v_proj.v_scale" in keys


def test_reference_loader_reproduces_modelopt_fake_quant(tiny_fp8):
    model = reference.load(tiny_fp8["dir"], torch.bfloat16)
    assert model.config._attn_implementation == reference.ATTN_IMPL
    ex = quality.logits(model, tiny_fp8["rows"])
    m = quality.compare(tiny_fp8["fq"], ex, tiny_fp8["rows"])
    assert m["kl_mean"] <= _kl_limit(tiny_fp8), m
    assert m["top1_agreement"] == 1.0, m  # FP8: the same network, bit for bit in its weights
    # ... and it is far closer to the fake-quant model than to a model that ignored the scales
    assert m["kl_mean"] < 0.5 * quality.compare(tiny_fp8["fq"], _scales_ignored(tiny_fp8), tiny_fp8["rows"])["kl_mean"]


def _scales_ignored(t):
    """What plain from_pretrained-style loading computes: raw e4m3 codes taken as weights, no scales at all."""
    model = reference.load(t["dir"], torch.bfloat16)
    for mod in model.modules():
        if isinstance(mod, reference.QuantLinear):
            mod.weight.data = mod.weight.data / mod.weight.data.abs().amax() * 448.0
            mod.input_scale = None
    return quality.logits(model, t["rows"])


def test_a_wrong_scale_fails_the_tolerance(tiny_fp8, tmp_path):
    """Control: the comparison can fail. Doubling every weight_scale in the export breaks it."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_fp8["dir"], bad)
    shard = next(bad.glob("*.safetensors"))
    tensors = load_file(str(shard))
    for k in list(tensors):
        if k.endswith("weight_scale"):
            tensors[k] = tensors[k] * 2
    save_file(tensors, str(shard), metadata={"format": "pt"})
    m = quality.compare(tiny_fp8["fq"], quality.logits(reference.load(bad, torch.bfloat16), tiny_fp8["rows"]),
                        tiny_fp8["rows"])
    assert m["kl_mean"] > _kl_limit(tiny_fp8), m


def test_fake_fp8_matches_modelopt_kernel_bit_for_bit():
    from modelopt.torch.quantization.tensor_quant import fp8_eager

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, generator=g) * 3).to(torch.bfloat16)
    amax = torch.tensor(5.25)
    from pipeline.formats import fp8

    ours = fp8.fake_fp8(x, amax / 448.0)
    theirs = fp8_eager(x, amax)
    assert torch.equal(ours, theirs)


def test_unsupported_algo_is_refused(tiny_fp8, tmp_path):
    import shutil

    d = tmp_path / "x"
    shutil.copytree(tiny_fp8["dir"], d)
    q = json.loads((d / "hf_quant_config.json").read_text())
    q["quantization"]["quant_algo"] = "MADE_UP"
    (d / "hf_quant_config.json").write_text(json.dumps(q))
    with pytest.raises(ValueError, match="cannot load quant_algo='MADE_UP'"):
        reference.load(d)


def test_generate_is_greedy_and_stops_at_eos(tiny_fp8):
    model = reference.load(tiny_fp8["dir"], torch.bfloat16)
    a = list(reference.generate(model, [5, 6, 7], 6))
    b = list(reference.generate(model, [5, 6, 7], 6))
    assert a == b and len(a) == 6
    stop = list(reference.generate(model, [5, 6, 7], 6, eos_ids={a[0]}))
    assert stop == a[:1]
