"""The export proof's margins, and the accuracy of every format, measured by the real quantize stage.

    python benchmarks/export_proof_bounds.py                        # tiny-qwen3 and SmolLM2-135M, every CPU format
    python benchmarks/export_proof_bounds.py --models tiny-qwen3    # one model
    python benchmarks/export_proof_bounds.py --render               # only re-render docs/benchmarks.md from the JSON

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

The raw results go to ``benchmarks/results/export_proof_bounds.json``; the tables in docs/benchmarks.md are
rendered from that file only. The default model (SmolLM2-135M-Instruct) is shipped as a Q4_1 GGUF: its "unquantized"
baseline is that GGUF dequantized to bf16.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docfile import replace_block  # noqa: E402
from _provenance import commit_label, source_state  # noqa: E402
from rebuild_noop import REPO, machine  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "export_proof_bounds.json"
DOC = REPO / "docs" / "benchmarks.md"
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


def run(models: list[str], formats: list[str], save) -> None:
    """The real fetch and quantize stages, in this process (runner.preflight / runner.run: one import of torch and
    ModelOpt for every run), one fresh output root per model; ``save(row)`` after each run."""
    from pipeline import hardware
    from pipeline.runner import executor as runner
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
    from pipeline import hardware

    e = hardware.compose([f"quant={fmt}", "target=cpu", "runtime=reference"]).quant.eval
    return float(e.export_kl_abs), float(e.export_kl_frac), float(e.export_weight_ratio)


def render(doc: dict) -> None:
    """The tables, from the raw JSON only. The limit and both verdicts are evaluated from the raw K, E and U with
    the bounds the format modules hold now (pipeline/formats/<name>.py; the bounds a run itself used are in the JSON
    too)."""
    rows = doc["rows"]
    bounds = {r["format"]: _bounds(r["format"]) for r in rows}
    stamp = f"{doc['date']} · commit {commit_label(doc)} · {doc['machine']} · raw JSON: `benchmarks/results/export_proof_bounds.json`"
    lines = ["## Export proof margins (`benchmarks/export_proof_bounds.py`)", stamp, "",
             "The quantize stage on CPU, per model and format (FP8 KV cache; 16×128 calibration tokens, held-out rows "
             "of the shipped corpus). K = KL(unquantized ‖ fake-quant); E = KL(fake-quant ‖ deployed export, reloaded "
             "by the reference dequantizer); U = KL(fake-quant ‖ unquantized weights). The proof requires E ≤ limit = "
             "kl_abs + kl_frac × K (per format, `pipeline/formats/<name>.py`; limits and verdicts evaluated from the raw K, E and U "
             "with the bounds those files hold now), so the unquantized weights must score U > limit; "
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
    replace_block("export_proof_bounds", "\n".join(lines))
    acc = [r for r in rows if r["model"] == "smollm2-135m" and "error" not in r]
    if acc:
        lines = ["## Quantization formats on SmolLM2-135M-Instruct: the deployed export vs the unquantized model "
                 "(`benchmarks/export_proof_bounds.py`)", stamp, "",
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
                         f"{d['top1_agreement']:.3f} | {d['ppl_ratio']:.3f} | {r['fake_quant_vs_unquantized']['kl_mean']:.4f} | "
                         f"{r['gate']} | {r['export_check']} | {r['timings_s'].get('calibrate_s', 0):.1f} |")
        replace_block("quant_accuracy", "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--formats", nargs="+", default=[f for f, _, _ in FORMATS], choices=[f for f, _, _ in FORMATS])
    ap.add_argument("--render", action="store_true", help="only re-render docs/benchmarks.md from the JSON")
    args = ap.parse_args()
    if not args.render:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)

        def save(row: dict) -> None:  # after every run, so that a long sweep keeps what it measured
            from filelock import FileLock

            with FileLock(str(Path(tempfile.gettempdir()) / "export_proof_bounds.json.lock")):
                _merge(row)

        def _merge(row: dict) -> None:
            doc = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"rows": []}
            rows = [r for r in doc["rows"] if (r["model"], r["format"]) != (row["model"], row["format"])]
            order = {(m, f): i for i, (m, f) in enumerate((m, f) for m in MODELS for f, _, _ in FORMATS)}
            rows = sorted(rows + [row], key=lambda r: order.get((r["model"], r["format"]), 99))
            doc = {"date": time.strftime("%Y-%m-%d"), **source_state(), "machine": machine(), "rows": rows}
            RESULTS.write_text(json.dumps(doc, indent=2) + "\n")

        run(args.models, args.formats, save)
    render(json.loads(RESULTS.read_text()))
    print(DOC)


if __name__ == "__main__":
    main()
