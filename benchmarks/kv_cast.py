"""Calibrated against constant-amax FP8 KV cache (ModelOpt's ``fp8`` and ``fp8_cast`` KV presets) on the real
SmolLM2-135M-Instruct, by the real quantize stage on CPU: the measurement behind ``quant.kv_cache``'s default.

    python -m benchmarks kv_cast [--weights none fp8] [--kv fp8 fp8_cast]

Per weight format × KV preset it runs ``build until=quantize`` (``quant.gate=warn``, target cpu, runtime reference,
16×128 calibration tokens: one fresh output root, so fetch is shared) and reads the stage's ``accuracy.json``:

- deployed: the export reloaded by the reference runtime, with the KV scales TensorRT-LLM's LLM API applies (1.0
  for an FP8 KV cache, ``pipeline/formats/fp8.py`` ``served_kv_scales``), vs the unquantized model: the accuracy
  gate's numbers (KL, top-1 agreement, perplexity ratio on held-out rows);
- fake-quant: ModelOpt's in-memory model vs the unquantized one, evaluated with the served KV scales too (the
  quantize stage's ``kv_as_served``), as the export proof compares it;
- the exported ``k_scale`` / ``v_scale`` range (none for ``fp8_cast``) and the calibration time.

``--weights none`` quantizes the KV cache only, so its rows isolate what the KV preset changes.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._provenance import commit_label

TITLE = "FP8 KV cache: calibrated (fp8) vs constant amax (fp8_cast), SmolLM2-135M-Instruct on CPU"
WEIGHTS = ("none", "fp8")
KVS = ("fp8", "fp8_cast")
MODEL = "smollm2-135m"
CALIB = ["quant.calib.num_samples=16", "quant.calib.seq_len=128", "quant.calib.allow_short=true"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=WEIGHTS)
    parser.add_argument("--kv", nargs="+", default=list(KVS), choices=KVS)


def _stage_dir(root: Path, fmt: str, kv: str) -> Path | None:
    label = f"{MODEL}.{fmt}-kv{kv}-quantize-"
    found = sorted(root.glob(f".store/{label}*/accuracy.json")) + \
        sorted(root.glob(f"reports/failed/{label}*/accuracy.json"))
    return found[-1].parent if found else None


def _kv_scales(stage: Path) -> dict:
    from safetensors import safe_open

    values = []
    for shard in sorted(stage.rglob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            values += [float(f.get_tensor(k).reshape(())) for k in f.keys()
                       if k.endswith(("k_proj.k_scale", "v_proj.v_scale"))]
    if not values:
        return {"count": 0}
    return {"count": len(values), "min": min(values), "max": max(values),
            "above_1": sum(v > 1.0 for v in values)}


def run(args) -> dict:
    from pipeline import hardware
    from pipeline.errors import StageFailed, UserError
    from pipeline.runner import executor as runner
    from pipeline.stages import STAGES

    rows = []
    with tempfile.TemporaryDirectory(prefix="kv-cast-") as tmp:
        root = Path(tmp)
        for fmt in args.weights:
            for kv in args.kv:
                cfg = hardware.compose([f"model={MODEL}", f"quant={fmt}", f"quant.kv_cache={kv}", "quant.gate=warn",
                                        "until=quantize", "target=cpu", "runtime=reference", f"paths.root={root}",
                                        *CALIB])
                t0 = time.perf_counter()
                outcome = "pass"
                try:
                    runner.run(runner.preflight(cfg, STAGES))
                except (StageFailed, UserError) as exc:
                    outcome = f"{type(exc).__name__}: {str(exc)[:500]}"
                wall = time.perf_counter() - t0
                row = {"weights": fmt, "kv_cache": kv, "overrides": CALIB, "outcome": outcome, "wall_s": round(wall, 1)}
                stage = _stage_dir(root, fmt, kv)
                if stage is None:
                    row["error"] = outcome
                else:
                    r = json.loads((stage / "accuracy.json").read_text())
                    a = r["accuracy"]
                    row.update({"quant_algo": r["quant_algo"], "kv_cache_quant_algo": r["kv_cache_quant_algo"],
                                "deployed_vs_unquantized": a["quantized_vs_unquantized"],
                                "fake_quant_vs_unquantized": a["fake_quant_vs_unquantized"], "gate": a["gate"],
                                "export_check": a["export_check"], "kv_scales": _kv_scales(stage),
                                "calibrate_s": r["timings_s"].get("calibrate_s")})
                rows.append(row)
                print(f"{fmt}+kv{kv}: {outcome[:80]} in {wall:.0f}s", file=sys.stderr)
    return {"model": MODEL, "rows": rows}


def render(record: dict) -> list[str]:
    lines = [f"{record['date'][:10]} · commit {commit_label(record)} · {record['machine']}", "",
             "The quantize stage on CPU (SmolLM2-135M-Instruct, its Q4_1 GGUF dequantized to bf16 as the unquantized "
             "model; 16×128 calibration tokens; held-out rows of the shipped corpus). Deployed: the export reloaded "
             "with the KV scales TensorRT-LLM's LLM API applies (1.0 for FP8, whatever was calibrated); fake-quant: "
             "ModelOpt's in-memory model, evaluated with those served KV scales too (the stage's `kv_as_served`). "
             "`weights none` quantizes the KV cache only. Exported KV scales: how many, their range, how many "
             "exceed 1.0 (where an engine's max(k, v, 1) would differ from the LLM API's 1.0).", "",
             "| weights | KV preset | exported KV scales | KL (deployed) | top-1 (deployed) | ppl ratio (deployed) | "
             "KL (fake-quant) | ppl ratio (fake-quant) | gate | calibrate (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        if "error" in r:
            lines.append(f"| {r['weights']} | {r['kv_cache']} | error: {r['error'][:200]} | | | | | | | |")
            continue
        d, f, s = r["deployed_vs_unquantized"], r["fake_quant_vs_unquantized"], r["kv_scales"]
        scales = (f"{s['count']}: {s['min']:.4f}–{s['max']:.4f}, {s['above_1']} > 1" if s["count"] else "none")
        lines.append(f"| {r['weights']} | {r['kv_cache']} | {scales} | {d['kl_mean']:.5f} | "
                     f"{d['top1_agreement']:.3f} | {d['ppl_ratio']:.4f} | {f['kl_mean']:.5f} | {f['ppl_ratio']:.4f} | "
                     f"{r['gate']} | {r['calibrate_s'] or 0:.1f} |")
    return lines
