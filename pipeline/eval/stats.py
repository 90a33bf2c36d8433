"""The paired task gate: per-item differences between the quantized model and its unquantized baseline.

Both models answer the same items, so the comparison is paired: each item contributes ``quantized - baseline`` (for
accuracy, -1, 0 or +1). The mean of those differences is the score difference; its confidence interval comes from a
seeded paired bootstrap (items resampled with replacement, percentile interval), and for 0/1 metrics McNemar's exact
test on the discordant items is reported beside it. The verdict compares the interval with ``-max_drop``:

- ``pass``: the lower end is above ``-max_drop`` (a drop as large as ``max_drop`` is ruled out);
- ``fail``: the upper end is below ``-max_drop`` (a drop larger than ``max_drop`` is established);
- ``inconclusive``: the interval straddles ``-max_drop``: too few items, or too many flips, to tell.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

VERDICTS = ("pass", "fail", "inconclusive")
METHOD = "paired bootstrap (percentile)"


def bootstrap_ci(diffs: Sequence[float], *, confidence: float = 0.95, resamples: int = 2000,
                 seed: int = 0) -> tuple[float, float]:
    """The percentile interval of the mean of ``diffs`` over ``resamples`` seeded resamples of the items."""
    import numpy as np

    d = np.asarray(diffs, dtype=np.float64)
    if d.size == 0:
        raise ValueError("no items to compare")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    if np.all(d == d[0]):  # every resample has the same mean
        return float(d[0]), float(d[0])
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    chunk = max(1, 2_000_000 // d.size)  # bounded memory for large item counts
    for start in range(0, resamples, chunk):
        n = min(chunk, resamples - start)
        means[start:start + n] = d[rng.integers(0, d.size, size=(n, d.size))].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def mcnemar_exact(baseline: Sequence[float], quantized: Sequence[float]) -> dict[str, Any]:
    """McNemar's exact test for paired 0/1 outcomes: the discordant counts and the two-sided p-value (the smaller
    discordant count against Binomial(b + c, 1/2))."""
    lost = sum(1 for a, b in zip(baseline, quantized) if a == 1 and b == 0)
    gained = sum(1 for a, b in zip(baseline, quantized) if a == 0 and b == 1)
    n = lost + gained
    if n == 0:
        return {"lost": 0, "gained": 0, "p_value": 1.0}
    k = min(lost, gained)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return {"lost": lost, "gained": gained, "p_value": min(1.0, 2.0 * tail)}


def verdict(ci_low: float, ci_high: float, max_drop: float) -> str:
    """``pass`` / ``fail`` / ``inconclusive`` of a difference interval against the allowed drop."""
    if max_drop < 0:
        raise ValueError(f"max_drop must be >= 0, got {max_drop}")
    if ci_low > -max_drop:
        return "pass"
    if ci_high < -max_drop:
        return "fail"
    return "inconclusive"


def _is_binary(values: Sequence[float]) -> bool:
    return all(v in (0, 1) for v in values)


def compare(baseline: dict[Any, float], quantized: dict[Any, float], *, max_drop: float, confidence: float = 0.95,
            resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """The gate of one task metric from per-item scores keyed by item id (``doc_id``). Both sides must hold the
    same items: a missing item is an error, never silently dropped."""
    if set(baseline) != set(quantized):
        only_b, only_q = sorted(set(baseline) - set(quantized)), sorted(set(quantized) - set(baseline))
        raise ValueError(f"the two runs scored different items (only in the baseline: {only_b[:5]}, only in the "
                         f"quantized run: {only_q[:5]}); run both with the same tasks and eval.limit")
    ids = sorted(baseline)
    b = [float(baseline[i]) for i in ids]
    q = [float(quantized[i]) for i in ids]
    diffs = [y - x for x, y in zip(b, q)]
    lo, hi = bootstrap_ci(diffs, confidence=confidence, resamples=resamples, seed=seed)
    n = len(ids)
    out: dict[str, Any] = {
        "baseline": sum(b) / n, "quantized": sum(q) / n, "difference": sum(diffs) / n,
        "ci_low": lo, "ci_high": hi, "confidence": confidence, "items": n, "max_drop": max_drop,
        "method": METHOD, "resamples": resamples, "seed": seed,
        "changed_items": sum(1 for d in diffs if d != 0),
        "verdict": verdict(lo, hi, max_drop),
    }
    if _is_binary(b) and _is_binary(q):
        out["mcnemar"] = mcnemar_exact(b, q)
    out["explanation"] = explain(out)
    return out


def explain(r: dict[str, Any]) -> str:
    """One sentence on what the verdict means for this task."""
    pts = lambda v: f"{100 * v:+.1f}"  # noqa: E731
    ci = f"[{pts(r['ci_low'])}, {pts(r['ci_high'])}] points ({int(100 * r['confidence'])}% CI, {r['items']} items)"
    limit = f"-{100 * r['max_drop']:.1f}"
    if r["verdict"] == "pass":
        return f"difference {pts(r['difference'])} points, {ci}: a drop beyond {limit} points is ruled out"
    if r["verdict"] == "fail":
        return f"difference {pts(r['difference'])} points, {ci}: the drop exceeds {limit} points"
    return (f"difference {pts(r['difference'])} points, {ci} straddles the allowed {limit} points: too few items "
            f"(or too many changed answers: {r['changed_items']}) to tell; raise eval.limit or add items")
