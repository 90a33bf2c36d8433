"""The quant × KV × SM × runtime compatibility rules against the support matrix, written out independently."""
from __future__ import annotations

import pytest

from pipeline import compat, schema

TARGETS = {"a100": 80, "a10g": 86, "l40s": 89, "h100": 90, "h200": 90, "b200": 100, "gb200": 100,
           "rtx-pro-6000": 120}
# The support matrix (FACTS §2), written out independently of pipeline/compat.py.
SERVES = {
    "fp8": {89, 90, 100, 120}, "nvfp4": {100, 120}, "int4_awq": {80, 86, 89, 90}, "w4a8_awq": {89, 90},
    "int8_sq": {80, 86, 89, 90}, "none": {80, 86, 89, 90, 100, 120},
}
KV_SERVES = {"none": {80, 86, 89, 90, 100, 120}, "fp8": {80, 86, 89, 90, 100, 120}, "nvfp4": {100, 120},
             "fp8_cast": {80, 86, 89, 90, 100, 120}, "nvfp4_cast": {100, 120}}
# ModelOpt's _cast KV presets: ModelOpt 0.47's TRT-LLM checkpoint export records no KV algo for them (engine refused)
KV_NOT_ON = {"fp8_cast": {"trtllm_engine"}, "nvfp4_cast": {"trtllm_engine"}}



@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("quant", list(SERVES))
@pytest.mark.parametrize("kv", list(KV_SERVES))
@pytest.mark.parametrize("runtime", ["trtllm_engine", "trtllm_llmapi"])
def test_compatibility_table(target, quant, kv, runtime):
    sm = TARGETS[target]
    found = compat.problems(quant, kv, target, sm, "cuda", runtime)
    ok_quant = sm in SERVES[quant] and not (runtime == "trtllm_llmapi" and quant == "int8_sq")
    ok_kv = sm in KV_SERVES[kv] and runtime not in KV_NOT_ON.get(kv, ())
    assert (not found) == (ok_quant and ok_kv), found
    for p in found:
        assert "use" in p  # every refusal says what would work


def test_refusal_wording_and_cpu_targets():
    assert compat.problems("nvfp4", "fp8", "h100", 90, "cuda", "trtllm_engine") == [
        "nvfp4 needs Blackwell (sm100/sm120); for h100 use fp8 or int4_awq with quant.kv_cache=none, or target=b200 "
        "to calibrate here for Blackwell"]  # an engine with an FP8 KV cache: int4_awq only with quant.kv_cache=none
    assert "quant.kv_cache=nvfp4 needs Blackwell" in compat.problems("fp8", "nvfp4", "h200", 90, "cuda",
                                                                      "trtllm_llmapi")[0]
    assert "needs a GPU target" in compat.problems("fp8", "fp8", "cpu", 0, "cpu", "trtllm_engine")[0]
    assert compat.problems("nvfp4", "nvfp4", "cpu", 0, "cpu", "reference") == []  # dequantized on CPU


def test_cast_kv_presets_refused_on_engines_with_the_reason():
    found = compat.problems("fp8", "fp8_cast", "h100", 90, "cuda", "trtllm_engine")
    assert found == ["quant.kv_cache=fp8_cast is not accepted by runtime trtllm_engine (ModelOpt 0.47's TRT-LLM "
                     "checkpoint export writes kv_cache_quant_algo null for a constant-amax KV quantizer, so "
                     "trtllm-build would build a 16-bit KV cache); use quant.kv_cache=fp8, or runtime=trtllm_llmapi"]
    # negative control: the calibrated preset the refusal names is accepted there, and the cast one on the LLM API
    assert compat.problems("fp8", "fp8", "h100", 90, "cuda", "trtllm_engine") == []
    assert compat.problems("fp8", "fp8_cast", "h100", 90, "cuda", "trtllm_llmapi") == []


def test_unserved_modelopt_kv_presets_name_their_reason():
    for preset in ("fp8_affine", "nvfp4_affine", "nvfp4_rotate"):
        why = schema.unserved_kv_preset(preset)
        assert why and why.startswith(f"quant.kv_cache={preset} is a ModelOpt KV preset") and "; use " in why
    assert schema.unserved_kv_preset("int8") is None  # not a ModelOpt preset: the schema's own message stands
