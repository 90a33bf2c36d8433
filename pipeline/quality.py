"""Logit-level comparisons between two models on the same token rows, and the quantize stage's accuracy gate.

The gate compares what is deployed (the exported checkpoint, reloaded as it is served) with the unquantized model on
held-out rows; a breach of ``quant.thresholds`` fails the stage unless ``quant.gate=warn``. The export proof
(``pipeline.quant.proof``) is decided here too, from its three checks and a negative control: the unquantized
weights must fail the numbers check.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from pipeline.quant.proof import Proof


def logits(model, rows: torch.Tensor, batch_size: int = 4, on_batch: Callable[[], None] | None = None) -> torch.Tensor:
    import torch

    device = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for i in range(0, len(rows), batch_size):
            out.append(model(input_ids=rows[i:i + batch_size].to(device), use_cache=False).logits.float().cpu())
            if on_batch:
                on_batch()
    return torch.cat(out)


def compare(ref: torch.Tensor, test: torch.Tensor, rows: torch.Tensor) -> dict[str, float]:
    """KL(ref ‖ test) per token (mean, nats), top-1 agreement, and the perplexity ratio test/ref on ``rows``."""
    import torch

    lp, lq = ref.log_softmax(-1), test.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (ref.argmax(-1) == test.argmax(-1)).float()
    targets = rows[:, 1:].reshape(-1)

    def ppl(lo: torch.Tensor) -> float:
        return float(torch.nn.functional.cross_entropy(lo[:, :-1].reshape(-1, lo.shape[-1]), targets).exp())

    p_ref, p_test = ppl(ref), ppl(test)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1_agreement": float(top1.mean()),
            "ppl_ref": p_ref, "ppl_test": p_test, "ppl_ratio": p_test / p_ref, "tokens": int(kl.numel())}


def breaches(deployed: dict[str, float], thresholds: dict[str, float]) -> list[str]:
    """The gate's breaches of ``quant.thresholds`` (kl_max, top1_min, ppl_ratio_max), one line each."""
    kl, top1, ppl = deployed["kl_mean"], deployed["top1_agreement"], deployed["ppl_ratio"]
    return [f"{name} {value:.4f} {op} {limit}" for name, value, op, limit, bad in (
        ("KL", kl, ">", thresholds["kl_max"], kl > thresholds["kl_max"]),
        ("top-1 agreement", top1, "<", thresholds["top1_min"], top1 < thresholds["top1_min"]),
        ("perplexity ratio", ppl, ">", thresholds["ppl_ratio_max"], ppl > thresholds["ppl_ratio_max"]),
    ) if bad]


def gate(found: list[str], mode: str) -> str:
    """``pass`` without breaches; otherwise ``warn`` under ``quant.gate=warn``, else ``fail``."""
    return "pass" if not found else ("warn" if mode == "warn" else "fail")


def assess(base, fake_quant, exported, rows, *, structure: Proof, layers: Proof, scales: dict[str, Any],
           thresholds: dict[str, float], mode: str, kl_abs: float, kl_frac: float) -> dict[str, Any]:
    """The ``accuracy`` section of accuracy.json from the held-out logits of the unquantized model (``base``),
    ModelOpt's fake-quant model and the reloaded export, and the export proof's structure and layer checks."""
    from pipeline.quant import proof

    fq_vs_base = compare(base, fake_quant, rows)  # diagnostic: ModelOpt's fake-quant model
    deployed = compare(base, exported, rows)  # the gate: the exported checkpoint as served
    export_vs_fq = compare(fake_quant, exported, rows)
    unquantized_vs_fq = compare(fake_quant, base, rows)  # where the unquantized weights would score
    numbers = proof.check_numbers(fq_vs_base, export_vs_fq, kl_abs, kl_frac)
    control = proof.check_numbers(fq_vs_base, unquantized_vs_fq, kl_abs, kl_frac)
    problems = structure.problems + layers.problems + numbers.problems
    if control.ok:
        problems.append(f"the numbers check cannot tell this export from the unquantized weights (KL(fake-quant ‖ "
                        f"unquantized) {unquantized_vs_fq['kl_mean']:.5f} is within the limit "
                        f"{control.details['kl_max']:.5f}); lower quant.eval.export_kl_abs / export_kl_frac")
    found = breaches(deployed, thresholds)
    return {"gate_measures": "the exported checkpoint, reloaded as served (reference dequantizer), vs the "
                             "unquantized model",
            "quantized_vs_unquantized": deployed, "fake_quant_vs_unquantized": fq_vs_base,
            "exported_vs_fake_quant": export_vs_fq, "unquantized_vs_fake_quant": unquantized_vs_fq,
            "export_proof": {"structure": structure.details, "layers": layers.details, "numbers": numbers.details,
                             "unquantized_weights": {"kl": unquantized_vs_fq["kl_mean"], "fails": not control.ok},
                             "calibrated_scales": scales, "problems": problems[:50], "problem_count": len(problems)},
            "export_check": "fail" if problems else "pass",
            "thresholds": dict(thresholds), "gate": gate(found, mode), "breaches": found}


def failure(accuracy: dict[str, Any], fmt: str, kv: str) -> str | None:
    """Why the stage fails, from its ``accuracy`` section: a failed export proof first, then a failed gate."""
    p = accuracy["export_proof"]
    if accuracy["export_check"] != "pass":
        more = f" (and {p['problem_count'] - 3} more, see accuracy.json)" if p["problem_count"] > 3 else ""
        return "export proof failed: " + "; ".join(p["problems"][:3]) + more
    if accuracy["gate"] == "fail":
        return (f"accuracy gate ({fmt}, KV {kv}, deployed export vs unquantized): " + "; ".join(accuracy["breaches"])
                + " (quant.gate=warn to accept, or raise quant.thresholds.*)")
    return None


def report(model: str, r: dict[str, Any]) -> str:
    """quantize.md: the stage's result (accuracy.json) as markdown."""
    lines = [f"# quantize: {model} {r['format']} (KV {r['kv_cache']})", ""]
    lines += [f"- quant_algo: `{r.get('quant_algo')}`, kv_cache_quant_algo: `{r.get('kv_cache_quant_algo')}`",
              f"- exclude_modules: `{r.get('exclude_modules')}`"]
    if "calibration" not in r:
        return "\n".join(lines + ["", r.get("note", "")]) + "\n"
    c = r["calibration"]
    lines += [f"- calibration: {c['rows']}×{c['seq_len']} tokens of `{c['dataset']}` (sha256 {c['sha256'][:12]}), "
              f"{c['tokens_per_s']} tokens/s on {r['device']}"
              + (f"; **short** of ModelOpt's recipe: {'; '.join(c['short_reasons'])}" if c.get("short_reasons")
                 else ""), ""]
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
    return "\n".join(lines) + "\n"
