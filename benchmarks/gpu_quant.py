"""Quantization on a CUDA GPU: every format on a real architecture, and calibration cost at Qwen3-32B's exact shape.

    python -m benchmarks gpu_quant --out DIR [--parts formats,scale,awq]   # on a GPU machine: the record under DIR
    python -m benchmarks gpu_quant render DIR/gpu_quant-*.json             # here: print its block; copy the file
                                                                           # into benchmarks/results/ to show it

Parts:
- ``formats``: every format × KV combination on a Qwen3-0.6B-shaped model (seeded random weights) through ModelOpt's
  GPU kernels; the export is reloaded by the reference dequantizer and compared with the fake-quant model.
- ``scale``: Qwen3-32B's exact shape (synthetic weights), FP8 + FP8 KV and NVFP4 + FP8 KV, 512 samples × 512 tokens:
  a plain bf16 forward over the same tokens (the floor), calibration, the held-out accuracy forward, export (GB/s),
  peak GPU memory. Uses the quantize stage's calibration forward (``calibration_forward``) and ModelOpt config
  builder, not the whole stage (no checkpoint load, no export reload).
- ``awq``: INT4 AWQ's search at the 32B shape on a few layers, for two sample counts, extrapolated linearly to 64.

Random weights make accuracy numbers meaningless; only the export-vs-fake-quant agreement and the costs are claims.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks._provenance import commit_label

if TYPE_CHECKING:
    import torch

TITLE = "Quantization on a CUDA GPU: every format, and calibration cost at Qwen3-32B's shape"

QWEN3_32B = dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                 rms_norm_eps=1e-6, tie_word_embeddings=False)
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)
COMBOS = [("fp8", "fp8"), ("fp8", "nvfp4"), ("int4_awq", "fp8"), ("int4_awq", "nvfp4"), ("nvfp4", "fp8"),
          ("nvfp4", "nvfp4"), ("w4a8_awq", "fp8"), ("int8_sq", "none"), ("int8_sq", "fp8")]


def synthetic(shape: dict, layers: int | None = None, seed: int = 0):
    import torch

    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(shape)
    if layers:
        kw["num_hidden_layers"] = layers
    cfg = AutoConfig.for_model("qwen3", architectures=["Qwen3ForCausalLM"], initializer_range=0.02, **kw)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def rows(n: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    import torch

    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def timed_forward(model, data: torch.Tensor, bs: int) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(data), bs):
            model(input_ids=data[i:i + bs].cuda(), logits_to_keep=1)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def calibrate(model, fmt: str, kv: str, data: torch.Tensor, bs: int) -> float:
    import torch

    import modelopt.torch.quantization as mtq

    from pipeline.quant.modelopt import calibration_forward, quant_config

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    mtq.quantize(model, quant_config(fmt, kv), lambda m: calibration_forward(m, data, bs))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def part_formats(out: dict) -> None:
    """Every format × KV on the GPU through the quantize stage's own preparation (pipeline.quant.modelopt
    .prepare_reference) and the whole export proof (pipeline.quant.proof) with the format's bounds (its module's,
    through the composed config), plus the proof's built-in control: where the unquantized weights score against the
    same limit."""
    import torch

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    from pipeline import hardware, quality
    from pipeline.quant import proof
    from pipeline.runtime import reference
    from pipeline.quant.modelopt import calibration_forward, prepare_reference, quant_config

    cal, ev = rows(64, 256, QWEN3_06B["vocab_size"], 1), rows(8, 256, QWEN3_06B["vocab_size"], 2)
    res = []
    for fmt, kv in COMBOS:
        model = synthetic(QWEN3_06B)
        base = quality.logits(model, ev, 8)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        mtq.quantize(model, quant_config(fmt, kv), lambda m: calibration_forward(m, cal, 16))
        torch.cuda.synchronize()
        t_cal = time.perf_counter() - t0
        ref, _ = prepare_reference(model, fmt, kv)
        fq = quality.logits(model, ev, 8)
        d = Path(tempfile.mkdtemp(prefix=f"fmt-{fmt}-"))
        export_hf_checkpoint(model, export_dir=str(d))
        del model
        torch.cuda.empty_cache()
        bounds = hardware.compose([f"quant={fmt}"]).quant.eval
        q = json.loads((d / "hf_quant_config.json").read_text())["quantization"]
        structure = proof.check_structure(d, fmt, kv)
        layers = proof.check_layers(d, ref, bounds.export_weight_ratio, "cuda")
        ex = quality.logits(reference.load(d, torch.bfloat16, "cuda"), ev, 8)
        vs_base, vs_fq, vs_unq = quality.compare(base, fq, ev), quality.compare(fq, ex, ev), quality.compare(fq, base, ev)
        numbers = proof.check_numbers(vs_base, vs_fq, bounds.export_kl_abs, bounds.export_kl_frac)
        control = proof.check_numbers(vs_base, vs_unq, bounds.export_kl_abs, bounds.export_kl_frac)
        problems = structure.problems + layers.problems + numbers.problems
        res.append({"format": fmt, "kv": kv, "quant_algo": q.get("quant_algo"),
                    "kv_cache_quant_algo": q.get("kv_cache_quant_algo"), "calibrate_s": round(t_cal, 2),
                    "quant_vs_orig": vs_base, "export_vs_fake_quant": vs_fq, "unquantized_vs_fake_quant": vs_unq,
                    "limit": numbers.details["kl_max"], "unquantized_fails": not control.ok,
                    "worst_layer_ratio": layers.details["worst_ratio"], "problems": problems[:10],
                    "export_check": "pass" if not problems else "fail",
                    "export_bytes": sum(p.stat().st_size for p in d.glob("*.safetensors"))})
        shutil.rmtree(d)
        torch.cuda.empty_cache()
        print(f"formats: {fmt}+{kv} done", flush=True)
    out["formats"] = res


def part_scale(out: dict, formats=(("fp8", "fp8"), ("nvfp4", "fp8")), samples: int = 512, seq: int = 512,
               bs: int = 16) -> None:
    import torch

    from modelopt.torch.export import export_hf_checkpoint

    from pipeline import quality

    cal = rows(samples, seq, QWEN3_32B["vocab_size"], 1)
    ev = rows(8, seq, QWEN3_32B["vocab_size"], 2)
    res = []
    import gc

    for fmt, kv in formats:
        gc.collect()
        torch.cuda.empty_cache()
        resident = torch.cuda.memory_allocated()  # anything a previous part left behind is not this run's
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        model = synthetic(QWEN3_32B)
        torch.cuda.synchronize()
        t_load = time.perf_counter() - t0
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        floor = timed_forward(model, cal, bs)
        base = quality.logits(model, ev, 2)
        torch.cuda.reset_peak_memory_stats()
        t_cal = calibrate(model, fmt, kv, cal, bs)
        peak_cal = torch.cuda.max_memory_allocated() - resident
        t0 = time.perf_counter()
        fq = quality.logits(model, ev, 2)
        t_acc = time.perf_counter() - t0
        acc = quality.compare(base, fq, ev)
        d = Path(tempfile.mkdtemp(prefix="scale-", dir=os.environ.get("EXPORT_DIR")))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        export_hf_checkpoint(model, export_dir=str(d))
        os.sync()
        t_exp = time.perf_counter() - t0
        exp_bytes = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        shutil.rmtree(d)
        res.append({"format": fmt, "kv": kv, "params": sum(p.numel() for p in model.parameters()),
                    "weights_gb": weight_bytes / 1e9, "load_s": t_load, "bf16_forward_s": floor,
                    "calibrate_s": t_cal, "calib_over_floor": t_cal / floor, "accuracy_check_s": t_acc,
                    "export_s": t_exp, "export_gb": exp_bytes / 1e9, "export_gb_per_s": exp_bytes / 1e9 / t_exp,
                    "calib_tokens_per_s": samples * seq / t_cal, "peak_gpu_gb": peak_cal / 1e9,
                    "peak_over_weights": peak_cal / weight_bytes, "tokens": samples * seq,
                    "kl_vs_bf16_synthetic": acc["kl_mean"], "resident_before_gb": resident / 1e9})
        del model, base, fq
        torch.cuda.empty_cache()
        print(f"scale: {fmt}+{kv} done", flush=True)
    out["scale"] = res


def part_awq(out: dict, layers: int = 2, sample_counts=(32, 64), seq: int = 512, bs: int = 16) -> None:
    import torch

    res = []
    for n in sample_counts:
        model = synthetic(QWEN3_32B, layers=layers)
        t = calibrate(model, "int4_awq", "fp8", rows(n, seq, QWEN3_32B["vocab_size"], 1), bs)
        res.append({"layers": layers, "samples": n, "seq_len": seq, "batch_size": bs, "calibrate_s": t,
                    "extrapolated_64_layers_s": t * 64 / layers})
        del model
        torch.cuda.empty_cache()
        print(f"awq: {n} samples done", flush=True)
    out["awq"] = res


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default="formats,scale,awq")
    parser.add_argument("--scale-formats", default="", help="e.g. nvfp4+fp8 (default: fp8+fp8,nvfp4+fp8)")


def run(args) -> dict:
    import torch

    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "modelopt": __import__("modelopt").__version__, "transformers": __import__("transformers").__version__}
    parts = args.parts.split(",")
    for name in parts:
        t0 = time.perf_counter()
        if name == "scale" and args.scale_formats:
            part_scale(out, formats=[tuple(f.split("+")) for f in args.scale_formats.split(",")])
        else:
            {"formats": part_formats, "scale": part_scale, "awq": part_awq}[name](out)
        out[f"{name}_wall_s"] = time.perf_counter() - t0
    return out


def suffix(record: dict) -> str:
    return "-".join(p for p in ("formats", "scale", "awq") if p in record)


def variant(record: dict) -> str:
    return "parts: " + ", ".join(p for p in ("formats", "scale", "awq") if p in record)


def render(record: dict) -> list[str]:
    merged = record
    L = [f"{merged['date'][:10]} · commit {commit_label(merged)} · {merged['gpu']} · torch {merged['torch']}, "
         f"ModelOpt {merged['modelopt']}, transformers {merged['transformers']} · synthetic (seeded random) weights: "
         f"costs and export fidelity are the claims, not accuracy", ""]
    if "formats" in merged:
        L += ["Every format on a Qwen3-0.6B-shaped model through ModelOpt's GPU kernels (64×256 calibration tokens); "
              "the export proof (structure, layers, and KL(fake-quant ‖ export) within the format's limit, which "
              "the unquantized weights must exceed) on held-out rows:", "",
              "| format | KV | quant_algo | kv algo | calibrate (s) | KL fake-quant‖export | limit | KL fake-quant‖"
              "unquantized | worst layer | export check |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in merged["formats"]:
            e = r["export_vs_fake_quant"]
            L.append(f"| {r['format']} | {r['kv']} | {r['quant_algo']} | {r['kv_cache_quant_algo']} | "
                     f"{r['calibrate_s']} | {e['kl_mean']:.5f} | {r['limit']:.5f} | "
                     f"{r['unquantized_vs_fake_quant']['kl_mean']:.5f} | {r['worst_layer_ratio']} | "
                     f"{r['export_check']} |")
        L.append("")
    if "scale" in merged:
        L += ["Qwen3-32B's exact shape, 512 samples × 512 tokens, batch 16, one H200:", "",
              "| format | weights (GB) | init (s) | bf16 forward floor (s) | calibration (s) | × floor | "
              "calib tokens/s | accuracy check (s) | export (s) | export GB/s | peak GPU (GB) | × weights |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in merged["scale"]:
            L.append(f"| {r['format']} + {r['kv']} KV | {r['weights_gb']:.1f} | {r['load_s']:.1f} | "
                     f"{r['bf16_forward_s']:.1f} | {r['calibrate_s']:.1f} | {r['calib_over_floor']:.2f} | "
                     f"{r['calib_tokens_per_s']:.0f} | {r['accuracy_check_s']:.1f} | {r['export_s']:.1f} | "
                     f"{r['export_gb_per_s']:.2f} | {r['peak_gpu_gb']:.1f} | {r['peak_over_weights']:.3f} |")
        L.append("")
    if "awq" in merged:
        L += ["INT4 AWQ (awq_lite) at the 32B shape, measured on a few layers and extrapolated linearly to 64:", "",
              "| layers measured | samples × seq | calibration (s) | extrapolated to 64 layers (s) |", "|---|---|---|---|"]
        for r in merged["awq"]:
            L.append(f"| {r['layers']} | {r['samples']} × {r['seq_len']} | {r['calibrate_s']:.1f} | "
                     f"{r['extrapolated_64_layers_s']:.0f} |")
        L.append("")
    return L[:-1] if L and L[-1] == "" else L
