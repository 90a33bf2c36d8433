"""The FP8 KV presets through the pipeline's own quantize stage on CUDA: ``quant.kv_cache=fp8`` (calibrated amax) and
``fp8_cast`` (constant amax, hf_ptq.py's default) on the tiny model, one fetch shared.

What ``benchmarks/kv_cast.py`` measures at real shapes, checked at the tiny one: both presets export
``kv_cache_quant_algo: FP8`` and pass the export proof; only ``fp8`` writes ``k_scale`` / ``v_scale``; and while every
calibrated scale is at most 1.0, the two deploy identically (the LLM API and the reference runtime serve an FP8 KV
cache at scale 1.0, ``pipeline/formats/fp8.py`` ``served_kv_scales``).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (none visible): the FP8 KV presets calibrated on the GPU", allow_module_level=True)


def _quantize(root, kv: str, *extra: str) -> dict:
    from tests.conftest import cli_env

    proc = subprocess.run([sys.executable, "-m", "pipeline", "build", "model=tiny-qwen3", "quant=fp8",
                           f"quant.kv_cache={kv}", "quant.gate=warn", "quant.calib.num_samples=16", "until=quantize",
                           *extra, f"paths.root={root}"], cwd=root, env=cli_env(root), capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (stage,) = root.glob(f".store/*.fp8-kv{kv}-quantize-*")
    acc = json.loads((stage / "accuracy.json").read_text())
    from safetensors import safe_open

    scales = []
    for shard in sorted(stage.rglob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            scales += [float(f.get_tensor(k).reshape(())) for k in f.keys()
                       if k.endswith(("k_proj.k_scale", "v_proj.v_scale"))]
    return {"acc": acc, "scales": scales}


def test_calibrated_and_cast_fp8_kv_deploy_alike_on_cuda(tmp_path):
    calibrated, cast = _quantize(tmp_path, "fp8"), _quantize(tmp_path, "fp8_cast")
    for r in (calibrated, cast):
        assert r["acc"]["device"] == "cuda"
        assert r["acc"]["kv_cache_quant_algo"] == "FP8" and r["acc"]["quant_algo"] == "FP8"
        assert r["acc"]["accuracy"]["export_check"] == "pass"
    assert calibrated["scales"] and not cast["scales"]  # only the calibrated preset exports KV scales
    assert all(0 < s <= 1.0 for s in calibrated["scales"]), calibrated["scales"]
    deployed = [r["acc"]["accuracy"]["quantized_vs_unquantized"] for r in (calibrated, cast)]
    assert deployed[0]["kl_mean"] == pytest.approx(deployed[1]["kl_mean"], rel=1e-3, abs=1e-6)
    assert deployed[0]["top1_agreement"] == pytest.approx(deployed[1]["top1_agreement"], abs=1e-6)
    # the control: FP8 weights moved the deployed model at all (otherwise "alike" would say nothing)
    assert deployed[0]["kl_mean"] > 0
