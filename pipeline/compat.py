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


def _as_advice(quant: str, kv: str, sm: int, runtime: str) -> str:
    """``quant`` as advice for this KV cache and runtime: a TensorRT engine with an FP8 KV cache keeps paged context
    FMHA only with FP8 context FMHA (pipeline/upstream/rules.yaml fp8_kv_paged_context_fmha, from TensorRT-LLM's
    builder.py), so a format without it is advised with ``quant.kv_cache=none``, which that rule advises."""
    if runtime == "trtllm_engine" and kv == "fp8" and not (FORMATS[quant].fp8_context_fmha and sm >= 89):
        return f"{quant} with quant.kv_cache=none"
    return quant


def problems(quant: str, kv: str, target: str, sm: int, device: str, runtime: str,
             trtllm_line: str | None = None) -> list[str]:
    """Every reason this combination cannot be served (empty when it can). ``trtllm_line``: the recorded TensorRT-LLM
    line of ``runtime.trtllm_version`` (pipeline.upstream.line_for), for formats only some lines load."""
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
        use = " or ".join(_as_advice(a, kv, sm, runtime) for a in alt[:2]) if alt else "no quantized format"
        hint = ""
        calibrates = FORMATS[quant].calibrates_from_sm  # e.g. NVFP4: ModelOpt's kernel runs on sm89+, serving needs
        if calibrates is not None and sm >= calibrates:  # Blackwell
            hint = ", or target=b200 to calibrate here for Blackwell"
        out.append(f"{quant} needs {QUANT_SM[quant].needs}; for {target} use {use}{hint}")
    elif quant not in RUNTIME_QUANT[runtime]:
        others = [r for r in RUNTIME_QUANT if r != "reference" and quant in RUNTIME_QUANT[r]]
        out.append(f"{quant} is not served by runtime {runtime}; use runtime={others[0] if others else 'reference'}"
                   f"{' or quant=' + alt[0] if alt else ''}")
    lines = FORMATS[quant].trtllm_lines
    if runtime != "reference" and trtllm_line is not None and trtllm_line not in lines:
        out.append(f"{quant} ({FORMATS[quant].quant_algo}) is loaded by TensorRT-LLM {' and '.join(lines)} only, not "
                   f"by the {trtllm_line} line that runtime.trtllm_version names; no final release after 1.2.1 is "
                   f"recorded (docs/formats.md), so use quant=nvfp4 or runtime=reference")
    if sm not in KV_SM[kv].sms:
        out.append(f"quant.kv_cache={kv} needs {KV_SM[kv].needs}; for {target} use quant.kv_cache=fp8")
    elif kv not in RUNTIME_KV[runtime]:
        why = KV_FORMATS[kv].unserved_why
        base = KV_FORMATS[kv].variant_of
        fix = f"quant.kv_cache={base}" if base and runtime in KV_FORMATS[base].runtimes else "quant.kv_cache=fp8"
        others = [r for r in RUNTIMES if r != "reference" and r != runtime and kv in RUNTIME_KV[r]]
        if others:
            fix += f", or runtime={others[0]}"
        out.append(f"quant.kv_cache={kv} is not accepted by runtime {runtime}{f' ({why})' if why else ''}; use {fix}")
    return out

