"""The export proof's margins, and the accuracy of every format, measured by the real quantize stage.

    python -m benchmarks export_proof_bounds                        # tiny-qwen3 and SmolLM2-135M, every CPU format
    python -m benchmarks export_proof_bounds --models tiny-qwen3    # one model
    python -m benchmarks render                                     # only re-render docs/benchmarks.md

For each model × format it runs the real fetch and quantize stages (``build until=quantize``, ``quant.gate=warn``,
in this process through the runner, one fresh output root per model so that fetch is shared) and reads the stage's
``accuracy.json``, from the store when the stage passed and from ``reports/failed/`` when it did not. Per run it records, on the held-out rows:

- K = KL(unquantized ‖ fake-quant): what quantization costs (the proof's yardstick);
- E = KL(fake-quant ‖ deployed export): how far the export, reloaded by the reference dequantizer, is from
  ModelOpt's fake-quant model (must be <= kl_abs + kl_frac × K);
- U = KL(fake-quant ‖ unquantized): where the unquantized weights score against the same limit (must exceed it);
- the worst layer's exported-weight distance, as a fraction of its quantization error (must be <= the format's
  export_weight_ratio; the unquantized weights are at 1.0 by definition);
- the accuracy gate's numbers: the deployed export vs the unquantized model.

A run records the rows it measured; the rows of the models and formats it did not measure are carried over from the
newest earlier record (each marked ``carried_from``), so the current record holds the whole table. The limit and both
verdicts are evaluated from the raw K, E and U with the bounds the format modules hold now
(``pipeline.formats.FORMATS``; the bounds a run itself used are in the record too). The default model (SmolLM2-135M-Instruct) is shipped as a Q4_1 GGUF: its "unquantized"
baseline is that GGUF dequantized to bf16.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._provenance import commit_label

TITLE = "Export proof margins"
# quant_accuracy runs the same measurement on SmolLM2 alone: both read each other's records
RESULT_NAMES = ("export_proof_bounds", "quant_accuracy")
# (format, KV, extra overrides); AWQ at block 64: SmolLM2's hidden size 576 is not a multiple of 128
FORMATS = [("fp8", "fp8", []), ("int8_sq", "fp8", []), ("nvfp4", "fp8", []), ("int4_awq", "fp8", ["quant.block_size=64"]),
           ("w4a8_awq", "fp8", ["quant.block_size=64"]), ("none", "fp8", [])]
MODELS = ("tiny-qwen3", "smollm2-135m")
# small calibration sets, the same for every format, so that the CPU runs stay short: the margins are the claim
CALIB = ["quant.calib.num_samples=16", "quant.calib.seq_len=128", "quant.calib.allow_short=true"]


def _accuracy(root: Path, model: str, fmt: str, kv: str) -> dict | None:
    label = f"{model}.{fmt}-kv{kv}-quantize-"
    found = sorted(root.glob(f".store/{label}*/accuracy.json")) + sorted(root.glob(f"reports/failed/{label}*/accuracy.json"))
    return json.loads(found[-1].read_text()) if found else None


def _row(model: str, fmt: str, kv: str, extra: list[str], r: dict | None, outcome: str, wall: float) -> dict:
    row = {"model": model, "format": fmt, "kv_cache": kv, "overrides": extra + CALIB, "outcome": outcome,
           "wall_s": round(wall, 1)}
    if r is None:
        row["error"] = outcome
        return row
    a, p = r["accuracy"], r["accuracy"]["export_proof"]
    row.update({
        "quant_algo": r["quant_algo"], "kv_cache_quant_algo": r["kv_cache_quant_algo"],
        "bytes_per_param": r["bytes_per_param"], "calibration": r["calibration"],
        "K": a["fake_quant_vs_unquantized"]["kl_mean"], "E": a["exported_vs_fake_quant"]["kl_mean"],
        "U": a["unquantized_vs_fake_quant"]["kl_mean"], "limit": p["numbers"]["kl_max"],
        "kl_abs": p["numbers"]["kl_abs"], "kl_frac": p["numbers"]["kl_frac"],
        "export_passes": p["numbers"]["kl"] <= p["numbers"]["kl_max"],
        "unquantized_fails": p["unquantized_weights"]["fails"],
        "worst_layer_ratio": p["layers"].get("worst_ratio"), "layer_ratio_max": p["layers"].get("max_ratio"),
        "structure": p["structure"], "export_check": a["export_check"], "problems": p["problems"][:10],
        "deployed_vs_unquantized": a["quantized_vs_unquantized"],
        "fake_quant_vs_unquantized": a["fake_quant_vs_unquantized"], "gate": a["gate"],
        "timings_s": r["timings_s"]})
    return row


def measure(models: list[str], formats: list[str], save) -> None:
    """The real fetch and quantize stages, in this process (runner.preflight / runner.run: one import of torch and
    ModelOpt for every run), one fresh output root per model; ``save(row)`` after each run."""
    from pipeline import hardware, runner
    from pipeline.errors import StageFailed, UserError
    from pipeline.stages import STAGES

    for model in models:
        with tempfile.TemporaryDirectory(prefix="proof-bounds-") as tmp:
            root = Path(tmp)
            for fmt, kv, extra in FORMATS:
                if fmt not in formats:
                    continue
                cfg = hardware.compose([f"model={model}", f"quant={fmt}", f"quant.kv_cache={kv}", "quant.gate=warn",
                                      "until=quantize", "target=cpu", "runtime=reference", f"paths.root={root}",
                                      *CALIB, *extra])
                t0 = time.perf_counter()
                outcome = "pass"
                try:
                    runner.run(runner.preflight(cfg, STAGES))
                except (StageFailed, UserError) as exc:
                    outcome = f"{type(exc).__name__}: {str(exc)[:500]}"
                save(_row(model, fmt, kv, extra, _accuracy(root, model, fmt, kv), outcome, time.perf_counter() - t0))
                print(f"{model} {fmt}+kv{kv}: {outcome[:80]} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)


def _bounds(fmt: str) -> tuple[float, float, float]:
    from pipeline.formats import FORMATS

    t = FORMATS[fmt].tolerances
    return float(t.export_kl_abs), float(t.export_kl_frac), float(t.export_weight_ratio)


def stamp(record: dict) -> str:
    return f"{record['date'][:10]} · commit {commit_label(record)} · {record['machine']}"


def render(record: dict) -> list[str]:
    """The margins table, from the record only; limits and verdicts with the bounds the format modules hold now."""
    rows = record["rows"]
    bounds = {r["format"]: _bounds(r["format"]) for r in rows}
    lines = [stamp(record), "",
             "The quantize stage on CPU, per model and format (FP8 KV cache; 16×128 calibration tokens, held-out rows "
             "of the shipped corpus). K = KL(unquantized ‖ fake-quant); E = KL(fake-quant ‖ deployed export, reloaded "
             "by the reference dequantizer); U = KL(fake-quant ‖ unquantized weights). The proof requires E ≤ limit = "
             "kl_abs + kl_frac × K (per format, `pipeline/formats/<name>.py`; limits and verdicts evaluated from the "
             "raw K, E and U with the bounds those files hold now), so the unquantized weights must score U > limit; "
             "each exported layer must lie within `export_weight_ratio` × its quantization error of the fake-quant "
             "weight (the unquantized weights sit at 1.0). SmolLM2-135M-Instruct's baseline is its Q4_1 GGUF, "
             "dequantized to bf16.", "",
             "| model | format | K | E | limit (abs + frac × K) | U | export passes | unquantized fails | worst layer "
             "(max) | export check (as run) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['format']} | error: {r['error']} | | | | | | | |")
            continue
        kl_abs, kl_frac, ratio_max = bounds[r["format"]]
        limit = kl_abs + kl_frac * r["K"]
        lines.append(f"| {r['model']} | {r['format']} | {r['K']:.5f} | {r['E']:.5f} | {limit:.5f} "
                     f"({kl_abs:g} + {kl_frac:g} × K) | {r['U']:.5f} | {'yes' if r['E'] <= limit else 'NO'} | "
                     f"{'yes' if r['U'] > limit else 'NO'} | {r['worst_layer_ratio']} ({ratio_max:g}) | "
                     f"{r['export_check']} |")
    carried = sorted({r["carried_from"] for r in rows if r.get("carried_from")})
    if carried:
        lines += ["", "Rows not measured by this run are carried over from " + ", ".join(f"`{c}`" for c in carried)
                  + "."]
    return lines


def add_arguments(parser: argparse.ArgumentParser, models: tuple[str, ...] = MODELS) -> None:
    parser.add_argument("--models", nargs="+", default=list(models), choices=MODELS)
    parser.add_argument("--formats", nargs="+", default=[f for f, _, _ in FORMATS], choices=[f for f, _, _ in FORMATS])


def run(args) -> dict:
    from benchmarks import _instrument

    rows: list[dict] = []
    measure(args.models, args.formats, rows.append)
    measured = {(r["model"], r["format"]) for r in rows}
    previous = _instrument.records("export_proof_bounds", sys.modules[__name__])
    if previous:
        for r in previous[0].data.get("rows", []):
            if (r["model"], r["format"]) not in measured:
                rows.append({**r, "carried_from": r.get("carried_from") or previous[0].path.name})
    order = {(m, f): i for i, (m, f) in enumerate((m, f) for m in MODELS for f, _, _ in FORMATS)}
    return {"rows": sorted(rows, key=lambda r: order.get((r["model"], r["format"]), 99))}
