"""quantize: ModelOpt PTQ on calibration text, unified HF checkpoint export, and an accuracy report.

Arch-independent: one output is shared by every target. The only module that imports ``modelopt``.

Output layout::

    checkpoint/            unified HF checkpoint (safetensors + config.json + hf_quant_config.json + tokenizer)
    accuracy.json          quantized vs unquantized, and exported vs fake-quant, on held-out text
    quantize.md            the same, readable
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline import calib, store
from pipeline.errors import StageFailed, UserError
from pipeline.runner import Context, Stage
from pipeline.ui import progress, status

# ModelOpt preset per format (FACTS §3); the KV config is merged in with update_quant_cfg_with_kv_cache_quant,
# the way ModelOpt's hf_ptq.py does.
PRESETS = {"fp8": "FP8_DEFAULT_CFG"}
KV_PRESETS = {"fp8": "FP8_KV_CFG"}
TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "*.model", "chat_template.*")


def quant_config(fmt: str, kv: str) -> dict[str, Any] | None:
    """The ModelOpt config for a format × KV format, or None when nothing is quantized."""
    import modelopt.torch.quantization as mtq

    if fmt == "none" and kv == "none":
        return None
    if fmt == "none":
        cfg: dict[str, Any] = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    else:
        cfg = copy.deepcopy(getattr(mtq, PRESETS[fmt]))
    if kv != "none":
        cfg = mtq.update_quant_cfg_with_kv_cache_quant(cfg, getattr(mtq, KV_PRESETS[kv])["quant_cfg"])
    return cfg


def _device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for pattern in TOKENIZER_GLOBS:
        for p in src.glob(pattern):
            if p.is_file() and not (dst / p.name).exists():
                store.link_or_copy(p, dst / p.name)


def run(ctx: Context) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline import quality
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
    texts = calib.load(q.calib.dataset)
    t0 = time.perf_counter()
    with status(f"loading {ctx.cfg.model.name} ({ctx.cfg.model.dtype.value}) on {device}"):
        tok = AutoTokenizer.from_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(
            src, dtype=dtype, device_map="auto" if device == "cuda" else None,
            trust_remote_code=bool(ctx.cfg.model.trust_remote_code))
        model.eval()
    timings["load_s"] = time.perf_counter() - t0

    cal_rows = calib.pack(tok, texts.calib, q.calib.seq_len, q.calib.num_samples)
    ev_rows = calib.pack(tok, texts.heldout, q.eval.seq_len, q.eval.num_samples)
    bs = q.calib.batch_size

    t0 = time.perf_counter()
    n_eval_batches = -(-len(ev_rows) // bs)
    with progress("reference logits (unquantized, held-out)", n_eval_batches) as bar:
        base = quality.logits(model, ev_rows, bs, bar.advance)
    timings["baseline_eval_s"] = time.perf_counter() - t0

    mcfg = quant_config(fmt, kv)
    n_cal_batches = -(-len(cal_rows) // bs)

    def forward_loop(m) -> None:
        with progress(f"calibrating {fmt} + {kv} KV ({len(cal_rows)}×{q.calib.seq_len} tokens)", n_cal_batches) as bar:
            dev = next(m.parameters()).device
            with torch.inference_mode():
                for i in range(0, len(cal_rows), bs):
                    m(input_ids=cal_rows[i:i + bs].to(dev))
                    bar.advance()

    t0 = time.perf_counter()
    mtq.quantize(model, mcfg, forward_loop)
    timings["calibrate_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    with progress("fake-quant logits (held-out)", n_eval_batches) as bar:
        fq = quality.logits(model, ev_rows, bs, bar.advance)
    timings["quant_eval_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    with status("exporting unified HF checkpoint"):
        export_hf_checkpoint(model, export_dir=str(ckpt))  # replaces the model's weights with quantized ones
        _copy_tokenizer(src, ckpt)
    timings["export_s"] = time.perf_counter() - t0
    del model

    t0 = time.perf_counter()
    with status("reloading the export through the reference dequantizer"):
        exported = reference.load(ckpt, dtype=dtype, device=device)
    with progress("exported-checkpoint logits (held-out)", n_eval_batches) as bar:
        ex = quality.logits(exported, ev_rows, bs, bar.advance)
    timings["export_check_s"] = time.perf_counter() - t0

    hf_quant = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    vs_base = quality.compare(base, fq, ev_rows)
    export_vs_fq = quality.compare(fq, ex, ev_rows)
    kl_max = q.eval.export_kl_ratio * vs_base["kl_mean"] + q.eval.export_kl_abs
    top1_min = vs_base["top1_agreement"] - q.eval.export_top1_margin
    export_ok = export_vs_fq["kl_mean"] <= kl_max and export_vs_fq["top1_agreement"] >= top1_min
    result = {
        "format": fmt,
        "kv_cache": kv,
        "quant_algo": hf_quant.get("quant_algo"),
        "kv_cache_quant_algo": hf_quant.get("kv_cache_quant_algo"),
        "group_size": hf_quant.get("group_size"),
        "exclude_modules": hf_quant.get("exclude_modules"),
        "modelopt_version": modelopt.__version__,
        "device": device,
        "calibration": {"dataset": texts.name, "sha256": texts.sha256, "rows": len(cal_rows),
                        "seq_len": q.calib.seq_len, "tokens": int(cal_rows.numel()),
                        "tokens_per_s": round(cal_rows.numel() / max(timings["calibrate_s"], 1e-9), 1)},
        "heldout": {"rows": len(ev_rows), "seq_len": q.eval.seq_len},
        "accuracy": {"quantized_vs_unquantized": vs_base, "exported_vs_fake_quant": export_vs_fq,
                     "export_tolerance": {"kl_max": kl_max, "top1_min": top1_min},
                     "export_check": "pass" if export_ok else "fail"},
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
    }
    _write_report(ctx, result)
    if not export_ok:
        raise StageFailed(
            f"exported checkpoint does not reproduce the calibrated model: KL {export_vs_fq['kl_mean']:.4f} "
            f"(max {kl_max:.4f}), top-1 {export_vs_fq['top1_agreement']:.3f} (min {top1_min:.3f})")
    return result


def _write_report(ctx: Context, r: dict[str, Any]) -> None:
    (ctx.out / "accuracy.json").write_text(json.dumps(r, indent=2) + "\n")
    lines = [f"# quantize: {ctx.cfg.model.name} {r['format']} (KV {r['kv_cache']})", ""]
    lines += [f"- quant_algo: `{r.get('quant_algo')}`, kv_cache_quant_algo: `{r.get('kv_cache_quant_algo')}`",
              f"- exclude_modules: `{r.get('exclude_modules')}`"]
    if "calibration" in r:
        c = r["calibration"]
        lines += [f"- calibration: {c['rows']}×{c['seq_len']} tokens of `{c['dataset']}` (sha256 {c['sha256'][:12]}), "
                  f"{c['tokens_per_s']} tokens/s on {r['device']}", ""]
        lines += ["| comparison (held-out) | mean KL | top-1 agreement | perplexity ratio |", "|---|---|---|---|"]
        for name, m in (("quantized vs unquantized", r["accuracy"]["quantized_vs_unquantized"]),
                        ("exported vs fake-quant", r["accuracy"]["exported_vs_fake_quant"])):
            lines.append(f"| {name} | {m['kl_mean']:.5f} | {m['top1_agreement']:.4f} | {m['ppl_ratio']:.4f} |")
        t = r["accuracy"]["export_tolerance"]
        lines += ["", f"Export check: **{r['accuracy']['export_check']}** (tolerance: KL ≤ {t['kl_max']:.4f}, "
                      f"top-1 ≥ {t['top1_min']:.3f}; see quant.eval in the config)", "", "Timings (s): " +
                  ", ".join(f"{k} {v}" for k, v in r["timings_s"].items())]
    else:
        lines += ["", r.get("note", "")]
    (ctx.out / "quantize.md").write_text("\n".join(lines) + "\n")


def check(cfg: DictConfig) -> list[str]:
    try:
        calib.dataset_path(cfg.quant.calib.dataset)
    except UserError as exc:
        return [str(exc)]
    return []


def extra(cfg: DictConfig, store_dir: Path) -> dict[str, Any]:
    return {"calib_sha256": calib.dataset_digest(cfg.quant.calib.dataset)}


STAGE = Stage(
    volatile=("accuracy.json", "quantize.md"),
    name="quantize",
    run=run,
    reads=("model.dtype", "model.trust_remote_code", "quant"),
    inputs=("fetch",),
    libs=("nvidia-modelopt", "torch", "transformers", "safetensors"),
    code=("pipeline.calib", "pipeline.quality", "pipeline.runtime.reference"),
    root="store",
    label=lambda cfg: f"{cfg.model.name}.{cfg.quant.format.value}-kv{cfg.quant.kv_cache.value}",
    check=check,
    extra=extra,
)
