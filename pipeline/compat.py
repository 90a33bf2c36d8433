"""Which quant × KV format × GPU architecture × runtime combinations can be served, and why not.

From TensorRT-LLM's support matrix (docs/source/reference/support-matrix.md in NVIDIA/TensorRT-LLM, and ModelOpt's
quantization support table). Every refusal names the reason and what would work.
Calibration is not deployment: NVFP4 calibrates on any GPU with SM >= 8.9 (or on CPU here); only serving it needs
Blackwell, and that is what these rules are about.
"""
from __future__ import annotations

from dataclasses import dataclass

BLACKWELL = (100, 103, 120)


@dataclass(frozen=True)
class Rule:
    sms: tuple[int, ...]
    needs: str  # human phrase for the refusal


ALL_GPUS = (80, 86, 89, 90, 100, 103, 120)
# Weight/activation format -> GPU architectures that serve it.
QUANT_SM: dict[str, Rule] = {
    "none": Rule(ALL_GPUS, "an Ampere or newer GPU (sm80+)"),
    "fp8": Rule((89, 90, 100, 103, 120), "Ada, Hopper or Blackwell (sm89+)"),
    "int4_awq": Rule((80, 86, 89, 90), "Ampere, Ada or Hopper (sm80-sm90; not in the support matrix for Blackwell)"),
    "w4a8_awq": Rule((89, 90), "Ada or Hopper (sm89/sm90)"),
    "nvfp4": Rule(BLACKWELL, "Blackwell (sm100/sm120)"),
    "int8_sq": Rule((80, 86, 89, 90), "Ampere, Ada or Hopper (sm80-sm90)"),
}
KV_SM: dict[str, Rule] = {
    "none": Rule(ALL_GPUS, "any supported GPU"),
    "fp8": Rule(ALL_GPUS, "an Ampere or newer GPU (sm80+)"),
    "nvfp4": Rule(BLACKWELL, "Blackwell (sm100/sm120)"),
}
# Runtime -> weight formats and KV formats it loads from a ModelOpt checkpoint.
RUNTIME_QUANT = {
    "reference": set(QUANT_SM),
    "trtllm_engine": set(QUANT_SM),
    "trtllm_llmapi": {"none", "fp8", "int4_awq", "w4a8_awq", "nvfp4"},
}
RUNTIME_KV = {
    "reference": set(KV_SM),
    "trtllm_engine": {"none", "fp8", "nvfp4"},  # a pre-quantized checkpoint may carry only FP8 or NVFP4 KV
    "trtllm_llmapi": {"none", "fp8", "nvfp4"},
}
PREFERENCE = ("fp8", "int4_awq", "nvfp4", "w4a8_awq", "int8_sq")


def alternatives(sm: int, runtime: str) -> list[str]:
    return [q for q in PREFERENCE if sm in QUANT_SM[q].sms and q in RUNTIME_QUANT[runtime]]


def problems(quant: str, kv: str, target: str, sm: int, device: str, runtime: str) -> list[str]:
    """Every reason this combination cannot be served (empty when it can)."""
    out: list[str] = []
    if runtime != "reference" and device != "cuda":
        out.append(f"runtime {runtime} needs a GPU target; target {target} has none (use runtime=reference, or a GPU "
                   f"target such as h100)")
        return out
    if device != "cuda":
        return out  # the reference runtime on CPU dequantizes: any format runs there
    # On a GPU target the rules hold for every runtime: the target is the GPU the artifacts are meant for.
    alt = alternatives(sm, runtime)
    if sm not in QUANT_SM[quant].sms:
        use = " or ".join(alt[:2]) if alt else "no quantized format"
        hint = ""
        if quant == "nvfp4" and sm >= 89:  # NVFP4 calibrates on sm89+ (ModelOpt's kernel); only serving needs Blackwell
            hint = ", or target=b200 to calibrate here for Blackwell"
        out.append(f"{quant} needs {QUANT_SM[quant].needs}; for {target} use {use}{hint}")
    elif quant not in RUNTIME_QUANT[runtime]:
        others = [r for r in RUNTIME_QUANT if r != "reference" and quant in RUNTIME_QUANT[r]]
        out.append(f"{quant} is not served by runtime {runtime}; use runtime={others[0] if others else 'reference'}"
                   f"{' or quant=' + alt[0] if alt else ''}")
    if sm not in KV_SM[kv].sms:
        out.append(f"quant.kv_cache={kv} needs {KV_SM[kv].needs}; for {target} use quant.kv_cache=fp8")
    elif kv not in RUNTIME_KV[runtime]:
        out.append(f"quant.kv_cache={kv} is not accepted by runtime {runtime}; use quant.kv_cache=fp8")
    return out
