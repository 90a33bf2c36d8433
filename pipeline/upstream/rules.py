"""TensorRT-LLM's build and load rules (``rules.yaml``) applied to resolved settings, before any work.

:func:`evaluate` takes the plain settings of one configuration (:func:`settings_of` builds them from a composed
config) and returns what upstream would refuse and what it would change by itself. Each rule of ``rules.yaml`` has one
predicate here, under its id; the data file holds what upstream says, the source it was read from and the settings
that fix a refusal. :func:`parameter_problems` checks every rendered ``tensorrt_llm/config.pbtxt`` parameter value
against the C++ backend's parsing and the checks behind it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from pipeline import formats

DATA = Path(__file__).resolve().parent / "rules.yaml"
# QuantAlgo.FP8, W4A8_AWQ, NVFP4: the workflows builder.py gives FP8 context FMHA (each format module's flag)
FP8_CONTEXT_FMHA_QUANTS = tuple(n for n, f in formats.FORMATS.items() if f.fp8_context_fmha)


def refused_formats(rule_id: str) -> tuple[str, ...]:
    """The formats whose module opts into rule ``rule_id`` (``QuantFormat.trtllm_refusals``)."""
    return tuple(n for n, f in formats.FORMATS.items() if rule_id in f.trtllm_refusals)

TRUE_WORDS, FALSE_WORDS = ("True", "true", "TRUE", "1"), ("False", "false", "FALSE", "0")  # GetParameter<bool>


@functools.lru_cache(maxsize=None)
def record() -> dict[str, Any]:
    return yaml.safe_load(DATA.read_text())


@dataclass(frozen=True)
class Finding:
    rule: str
    action: str  # "refuse" | "adjust"
    message: str
    setting: str | None = None  # adjust: the setting whose rendered value changes
    value: Any = None  # adjust: the value rendered instead

    def __str__(self) -> str:
        return self.message


def _engine_line_has_backend(version: str | None) -> bool:
    """Whether TensorRT-LLM ``version`` is a release line with the TensorRT-engine backend, by the recorded versions
    (``runtimes.yaml`` ``tensorrt_engine.last_line``: final releases up to 1.2.x; a 1.3 pre-release or later, or
    ``main``, is not known to have it)."""
    from pipeline import upstream

    if not version:
        return True  # unset: the build's own detection decides
    return upstream.engine_backend_in(str(version))


def _container_pair(s: dict[str, Any]) -> list[str]:
    from pipeline import upstream

    out = upstream.check_pair(s["trtllm_version"], s["container"], "runtime.container")
    out += upstream.check_pair(s["trtllm_version"], s["serve"]["image"], "serve.image")
    return out


def _engine_backend_removed(s: dict[str, Any]) -> list[str]:
    if _engine_line_has_backend(s["trtllm_version"]):
        return []
    from pipeline import upstream

    last = upstream.runtime_support()["tensorrt_engine"]["last_line"]
    return [f"runtime=trtllm_engine: TensorRT-LLM {s['trtllm_version']} has no TensorRT-engine backend (final "
            f"releases up to {last}.x carry it; TensorRT-LLM removed it on main, pipeline/upstream/runtimes.yaml)"]


def _fp8_kv_paged_context_fmha(s: dict[str, Any]) -> list[str]:
    b = s["build"]
    if s["kv_cache"] != "fp8" or not b["use_paged_context_fmha"]:
        return []
    if s["quant"] in FP8_CONTEXT_FMHA_QUANTS and s["sm"] >= 89:
        return []
    why = (f"quant={s['quant']} has no FP8 context FMHA" if s["quant"] not in FP8_CONTEXT_FMHA_QUANTS
           else f"sm{s['sm']} has no FP8 context FMHA (sm89+)")
    return [f"quant.kv_cache=fp8 with build.use_paged_context_fmha=true: {why}, so trtllm-build cannot keep paged "
            f"context FMHA (serve.enable_kv_cache_reuse and serve.enable_chunked_context need it)"]


def _chunked_context(s: dict[str, Any]) -> list[str]:
    if s["serve"]["enable_chunked_context"] and not s["build"]["use_paged_context_fmha"]:
        return ["serve.enable_chunked_context=true needs an engine built with build.use_paged_context_fmha=true "
                "(the executor refuses to load it otherwise)"]
    return []


def _kv_reuse(s: dict[str, Any]) -> list[str]:
    if s["serve"]["enable_kv_cache_reuse"] and not s["build"]["use_paged_context_fmha"]:
        return ["serve.enable_kv_cache_reuse=true without build.use_paged_context_fmha: the executor disables KV-cache "
                "reuse itself; enable_kv_cache_reuse is rendered false"]
    return []


def _fp8_context_fmha(s: dict[str, Any]) -> list[str]:
    if s["build"]["use_fp8_context_fmha"] and s["quant"] not in FP8_CONTEXT_FMHA_QUANTS:
        return [f"build.use_fp8_context_fmha=true with quant={s['quant']}: TensorRT-LLM applies FP8 context FMHA only "
                f"to FP8, W4A8_AWQ and NVFP4; --use_fp8_context_fmha disable is passed"]
    return []


def _fp8_context_fmha_needs_fp8_kv(s: dict[str, Any]) -> list[str]:
    b = s["build"]
    if b["use_fp8_context_fmha"] and b["use_paged_context_fmha"] and s["quant"] in FP8_CONTEXT_FMHA_QUANTS \
            and s["kv_cache"] != "fp8":
        return [f"build.use_fp8_context_fmha=true with quant={s['quant']}, paged context FMHA and "
                f"quant.kv_cache={s['kv_cache']}: trtllm-build keeps FP8 (paged) context FMHA only with an FP8 KV "
                f"cache; --use_fp8_context_fmha disable is passed"]
    return []


def _fp8_kv_enables_fp8_context_fmha(s: dict[str, Any]) -> list[str]:
    b = s["build"]
    if not b["use_fp8_context_fmha"] and b["use_paged_context_fmha"] and s["quant"] in FP8_CONTEXT_FMHA_QUANTS \
            and s["kv_cache"] == "fp8" and s["sm"] >= 89:
        return [f"build.use_fp8_context_fmha=false with quant={s['quant']}, an FP8 KV cache and paged context FMHA: "
                f"trtllm-build turns FP8 context FMHA on itself to support FP8 paged context FMHA; "
                f"--use_fp8_context_fmha enable is passed"]
    return []


def _max_input_len(s: dict[str, Any]) -> list[str]:
    b = s["build"]
    if int(b["max_input_len"]) > int(b["max_seq_len"]):
        return [f"build.max_input_len={b['max_input_len']} exceeds build.max_seq_len={b['max_seq_len']}: trtllm-build "
                f"would clip it"]
    return []


def _no_int_quant_on_sm100(s: dict[str, Any]) -> list[str]:
    if 100 <= s["sm"] < 120 and s["quant"] in refused_formats("no_int_quant_on_sm100"):
        return [f"quant={s['quant']} on sm{s['sm']}: trtllm-build refuses INT8/INT4 quantization and SmoothQuant on "
                f"SM 100-119"]
    return []


def _llmapi_fraction(s: dict[str, Any]) -> list[str]:
    f = float(s["build"]["kv_cache_free_gpu_mem_fraction"])
    if not 0 <= f <= 1:
        return [f"build.kv_cache_free_gpu_mem_fraction={f} is not between 0 and 1 (LLM-API KvCacheConfig)"]
    return []


PREDICATES: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "container_pair": _container_pair,
    "engine_backend_removed": _engine_backend_removed,
    "fp8_kv_paged_context_fmha": _fp8_kv_paged_context_fmha,
    "chunked_context_needs_paged_context_fmha": _chunked_context,
    "kv_reuse_needs_paged_context_fmha": _kv_reuse,
    "fp8_context_fmha_needs_fp8_workflow": _fp8_context_fmha,
    "fp8_context_fmha_needs_fp8_kv": _fp8_context_fmha_needs_fp8_kv,
    "fp8_kv_enables_fp8_context_fmha": _fp8_kv_enables_fp8_context_fmha,
    "max_input_len_le_max_seq_len": _max_input_len,
    "no_int_quant_on_sm100": _no_int_quant_on_sm100,
    "llmapi_free_gpu_memory_fraction": _llmapi_fraction,
}


def _where(src: Any) -> str:
    first = src[0] if isinstance(src, list) else src
    if "path" in first:
        return f"{first['repo']} {first['path']}" + (f" @ {str(first['commit'])[:10]}" if first.get("commit") else "")
    return first.get("page") or first.get("repo", "")


def evaluate(s: dict[str, Any]) -> list[Finding]:
    """Every rule that fires on the settings ``s`` (:func:`settings_of`), refusals first."""
    doc = record()["rules"]
    missing = sorted(set(doc) ^ set(PREDICATES))
    if missing:
        raise RuntimeError(f"rules.yaml and rules.PREDICATES disagree on {', '.join(missing)}")
    out: list[Finding] = []
    for rule_id, rule in doc.items():
        if s["runtime"] not in rule["runtimes"]:
            continue
        for what in PREDICATES[rule_id](s):
            if rule["action"] == "refuse":
                msg = f"{what}; fix: {rule['fix']} (TensorRT-LLM rule {rule_id}, {_where(rule['source'])})"
                out.append(Finding(rule_id, "refuse", msg))
            else:
                out.append(Finding(rule_id, "adjust", f"{what} (TensorRT-LLM rule {rule_id}, "
                                                      f"{_where(rule['source'])})", rule["setting"], rule["value"]))
    return sorted(out, key=lambda f: f.action != "refuse")


def settings_of(cfg, build: dict[str, Any] | None = None) -> dict[str, Any]:
    """The plain settings the rules read, from a composed config; ``build``: the rendered build settings (the
    serving plan's, ``serving_plan.build_settings``), else the config's own."""
    from pipeline.config import to_plain

    return {"runtime": cfg.runtime.name.value, "quant": cfg.quant.format.value, "kv_cache": cfg.quant.kv_cache.value,
            "sm": int(cfg.target.sm), "trtllm_version": cfg.runtime.get("trtllm_version"),
            "container": cfg.runtime.get("container"), "build": build if build is not None else to_plain(cfg.build), "serve": to_plain(cfg.serve)}


def refusals(cfg, build: dict[str, Any] | None = None) -> list[str]:
    return [f.message for f in evaluate(settings_of(cfg, build)) if f.action == "refuse"]


def adjustments(cfg, build: dict[str, Any] | None = None) -> list[Finding]:
    return [f for f in evaluate(settings_of(cfg, build)) if f.action == "adjust"]


# ------------------------------------------------------------------------------------- rendered parameter values
def check_parameter(name: str, value: str) -> str | None:
    """Why the C++ backend would refuse (or silently replace) ``value`` for parameter ``name``; None when it takes it
    as given or no rule is recorded for it."""
    rule = record()["parameters"].get(name)
    if not isinstance(rule, dict) or "type" not in rule:
        return None
    kind, v = rule["type"], str(value)
    if v == "" and rule.get("empty_means_unset"):
        return None
    if kind == "enum":
        return None if v in rule["values"] else f"{name}={v!r}: not one of {', '.join(rule['values'])} ({rule['says']})"
    if kind == "bool":
        return None if v in TRUE_WORDS + FALSE_WORDS else f"{name}={v!r}: GetParameter<bool> cannot convert it"
    try:
        num = int(v) if kind == "int32" else float(v)
    except ValueError:
        return f"{name}={v!r}: does not parse as {'an integer' if kind == 'int32' else 'a float'} (std::sto" \
               f"{'i' if kind == 'int32' else 'f'})"
    if kind == "int32" and not -2**31 <= num < 2**31:
        return f"{name}={v!r}: out of int32 range"
    if "gt" in rule and not num > rule["gt"]:
        return f"{name}={v!r}: must be > {rule['gt']} ({rule['says']})"
    if "lt" in rule and not num < rule["lt"]:
        return f"{name}={v!r}: must be < {rule['lt']} ({rule['says']})"
    return None


def parameter_problems(params: dict[str, str]) -> list[str]:
    """Every rendered ``tensorrt_llm`` parameter (``{key: string_value}``) the backend would not take; a required one
    missing counts too."""
    rules = record()["parameters"]
    out = [f"{k}: required by the tensorrtllm backend and not rendered" for k, r in rules.items()
           if isinstance(r, dict) and r.get("required") and k not in params]
    out += [p for k, v in params.items() if (p := check_parameter(k, v))]
    return out


def rendered_kv_cache_reuse(runtime: str, use_paged_context_fmha: bool, enable_kv_cache_reuse: bool) -> bool:
    """``enable_kv_cache_reuse`` as the package stage renders it: what the executor would run with
    (rule ``kv_reuse_needs_paged_context_fmha``)."""
    return bool(enable_kv_cache_reuse) and (runtime != "trtllm_engine" or bool(use_paged_context_fmha))


def describe() -> str:
    """Every rule and parameter rule with its source, one block each (``python -m pipeline.upstream rules``)."""
    doc = record()
    lines = []
    for rid, r in doc["rules"].items():
        lines.append(f"{rid} [{r['action']}; {', '.join(r['runtimes'])}]")
        lines.append(f"  upstream: {' '.join(str(r['says']).split())}")
        if r.get("fix"):
            lines.append(f"  fix: {' '.join(str(r['fix']).split())}")
        for src in (r["source"] if isinstance(r["source"], list) else [r["source"]]):
            lines.append(f"  source: {', '.join(f'{k}={v}' for k, v in src.items())}")
    for name, r in doc["parameters"].items():
        if name == "source_parse":
            continue
        lines.append(f"parameter {name} [{r['type']}]: {', '.join(f'{k}={r[k]}' for k in ('values', 'gt', 'lt') if k in r)}")
        lines.append(f"  source: {', '.join(f'{k}={v}' for k, v in r['source'].items())}")
    return "\n".join(lines)
