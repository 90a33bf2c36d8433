"""Every quantization format on the real SmolLM2-135M-Instruct: the accuracy gate's numbers (the deployed export vs
the unquantized model, which is the shipped Q4_1 GGUF dequantized to bf16).

    python -m benchmarks quant_accuracy [--formats fp8 nvfp4 ...]

The same runs as ``python -m benchmarks export_proof_bounds --models smollm2-135m``: one real quantize stage per
format; the two benchmarks share their records (the export proof's margins are in the same record), and this one
renders the accuracy table from the newest of them that holds SmolLM2 rows.
"""
from __future__ import annotations

import argparse

from benchmarks import export_proof_bounds

TITLE = "Quantization formats on SmolLM2-135M-Instruct: the deployed export vs the unquantized model"
RESULT_NAMES = export_proof_bounds.RESULT_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    export_proof_bounds.add_arguments(parser, models=("smollm2-135m",))


def run(args) -> dict:
    return export_proof_bounds.run(args)


def render(record: dict) -> list[str]:
    acc = [r for r in record["rows"] if r["model"] == "smollm2-135m" and "error" not in r]
    if not acc:
        raise KeyError("no SmolLM2 rows in this record")
    lines = [export_proof_bounds.stamp(record), "",
             "The accuracy gate's numbers: the exported checkpoint reloaded as it is served (reference dequantizer) "
             "vs the unquantized model, on the held-out fifth of the shipped corpus; the fake-quant KL is "
             "ModelOpt's in-memory model, for comparison. The unquantized model is the Q4_1 GGUF dequantized to bf16. "
             "Bytes/param count every tensor of the export (embeddings stay bf16 and are tied: 28M of the 135M "
             "parameters). `none` quantizes the KV cache only. Calibration: 16×128 tokens (a short run, with "
             "`quant.calib.allow_short=true`).", "",
             "| format | quant_algo | bytes/param | KL (deployed) | top-1 (deployed) | perplexity ratio (deployed) | "
             "KL (fake-quant) | gate | export check | calibrate (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in acc:
        d = r["deployed_vs_unquantized"]
        lines.append(f"| {r['format']} | {r['quant_algo'] or '-'} | {r['bytes_per_param']} | {d['kl_mean']:.4f} | "
                     f"{d['top1_agreement']:.3f} | {d['ppl_ratio']:.3f} | "
                     f"{r['fake_quant_vs_unquantized']['kl_mean']:.4f} | {r['gate']} | {r['export_check']} | "
                     f"{r['timings_s'].get('calibrate_s', 0):.1f} |")
    return lines
