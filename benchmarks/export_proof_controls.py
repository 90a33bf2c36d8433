"""The export proof's per-layer bound against slightly wrong exports: how far each planted fault scores, next to
the shipped bound and to what real exports score.

    python benchmarks/export_proof_controls.py

On the synthetic FP8, INT8-SmoothQuant and INT4-AWQ exports of ``tests/helpers/exports.py`` (the ones the fast tier's controls use,
``tests/unit/test_export_proof.py``) it plants each fault and records the layer check's worst ratio
(‖export − fake-quant‖ / ‖original − fake-quant‖, through the proof's sketch): one layer's weight scale off by
1%, 2%, 10% and −10%, one layer left unquantized. The pass side comes from the real ModelOpt exports recorded by
``benchmarks/export_proof_bounds.py`` (``benchmarks/results/export_proof_bounds.json``: the worst layer of each
untouched export). Raw results: ``benchmarks/results/export_proof_controls.json``; the table in docs/mutation.md is
rendered from it.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from _docfile import replace_block  # noqa: E402
from _provenance import commit_label, source_state  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "export_proof_controls.json"
BOUNDS = REPO / "benchmarks" / "results" / "export_proof_bounds.json"
DOC = REPO / "docs" / "mutation.md"
LAYER = "model.layers.0.mlp.down_proj"
FORMATS = ("fp8", "int8_sq", "int4_awq")
SCALES = (1.01, 1.02, 1.1, 0.9)


def measure() -> dict:
    import datetime as dt

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
    if BOUNDS.is_file():
        for r in json.loads(BOUNDS.read_text())["rows"]:
            if r.get("format") in FORMATS and r.get("worst_layer_ratio") is not None:
                real.append({"model": r["model"], "format": r["format"], "worst_ratio": r["worst_layer_ratio"],
                             "bound_then": r.get("layer_ratio_max")})
    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **source_state(),
            "layer": LAYER, "controls": rows, "real_exports": real}


def render(doc: dict) -> None:
    lines = [f"{doc['date'][:16]} UTC · commit {commit_label(doc)} · `python benchmarks/export_proof_controls.py`"
             f" · raw JSON: `benchmarks/results/export_proof_controls.json`", "",
             "| format | export | layer ratio | shipped bound | ratio / bound | verdict |", "|---|---|---|---|---|---|"]
    for r in doc["controls"]:
        lines.append(f"| {r['format']} | synthetic, {r['control']} | {r['worst_ratio']:.4g} | {r['bound']:g} | "
                     f"{r['ratio_over_bound']:g} | {('caught' if r['caught'] else 'NOT caught') if r['control'] != 'untouched' else ('fails' if r['caught'] else 'passes')} |")
    for r in doc["real_exports"]:
        lines.append(f"| {r['format']} | real ModelOpt export of {r['model']}, untouched (worst layer) | "
                     f"{r['worst_ratio']:.4g} | (then {r['bound_then']:g}) | | must pass |")
    replace_block("export-proof-controls", "\n".join(lines), DOC)


def main() -> int:
    doc = measure()
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n")
    render(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
