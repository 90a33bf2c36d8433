"""quantize: ModelOpt PTQ on calibration text, unified HF checkpoint export, and an accuracy report.

Arch-independent: one output is shared by every target. The only module that imports ``modelopt``.

Output layout::

    checkpoint/            unified HF checkpoint (safetensors + config.json + hf_quant_config.json + tokenizer)
    trtllm_checkpoint/     TRT-LLM checkpoint (config.json + rank{N}.safetensors), for runtime=trtllm_engine only
    accuracy.json          the accuracy gate and the export proof, on held-out text
    quantize.md            the same, readable

The accuracy gate compares what is deployed, the exported checkpoint reloaded as it is served (the reference
runtime's dequantizing loader), with the unquantized model; ModelOpt's fake-quant model is compared too, as a
diagnostic. The export proof (``pipeline.quant.proof``) checks the export's structure, each layer and the reloaded
logits against the fake-quant model; a stage where nothing was quantized fails. The calibrated model is freed
before the proof, which holds one model at a time and reads the export tensor by tensor.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline import calib, store
from pipeline.config import to_plain
from pipeline.errors import StageFailed, UserError
from pipeline.runner import Context, Stage
from pipeline.ui import console, progress, status

# ModelOpt preset per format (FACTS §3); the KV config is merged in with update_quant_cfg_with_kv_cache_quant,
# the way ModelOpt's hf_ptq.py does.
PRESETS = {"fp8": "FP8_DEFAULT_CFG", "int4_awq": "INT4_AWQ_CFG", "nvfp4": "NVFP4_DEFAULT_CFG",
           "w4a8_awq": "W4A8_AWQ_BETA_CFG", "int8_sq": "INT8_SMOOTHQUANT_CFG"}
KV_PRESETS = {"fp8": "FP8_KV_CFG", "nvfp4": "NVFP4_KV_CFG"}
AWQ_FORMATS = ("int4_awq", "w4a8_awq")
AWQ_DEFAULT_BLOCK = 128
TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "*.model", "chat_template.*")
CPU_NVFP4_BACKEND = "pipeline_nvfp4_cpu"


def quant_config(fmt: str, kv: str, block_size: int | None = None) -> dict[str, Any] | None:
    """The ModelOpt config for a format × KV format (× AWQ block size), or None when nothing is quantized."""
    import modelopt.torch.quantization as mtq

    if fmt == "none" and kv == "none":
        return None
    if fmt == "none":
        cfg: dict[str, Any] = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    else:
        cfg = copy.deepcopy(getattr(mtq, PRESETS[fmt]))
    if block_size is not None and fmt in AWQ_FORMATS:
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer":
                sub = entry["cfg"][0] if isinstance(entry["cfg"], list) else entry["cfg"]
                sub["block_sizes"] = {**sub["block_sizes"], -1: block_size}
    if kv != "none":
        cfg = mtq.update_quant_cfg_with_kv_cache_quant(cfg, getattr(mtq, KV_PRESETS[kv])["quant_cfg"])
    return cfg


def linear_in_sizes(shape: dict[str, int]) -> dict[str, int]:
    """Input sizes of a decoder's linear layers, from the model's shape."""
    out = {"hidden size": shape.get("hidden_size", 0), "intermediate size": shape.get("intermediate_size", 0)}
    if shape.get("num_heads") and shape.get("head_dim"):
        out["attention output size"] = shape["num_heads"] * shape["head_dim"]
    return {k: v for k, v in out.items() if v}


def awq_block_problem(fmt: str, block: int | None, shape: dict[str, int], model: str) -> str | None:
    """An AWQ group size must divide every linear input size; name the largest one that does."""
    if fmt not in AWQ_FORMATS:
        return None
    block = block or AWQ_DEFAULT_BLOCK
    sizes = linear_in_sizes(shape)
    bad = {k: v for k, v in sizes.items() if v % block}
    if not bad:
        return None
    import math

    g = math.gcd(*sizes.values())
    works = max((b for b in (128, 64, 32, 16, 8) if g % b == 0 and b <= block), default=None)
    what = ", ".join(f"{k} {v}" for k, v in bad.items())
    fix = f"use quant.block_size={works}" if works else "this model cannot use AWQ group quantization"
    return f"quant.block_size={block} does not divide {model}'s {what}; {fix}"


def _shape_from(cfg: DictConfig) -> dict[str, int]:
    shape = {k: int(v) for k, v in to_plain(cfg.model.shape).items() if k != "params_b" and v}
    if cfg.model.source == "synthetic" and cfg.model.synthetic is not None:
        c = to_plain(cfg.model.synthetic.config)
        shape.update({k: int(c[src]) for k, src in (("hidden_size", "hidden_size"),
                                                      ("intermediate_size", "intermediate_size"),
                                                      ("num_heads", "num_attention_heads"),
                                                      ("head_dim", "head_dim")) if src in c})
    return shape


def memory_estimate(params_b: float) -> dict[str, float]:
    """Peak memory of calibration: bf16 weights plus ~10% (activations, quantizer state; measured 1.04x on
    Qwen3-32B with ModelOpt alone). Weights are loaded in bf16, never as an fp32 copy."""
    weights = params_b * 1e9 * 2 / 1e9
    return {"weights_gb": round(weights, 2), "peak_gb": round(weights * 1.1, 2)}


def fit_problem(cfg: DictConfig) -> str | None:
    """Calibration runs on the target's machines (GPU targets) or on this host (target cpu): will the model fit?"""
    params = float(cfg.model.shape.params_b or 0)
    if params <= 0 or (cfg.quant.format.value == "none" and cfg.quant.kv_cache.value == "none"):
        return None
    need = memory_estimate(params)["peak_gb"]
    t = cfg.target
    if t.device.value == "cuda":
        have = float(t.memory_gb) * max(1, int(t.gpus_per_node)) * 0.92
        if need <= have:
            return None
        where = f"target {t.name} has {t.gpus_per_node}× {t.memory_gb:g} GB"
    else:
        import psutil

        host = psutil.virtual_memory().total / 1e9
        if need <= host * 0.8:
            return None
        where = f"target cpu calibrates on this host, which has {host:.0f} GB of memory and no GPU"
    counts = [(max(1, -(-int(need * 1.05) // size)), size) for size in (141, 80, 48)]
    options = " or ".join(f"{n}× {size} GB GPU{'s' if n > 1 else ''}" for n, size in counts)
    return (f"{cfg.model.name} needs ~{need:.0f} GB to calibrate ({params:g}B params in bf16 + 10%); {where}: "
            f"run quantize on {options}")


def check(cfg: DictConfig) -> list[str]:
    problems = []
    fmt, kv = cfg.quant.format.value, cfg.quant.kv_cache.value
    c = cfg.quant.calib
    dataset = calib.resolve(c.dataset, cfg.model.source)
    try:
        calib.dataset_path(dataset)
        if not (fmt == "none" and kv == "none"):
            p = calib.short_problem(dataset, int(c.num_samples), int(c.seq_len), bool(c.chat_template),
                                    bool(c.allow_short))
            if p:
                problems.append(p)
    except UserError as exc:
        problems.append(str(exc))
    p = awq_block_problem(fmt, cfg.quant.block_size, _shape_from(cfg), cfg.model.name)
    if p:
        problems.append(p)
    if kv == "nvfp4" and fmt in AWQ_FORMATS and cfg.target.device.value != "cuda":
        problems.append(f"quant.kv_cache=nvfp4 with {fmt} calibrates on a CUDA GPU only (ModelOpt's AWQ search "
                        f"runs NVFP4 KV kernels that have no CPU version); use quant.kv_cache=fp8 on target cpu")
    p = fit_problem(cfg)
    if p:
        problems.append(p)
    return problems


def _device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for pattern in TOKENIZER_GLOBS:
        for p in src.glob(pattern):
            if p.is_file() and not (dst / p.name).exists():
                store.link_or_copy(p, dst / p.name)


def run(ctx: Context) -> dict[str, Any]:
    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline import quality
    from pipeline.quant import proof
    from pipeline.runtime import reference

    q = ctx.cfg.quant
    fmt, kv = q.format.value, q.kv_cache.value
    src = ctx.inputs["fetch"]
    ckpt = ctx.out / "checkpoint"
    ckpt.mkdir()
    timings: dict[str, float] = {}

    if fmt == "none" and kv == "none":
        for p in sorted(src.iterdir()):
            if p.is_file() and p.name != store.MANIFEST:
                store.link_or_copy(p, ckpt / p.name)
        known = {f["path"]: f["sha256"] for f in ctx.manifests["fetch"].get("files", [])}
        ctx.known_hashes.update({f"checkpoint/{k}": v for k, v in known.items()})
        result = {"format": fmt, "kv_cache": kv, "quant_algo": None, "kv_cache_quant_algo": None,
                  "note": "unquantized: the fetched checkpoint, unchanged"}
        _write_report(ctx, result)
        return result

    import modelopt
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    device = _device()
    dtype = getattr(torch, ctx.cfg.model.dtype.value)
    dataset = calib.resolve(q.calib.dataset, ctx.cfg.model.source)
    texts = calib.load(dataset, hub_docs=min(8192, 4 * (q.calib.num_samples + q.eval.num_samples)))
    tok = AutoTokenizer.from_pretrained(src)
    cal_rows = calib.pack(tok, texts.calib, q.calib.seq_len, q.calib.num_samples,
                          chat_template=bool(q.calib.chat_template))
    ev_rows = calib.pack(tok, texts.heldout, q.eval.seq_len, q.eval.num_samples)
    if len(cal_rows) < q.calib.num_samples and not q.calib.allow_short:
        raise UserError(f"quant.calib: {texts.name} packs into {len(cal_rows)} of the {q.calib.num_samples} "
                        f"requested rows of {q.calib.seq_len} tokens; give a larger quant.calib.dataset, lower "
                        f"quant.calib.num_samples, or set quant.calib.allow_short=true")
    notes = [f"{what} text {texts.name} holds {len(rows)} of the {want} requested rows of {n} tokens"
             + (" (accepted: quant.calib.allow_short=true)" if what == "calibration" else
                "; give a larger quant.calib.dataset for the full amount")
             for what, rows, want, n in (("calibration", cal_rows, q.calib.num_samples, q.calib.seq_len),
                                         ("held-out", ev_rows, q.eval.num_samples, q.eval.seq_len))
             if len(rows) < want]
    for note in notes:
        console.print(f"[yellow]note:[/] {note}")

    t0 = time.perf_counter()
    with status(f"loading {ctx.cfg.model.name} ({ctx.cfg.model.dtype.value}) on {device}"):
        model = AutoModelForCausalLM.from_pretrained(
            src, dtype=dtype, device_map="auto" if device == "cuda" else None, use_safetensors=True,
            trust_remote_code=bool(ctx.cfg.model.trust_remote_code))
        model.eval()
    timings["load_s"] = time.perf_counter() - t0
    hf = model.config.get_text_config()
    real_shape = {"hidden_size": hf.hidden_size, "intermediate_size": getattr(hf, "intermediate_size", 0),
                  "num_heads": hf.num_attention_heads,
                  "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads}
    problem = awq_block_problem(fmt, q.block_size, real_shape, ctx.cfg.model.name)
    if problem:  # the checkpoint disagrees with model.shape: still refuse before calibrating
        raise UserError(problem)
    bs = _batch_size(q.calib.batch_size, model, q.calib.seq_len, device, len(cal_rows))

    t0 = time.perf_counter()
    n_eval_batches = -(-len(ev_rows) // bs)
    with progress("reference logits (unquantized, held-out)", n_eval_batches) as bar:
        base = quality.logits(model, ev_rows, bs, bar.advance)
    timings["baseline_eval_s"] = time.perf_counter() - t0

    mcfg = quant_config(fmt, kv, q.block_size)
    n_cal_batches = -(-len(cal_rows) // bs)

    def forward_loop(m) -> None:
        with progress(f"calibrating {fmt} + {kv} KV ({len(cal_rows)}×{q.calib.seq_len} tokens)", n_cal_batches) as bar:
            calibration_forward(m, cal_rows, bs, bar.advance)

    t0 = time.perf_counter()
    mtq.quantize(model, mcfg, forward_loop)
    timings["calibrate_s"] = time.perf_counter() - t0
    fallbacks = use_cpu_nvfp4_fallback(model) if device == "cpu" else 0
    t0 = time.perf_counter()
    trt = trtllm_checkpoint_spec(ctx.cfg)
    # Before the HF export, which replaces the model's weights in place, and before the proof's reference is
    # recorded: the legacy export adjusts the quantizers of layers it fuses (q/k/v, gate/up), and the unified
    # export then writes those adjusted scales.
    if trt is not None:
        from modelopt.torch.export import export_tensorrt_llm_checkpoint

        from pipeline.runtime.trtllm import decoder_type

        with status(f"exporting TRT-LLM checkpoint (TP={trt['tp']}, PP={trt['pp']})"):
            export_tensorrt_llm_checkpoint(model, decoder_type(model.config.model_type), dtype,
                                           export_dir=str(ctx.out / "trtllm_checkpoint"),
                                           inference_tensor_parallel=trt["tp"], inference_pipeline_parallel=trt["pp"])
        timings["trtllm_export_s"] = time.perf_counter() - t0
    ref, rounded = prepare_reference(model, fmt, kv)

    t0 = time.perf_counter()
    with progress("fake-quant logits (held-out)", n_eval_batches) as bar:
        fq = quality.logits(model, ev_rows, bs, bar.advance)
    timings["quant_eval_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    with status("exporting unified HF checkpoint"):
        export_hf_checkpoint(model, export_dir=str(ckpt))  # replaces the model's weights with quantized ones
        _copy_tokenizer(src, ckpt)
    timings["export_s"] = time.perf_counter() - t0
    del model  # the proof below holds one model at a time: the calibrated one is freed first
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()

    t0 = time.perf_counter()
    with status("export proof: structure and layers, from the safetensors"):
        structure = proof.check_structure(ckpt, fmt, kv, q.block_size)
        layers = proof.check_layers(ckpt, ref, q.eval.export_weight_ratio, device)
    with status("reloading the export as it is served (reference dequantizer)"):
        exported = reference.load(ckpt, dtype=dtype, device=device)
    with progress("deployed-checkpoint logits (held-out)", n_eval_batches) as bar:
        ex = quality.logits(exported, ev_rows, bs, bar.advance)
    del exported
    gc.collect()
    timings["export_check_s"] = time.perf_counter() - t0

    hf_quant = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    fq_vs_base = quality.compare(base, fq, ev_rows)  # diagnostic: ModelOpt's fake-quant model
    deployed = quality.compare(base, ex, ev_rows)  # the gate: the exported checkpoint as served
    export_vs_fq = quality.compare(fq, ex, ev_rows)
    unquantized_vs_fq = quality.compare(fq, base, ev_rows)  # where the unquantized weights would score
    numbers = proof.check_numbers(fq_vs_base, export_vs_fq, q.eval.export_kl_abs, q.eval.export_kl_frac)
    control = proof.check_numbers(fq_vs_base, unquantized_vs_fq, q.eval.export_kl_abs, q.eval.export_kl_frac)
    problems = structure.problems + layers.problems + numbers.problems
    if control.ok:
        problems.append(f"the numbers check cannot tell this export from the unquantized weights (KL(fake-quant ‖ "
                        f"unquantized) {unquantized_vs_fq['kl_mean']:.5f} is within the limit "
                        f"{control.details['kl_max']:.5f}); lower quant.eval.export_kl_abs / export_kl_frac")
    export_ok = not problems
    th = q.thresholds
    breaches = [f"{name} {value:.4f} {op} {limit}" for name, value, op, limit, bad in (
        ("KL", deployed["kl_mean"], ">", th.kl_max, deployed["kl_mean"] > th.kl_max),
        ("top-1 agreement", deployed["top1_agreement"], "<", th.top1_min, deployed["top1_agreement"] < th.top1_min),
        ("perplexity ratio", deployed["ppl_ratio"], ">", th.ppl_ratio_max, deployed["ppl_ratio"] > th.ppl_ratio_max),
    ) if bad]
    result = {
        "format": fmt,
        "kv_cache": kv,
        "quant_algo": hf_quant.get("quant_algo"),
        "kv_cache_quant_algo": hf_quant.get("kv_cache_quant_algo"),
        "group_size": hf_quant.get("group_size"),
        "exclude_modules": hf_quant.get("exclude_modules"),
        "block_size": q.block_size if fmt in AWQ_FORMATS else None,
        "modelopt_version": modelopt.__version__,
        "device": device,
        "cpu_nvfp4_fallback_quantizers": fallbacks,
        "fp8_layers_rounded_as_exported": rounded,
        "batch_size": bs,
        "bytes_per_param": _bytes_per_param(ckpt),
        "notes": notes,
        "calibration": {"dataset": texts.name, "sha256": texts.sha256, "rows": len(cal_rows),
                        "requested_rows": q.calib.num_samples, "short": len(cal_rows) < q.calib.num_samples,
                        "seq_len": q.calib.seq_len, "tokens": int(cal_rows.numel()),
                        "tokens_per_s": round(cal_rows.numel() / max(timings["calibrate_s"], 1e-9), 1)},
        "heldout": {"rows": len(ev_rows), "seq_len": q.eval.seq_len},
        "accuracy": {"gate_measures": "the exported checkpoint, reloaded as served (reference dequantizer), vs the "
                                      "unquantized model",
                     "quantized_vs_unquantized": deployed, "fake_quant_vs_unquantized": fq_vs_base,
                     "exported_vs_fake_quant": export_vs_fq, "unquantized_vs_fake_quant": unquantized_vs_fq,
                     "export_proof": {"structure": structure.details, "layers": layers.details,
                                      "numbers": numbers.details,
                                      "unquantized_weights": {"kl": unquantized_vs_fq["kl_mean"],
                                                              "fails": not control.ok},
                                      "calibrated_scales": ref.to_json()["scales"],
                                      "problems": problems[:50], "problem_count": len(problems)},
                     "export_check": "pass" if export_ok else "fail",
                     "thresholds": to_plain(th), "gate": "pass" if not breaches else
                     ("warn" if q.gate.value == "warn" else "fail"), "breaches": breaches},
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
    }
    _write_report(ctx, result)
    if not export_ok:
        more = f" (and {len(problems) - 3} more, see accuracy.json)" if len(problems) > 3 else ""
        raise StageFailed("export proof failed: " + "; ".join(problems[:3]) + more)
    if breaches and q.gate.value == "fail":
        raise StageFailed(f"accuracy gate ({fmt}, KV {kv}, deployed export vs unquantized): " + "; ".join(breaches)
                          + " (quant.gate=warn to accept, or raise quant.thresholds.*)")
    return result


def prepare_reference(model, fmt: str, kv: str):
    """After calibration: fail when nothing was quantized; apply the steps ModelOpt's export applies anyway (fusion
    of layers that share an input, and the FP8 weight rounding), so that the fake-quant model is the exported
    network; and record the export proof's reference. Returns (proof.Reference, FP8 layers rounded)."""
    import torch
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    from pipeline.quant import proof

    nothing = nothing_quantized_problem(model, fmt, kv)
    if nothing:
        raise StageFailed(nothing)
    with torch.no_grad():  # idempotent: export_hf_checkpoint runs it again and finds nothing left to do
        requantize_resmooth_fused_llm_layers(model)
    ref = proof.record(model)  # quantization errors from the original weights
    rounded = round_fp8_weights_as_exported(model)
    if rounded:
        proof.resketch(model, ref)
    return ref, rounded


def round_fp8_weights_as_exported(model) -> int:
    """Store each FP8 layer's weight the way ModelOpt's export will (``unified_export_hf._export_quantized_weight``:
    scale = amax / 448, then ``quant_utils.to_quantized_weight``, which divides in the weight's dtype before the e4m3
    cast), dequantized back to the weight's dtype. The fake-quant forward then reproduces those values exactly
    (they lie on its grid), so the fake-quant model evaluated is the exported one. Returns the layers rounded."""
    import torch
    from modelopt.torch.export.model_config import QUANTIZATION_FP8
    from modelopt.torch.export.quant_utils import get_quantization_format, to_quantized_weight

    from pipeline.quant import proof

    n = 0
    for _, mod in proof.quantized_linears(model):
        if get_quantization_format(mod) != QUANTIZATION_FP8:
            continue
        wq = mod.weight_quantizer
        amax = wq._amax.float()  # the export's arithmetic, to the bit
        scale = torch.tensor(amax.item() / wq.maxbound) if amax.dim() == 1 else (amax / wq.maxbound).clone()
        with torch.no_grad():
            codes = to_quantized_weight(mod.weight.data, scale.to(mod.weight.device), QUANTIZATION_FP8)
            mod.weight.data.copy_((codes.float() * scale.to(mod.weight.device)).to(mod.weight.dtype))
        n += 1
    return n


def nothing_quantized_problem(model, fmt: str, kv: str) -> str | None:
    """After calibration: the requested weight (and KV-cache) quantization must be enabled on some layer."""
    from pipeline.quant import proof

    if fmt != "none" and not any(True for _ in proof.quantized_linears(model)):
        return (f"nothing was quantized: every weight quantizer is disabled after calibration ({fmt} requested; "
                f"no linear layer matched ModelOpt's {PRESETS[fmt]} patterns)")
    if kv != "none" and not any(getattr(getattr(m, f"{k}_bmm_quantizer", None), "is_enabled", False)
                                for m in model.modules() for k in ("k", "v")):
        return (f"nothing was quantized in the KV cache: no k/v quantizer is enabled after calibration "
                f"(quant.kv_cache={kv} requested; ModelOpt found no attention layer it supports)")
    return None


def calibration_forward(model, rows, batch_size: int, on_batch=None) -> None:
    """Run the calibration rows through ``model`` (ModelOpt's quantizers observe every layer). Only the last
    position's logits are computed: calibration needs the activations, not a [batch, seq, vocab] logits tensor."""
    import torch

    dev = next(model.parameters()).device
    with torch.inference_mode():
        for i in range(0, len(rows), batch_size):
            model(input_ids=rows[i:i + batch_size].to(dev), logits_to_keep=1)
            if on_batch:
                on_batch()


def _batch_size(setting: str, model, seq_len: int, device: str, rows: int) -> int:
    """``auto``: on GPU, ModelOpt's probe of the largest batch that fits; on CPU, 8. Never more than the rows."""
    if str(setting) != "auto":
        return max(1, min(int(setting), rows))
    if device == "cuda":
        from modelopt.torch.utils.dataset_utils import get_max_batch_size

        return max(1, min(get_max_batch_size(model, max_sample_length=seq_len), rows, 512))
    return max(1, min(8, rows))


def use_cpu_nvfp4_fallback(model) -> int:
    """Route ModelOpt's NVFP4 fake-quant (CUDA/Triton only) through the pure-torch ``fake_nvfp4`` on CPU.

    Uses ModelOpt's public quant-backend hook. Returns how many quantizers were switched.
    """
    from modelopt.torch.quantization.nn import TensorQuantizer
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import (is_registered_quant_backend,
                                                                          register_quant_backend)

    from pipeline.runtime.reference import fake_nvfp4

    def entry(inputs, quantizer):
        amax = quantizer.amax if quantizer.amax is not None else inputs.abs().amax()
        return fake_nvfp4(inputs, amax.float().amax(), quantizer.block_sizes.get(-1) or 16)

    if not is_registered_quant_backend(CPU_NVFP4_BACKEND):
        register_quant_backend(CPU_NVFP4_BACKEND, entry)
    n = 0
    for mod in model.modules():
        if isinstance(mod, TensorQuantizer) and mod.is_enabled and mod.block_sizes \
                and mod.block_sizes.get("type") == "dynamic" and tuple(mod.num_bits) == (2, 1):
            mod.backend = CPU_NVFP4_BACKEND
            n += 1
    return n


def _bytes_per_param(ckpt: Path) -> float | None:
    """Weight bytes per parameter of the exported checkpoint (packed 4-bit counts two params per byte)."""
    from safetensors import safe_open

    total_bytes = params = 0
    for shard in ckpt.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                t = f.get_slice(k)
                n = 1
                for d in t.get_shape():
                    n *= d
                size = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1, "I8": 1}.get(t.get_dtype(), 4)
                total_bytes += n * size
                if k.endswith(".weight") or k.endswith(".bias"):
                    params += n * (2 if t.get_dtype() == "U8" else 1)
    return round(total_bytes / params, 4) if params else None


def _write_report(ctx: Context, r: dict[str, Any]) -> None:
    (ctx.out / "accuracy.json").write_text(json.dumps(r, indent=2) + "\n")
    lines = [f"# quantize: {ctx.cfg.model.name} {r['format']} (KV {r['kv_cache']})", ""]
    lines += [f"- quant_algo: `{r.get('quant_algo')}`, kv_cache_quant_algo: `{r.get('kv_cache_quant_algo')}`",
              f"- exclude_modules: `{r.get('exclude_modules')}`"]
    if "calibration" in r:
        c = r["calibration"]
        lines += [f"- calibration: {c['rows']}×{c['seq_len']} tokens of `{c['dataset']}` (sha256 {c['sha256'][:12]}), "
                  f"{c['tokens_per_s']} tokens/s on {r['device']}", ""]
        a = r["accuracy"]
        lines += ["| comparison (held-out) | mean KL | top-1 agreement | perplexity ratio |", "|---|---|---|---|"]
        for name, m in (("**deployed export vs unquantized** (the gate)", a["quantized_vs_unquantized"]),
                        ("fake-quant vs unquantized (diagnostic)", a["fake_quant_vs_unquantized"]),
                        ("deployed export vs fake-quant (export proof)", a["exported_vs_fake_quant"]),
                        ("unquantized vs fake-quant (what the proof must reject)", a["unquantized_vs_fake_quant"])):
            lines.append(f"| {name} | {m['kl_mean']:.5f} | {m['top1_agreement']:.4f} | {m['ppl_ratio']:.4f} |")
        lines += ["", f"Accuracy gate: **{a['gate']}** (thresholds: KL ≤ {a['thresholds']['kl_max']}, top-1 ≥ "
                      f"{a['thresholds']['top1_min']}, perplexity ratio ≤ {a['thresholds']['ppl_ratio_max']})"
                  + (": " + "; ".join(a["breaches"]) if a["breaches"] else ""),
                  f"Size: {r.get('bytes_per_param')} bytes per parameter (weights and scales of the export)."]
        p = a["export_proof"]
        n, st, ly = p["numbers"], p["structure"], p["layers"]
        lines += ["", f"Export proof: **{a['export_check']}**",
                  f"- structure: {st.get('quantized_linears')} quantized linears, {st.get('excluded_linears')} "
                  f"excluded, {st.get('kv_scales')} KV scales, {st.get('fraction_of_bf16')}× bf16 bytes per parameter",
                  f"- layers: worst exported weight {ly.get('worst_ratio')}× its quantization error from the "
                  f"fake-quant weight (max {ly.get('max_ratio')}); {ly.get('activation_scales')} activation and "
                  f"{ly.get('kv_scales')} KV scales as calibrated",
                  f"- numbers: KL(fake-quant ‖ export) {n['kl']:.5f} ≤ {n['kl_max']:.5f} = {n['kl_abs']} + "
                  f"{n['kl_frac']} × {n['kl_quantization']:.5f}; the unquantized weights score "
                  f"{p['unquantized_weights']['kl']:.5f} ({'rejected' if p['unquantized_weights']['fails'] else 'NOT rejected'})"]
        lines += [f"- problem: {x}" for x in p["problems"][:20]]
        lines += ["", "Timings (s): " + ", ".join(f"{k} {v}" for k, v in r["timings_s"].items())]
    else:
        lines += ["", r.get("note", "")]
    (ctx.out / "quantize.md").write_text("\n".join(lines) + "\n")




def trtllm_checkpoint_spec(cfg: DictConfig) -> dict[str, int] | None:
    """The TP/PP mapping of the TRT-LLM checkpoint, exported only for the engine runtime."""
    if cfg.runtime.name.value != "trtllm_engine":
        return None
    from pipeline import planning

    return {"tp": planning.effective_tp(cfg), "pp": int(cfg.build.pp_size)}


def extra(cfg: DictConfig, store_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"calib_sha256": calib.dataset_digest(calib.resolve(cfg.quant.calib.dataset,
                                                                               cfg.model.source))}
    trt = trtllm_checkpoint_spec(cfg)
    if trt:  # only the engine runtime's quantize output differs per mapping; the rest share one
        out["trtllm_checkpoint"] = trt
    return out


STAGE = Stage(
    volatile=("accuracy.json", "quantize.md"),
    name="quantize",
    run=run,
    reads=("model.dtype", "model.trust_remote_code", "quant"),
    inputs=("fetch",),
    libs=("nvidia-modelopt", "torch", "transformers", "safetensors"),
    code=("pipeline.calib", "pipeline.quality", "pipeline.quant.proof", "pipeline.runtime.reference",
          "pipeline.runtime.trtllm"),
    root="store",
    label=lambda cfg: f"{cfg.model.name}.{cfg.quant.format.value}-kv{cfg.quant.kv_cache.value}",
    check=check,
    extra=extra,
)
