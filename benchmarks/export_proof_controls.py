"""The export proof's per-layer bound against slightly wrong exports: how far each planted fault scores, next to
the shipped bound and to what real exports score.

    python -m benchmarks export_proof_controls

On the synthetic FP8, INT8-SmoothQuant and INT4-AWQ exports of ``tests/helpers/exports.py`` (the ones the fast tier's controls use,
``tests/unit/test_export_proof.py``) it plants each fault and records the layer check's worst ratio
(‖export − fake-quant‖ / ‖original − fake-quant‖, through the proof's sketch): one layer's weight scale off by
1%, 2%, 10% and −10%, one layer left unquantized. The pass side comes from the real ModelOpt exports recorded by
``python -m benchmarks export_proof_bounds`` (its newest record: the worst layer of each untouched export).
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks._provenance import commit_label

TITLE = "The export proof's layer bound against slightly wrong exports"
LAYER = "model.layers.0.mlp.down_proj"
FORMATS = ("fp8", "int8_sq", "int4_awq")
SCALES = (1.01, 1.02, 1.1, 0.9)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options of its own."""


def measure() -> dict:
    from benchmarks import _instrument, export_proof_bounds
    from pipeline import hardware
    from pipeline.quant import proof
    from tests.helpers import exports

    rows = []
    with tempfile.TemporaryDirectory(prefix="proof-controls-") as tmp:
        for fmt in FORMATS:
            bound = float(hardware.compose(["model=tiny-qwen3", f"quant={fmt}"]).quant.eval.export_weight_ratio)
            e = exports.write(Path(tmp) / fmt / "ckpt", fmt)

            def ratio(ckpt: Path) -> tuple[float, bool]:
                p = proof.check_layers(ckpt, e.ref, bound)
                return p.details["worst_ratio"], any(x.startswith(f"{LAYER}: the exported weight") for x in p.problems)

            controls = {"untouched": ratio(e.dir)}
            for f in SCALES:
                def edit(t, q, f=f):
                    t[f"{LAYER}.weight_scale"] = (t[f"{LAYER}.weight_scale"].float() * f).to(
                        t[f"{LAYER}.weight_scale"].dtype)
                controls[f"weight scale x{f:g}"] = ratio(e.tampered(Path(tmp) / fmt / f"s{f}", edit))

            def unquantized(t, q):
                for part in ("weight_scale", "input_scale"):
                    t.pop(f"{LAYER}.{part}", None)
                t[f"{LAYER}.weight"] = e.original[LAYER].clone()
                q["exclude_modules"] = [*q["exclude_modules"], LAYER]
            controls["one layer unquantized (declared excluded)"] = ratio(e.tampered(Path(tmp) / fmt / "u", unquantized))
            for name, (r, caught) in controls.items():
                rows.append({"format": fmt, "control": name, "worst_ratio": r, "bound": bound, "caught": caught,
                             "ratio_over_bound": round(r / bound, 3)})
    real = []
    bounds = _instrument.records("export_proof_bounds", export_proof_bounds)
    if bounds:
        for r in bounds[0].data["rows"]:
            if r.get("format") in FORMATS and r.get("worst_layer_ratio") is not None:
                real.append({"model": r["model"], "format": r["format"], "worst_ratio": r["worst_layer_ratio"],
                             "bound_then": r.get("layer_ratio_max")})
    return {"layer": LAYER, "controls": rows, "real_exports": real,
            "real_exports_from": bounds[0].path.name if bounds else None}


def run(args) -> dict:
    return measure()


def render(record: dict) -> list[str]:
    lines = [f"{record['date'][:16].replace('T', ' ')} UTC · commit {commit_label(record)}", "",
             "The layer check bounds ‖export − fake-quant‖ / ‖original − fake-quant‖ per quantized linear "
             "(`quant.eval.export_weight_ratio`). Its controls in the fast tier (`tests/unit/test_export_proof.py`, "
             "synthetic exports in ModelOpt's format from `tests/helpers/exports.py`) use the shipped bound, so a "
             "bound loosened past them fails there. What each planted fault scores, next to the bound, and what "
             "untouched real ModelOpt exports score (`python -m benchmarks export_proof_bounds`):", "",
             "| format | export | layer ratio | shipped bound | ratio / bound | verdict |", "|---|---|---|---|---|---|"]
    for r in record["controls"]:
        if r["control"] == "untouched":
            verdict = "fails" if r["caught"] else "passes"
        else:
            verdict = "caught" if r["caught"] else "NOT caught"
        lines.append(f"| {r['format']} | synthetic, {r['control']} | {r['worst_ratio']:.4g} | {r['bound']:g} | "
                     f"{r['ratio_over_bound']:g} | {verdict} |")
    for r in record["real_exports"]:
        lines.append(f"| {r['format']} | real ModelOpt export of {r['model']}, untouched (worst layer) | "
                     f"{r['worst_ratio']:.4g} | (then {r['bound_then']:g}) | | must pass |")
    return lines
