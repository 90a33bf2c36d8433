"""Which quant × KV format × GPU architecture × runtime combinations can be served, and why not.

From TensorRT-LLM's support matrix (docs/source/reference/support-matrix.md in NVIDIA/TensorRT-LLM, and ModelOpt's
quantization support table). Every refusal names the reason and what would work.
Calibration is not deployment: NVFP4 calibrates on any GPU with SM >= 8.9 (or on CPU here); only serving it needs
Blackwell, and that is what these rules are about.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.formats import FORMATS, KV_FORMATS, PREFERENCE, RUNTIMES


@dataclass(frozen=True)
class Rule:
    sms: tuple[int, ...]
    needs: str  # human phrase for the refusal


# Weight/activation format -> GPU architectures that serve it; KV format likewise (from the format modules).
QUANT_SM: dict[str, Rule] = {n: Rule(f.sms, f.sm_needs) for n, f in FORMATS.items()}
KV_SM: dict[str, Rule] = {n: Rule(k.sms, k.sm_needs) for n, k in KV_FORMATS.items()}
# Runtime -> weight formats and KV formats it loads from a ModelOpt checkpoint.
RUNTIME_QUANT = {r: {n for n, f in FORMATS.items() if r in f.runtimes} for r in RUNTIMES}
RUNTIME_KV = {r: {n for n, k in KV_FORMATS.items() if r in k.runtimes} for r in RUNTIMES}


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
        calibrates = FORMATS[quant].calibrates_from_sm  # e.g. NVFP4: ModelOpt's kernel runs on sm89+, serving needs
        if calibrates is not None and sm >= calibrates:  # Blackwell
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
