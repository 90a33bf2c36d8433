"""The bench's gates: absolute limits, the regression against the previous bundle (its baseline), and the verdict."""
from __future__ import annotations

import json
from typing import Any

from pipeline.identity import ArtifactKey
from pipeline.results import BenchVerdict
from pipeline.runner.contract import Context

# What the typed result keeps of bench.json's gates (everything but the per-check list)
GATE_FIELDS = tuple(BenchVerdict.model_fields)


def summary_row(lv: dict[str, Any]) -> dict[str, Any]:
    row = {"concurrency": lv["concurrency"], "request_count": lv["request_count"], "error_count": lv["error_count"],
            "ttft_p50_ms": lv["time_to_first_token"]["p50"], "ttft_p95_ms": lv["time_to_first_token"]["p95"],
            "itl_p50_ms": lv["inter_token_latency"]["p50"], "itl_p95_ms": lv["inter_token_latency"]["p95"],
            "latency_p95_ms": lv["request_latency"]["p95"], "latency_p99_ms": lv["request_latency"]["p99"],
            "output_tokens_per_s": lv["output_token_throughput"]["avg"],
            "requests_per_s": lv["request_throughput"]["avg"]}
    if lv.get("noise") is not None:  # the figures' intervals (pipeline.stages.bench.noise); absent in older results
        row["noise"] = lv["noise"]
    return row


def _bench_rows_ok(bench: Any) -> bool:
    if not isinstance(bench, dict) or not isinstance(bench.get("workloads"), dict):
        return False
    return all(isinstance(rows, list) and all(isinstance(r, dict) and "concurrency" in r for r in rows)
               for rows in bench["workloads"].values())


def _read_baseline(raw: bytes, where: str, version: str | None) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return {"status": "corrupt", "source": where, "version": version,
                "detail": f"bundle.json is not JSON ({str(exc).splitlines()[0]})"}
    bench = doc.get("bench") if isinstance(doc, dict) else None
    if not _bench_rows_ok(bench):
        return {"status": "corrupt", "source": where, "version": version,
                "detail": "bundle.json has no bench results with per-level rows"}
    return {"status": "found", "source": where, "version": version, "detail": None, "bench": bench}


def previous_bench(ctx: Context) -> dict[str, Any]:
    """The regression baseline: the bench results of the previous bundle of the same model/quant/target/runtime, the
    ``latest`` one at ``publish.dest`` (what a scheduled rebuild on a fresh runner sees), else, when nothing is
    published there yet, the newest local bundle. ``{"status", "source", "version", "detail"}`` plus ``bench`` when
    found; ``status`` is ``found``, ``none`` (nothing published yet: an empty baseline), ``unreachable``
    (``publish.dest`` cannot be listed or read), ``corrupt`` (its ``bundle.json`` is unreadable or lacks bench
    rows), or ``disabled`` (``bench.gates.regression_pct`` is null)."""
    from pipeline.bundle import read_published

    cfg = ctx.cfg
    if cfg.bench.gates.regression_pct is None:
        return {"status": "disabled", "source": None, "version": None, "detail": None}
    dest = str(cfg.publish.dest)
    try:
        base, version, raw = read_published(cfg)
        if version is not None:
            return _read_baseline(raw, f"{base}/{version}", version)
    except Exception as exc:  # noqa: BLE001 - any failure to read the destination is reported, never a "pass"
        msg = (str(exc).splitlines() or [""])[0][:200]
        return {"status": "unreachable", "source": dest, "version": None,
                "detail": f"publish.dest={dest}: {type(exc).__name__}: {msg}"}
    label = ArtifactKey.of(ctx.cfg).label  # the publish stage's outputs carry the same label
    local = sorted(ctx.paths["bundles"].glob(f"{label}-publish-*/bundle.json"), key=lambda p: p.stat().st_mtime)
    if not local:
        return {"status": "none", "source": dest, "version": None, "detail": "no bundle published yet"}
    try:
        raw = local[-1].read_bytes()
    except OSError as exc:
        return {"status": "unreachable", "source": str(local[-1]), "version": None, "detail": str(exc)}
    return _read_baseline(raw, str(local[-1].parent), None)


# summary_row keys compared with the previous bundle: (key, label, a rise is the regression)
REGRESSION_METRICS = (("output_tokens_per_s", "output tokens/s", False), ("ttft_p95_ms", "TTFT p95", True),
                      ("itl_p95_ms", "inter-token latency p95", True), ("latency_p95_ms", "request latency p95", True))


def gates(cfg, result: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """Every check with its value, limit and outcome (``checks``), the breaches that fail the stage, the
    regressions against ``baseline`` (:func:`previous_bench`), and the verdict: ``fail`` (a breach),
    ``incomplete`` (no level measured, or a gated regression measure missing on either side: ``missing`` names it),
    ``no-baseline`` (the regression gate applies but the baseline could not be read, or shares no concurrency level
    with this run, so nothing was compared) or ``pass``."""
    g = cfg.bench.gates
    checks: list[dict[str, Any]] = []
    breaches: list[str] = []
    limits = (("ttft_p95_ms", "TTFT p95", "time_to_first_token", "p95"),
              ("itl_p95_ms", "inter-token latency p95", "inter_token_latency", "p95"),
              ("request_latency_p95_ms", "request latency p95", "request_latency", "p95"))
    for wname, w in result["workloads"].items():
        for lv in w["levels"]:
            where = f"{wname} at concurrency {lv['concurrency']}"
            rate = lv["error_count"] / max(1, lv["request_count"])
            ok = rate <= g.max_error_rate
            checks.append({"check": "error rate", "where": where, "value": rate, "limit": g.max_error_rate,
                           "pass": ok})
            if not ok:
                breaches.append(f"{where}: error rate {rate:.1%} > {g.max_error_rate:.1%} ({lv['errors'][:1]})")
            for key, label, field, p in limits:
                limit, value = g[key], lv[field][p]
                if limit is None:
                    continue
                ok = value is not None and value <= limit
                checks.append({"check": label, "where": where, "value": value, "limit": limit, "pass": ok})
                if value is None:
                    breaches.append(f"{where}: {label} not measured (limit {limit} ms)")
                elif not ok:
                    breaches.append(f"{where}: {label} {value:.1f} ms > {limit} ms (+{100 * (value / limit - 1):.0f}%)")
            tps = lv["output_token_throughput"]["avg"]
            if g.min_output_tokens_per_s is not None:
                ok = tps >= g.min_output_tokens_per_s
                checks.append({"check": "output tokens/s", "where": where, "value": tps,
                               "limit": g.min_output_tokens_per_s, "pass": ok})
                if not ok:
                    breaches.append(f"{where}: output {tps:.1f} tokens/s < {g.min_output_tokens_per_s} "
                                    f"(-{100 * (1 - tps / g.min_output_tokens_per_s):.0f}%)")
    compared, regressions, missing = 0, [], []
    previous = baseline.get("bench") if baseline.get("status") == "found" else None
    if previous and g.regression_pct is not None:
        for wname, rows in (previous.get("workloads") or {}).items():
            cur = {lv["concurrency"]: summary_row(lv) for lv in result["workloads"].get(wname, {}).get("levels", [])}
            for old in rows:
                new = cur.get(old["concurrency"])
                if not new:
                    continue
                compared += 1
                where = f"{wname} at concurrency {old['concurrency']}"
                for key, label, worse_if_higher in REGRESSION_METRICS:
                    o, n = old.get(key), new.get(key)
                    if not o or n is None:  # nothing to compare it with: said, never taken for a pass
                        missing.append(f"{where}: {label} " + ("not measured in this run" if n is None else
                                                               f"is {o!r} in the baseline"))
                        continue
                    change = 100 * (n / o - 1)
                    ok = not ((change > g.regression_pct) if worse_if_higher else (-change > g.regression_pct))
                    checks.append({"check": f"regression: {label}", "where": where, "value": n, "previous": o,
                                   "change_pct": round(change, 2), "limit": g.regression_pct, "pass": ok})
                    if not ok:
                        regressions.append(f"{where}: {label} {n:.1f} vs {o:.1f} in the previous bundle "
                                           f"({change:+.0f}%, allowed {g.regression_pct:g}%)")
    gated = g.regression_pct is not None and (cfg.target.device.value == "cuda" or bool(g.regression_on_cpu))
    if gated:
        breaches += regressions
    unreadable = baseline.get("status") in ("unreachable", "corrupt")
    measured = any(w.get("levels") for w in result["workloads"].values())
    if not measured:
        missing.insert(0, "no level was measured")
    elif gated and baseline.get("status") == "found" and compared == 0:
        unreadable = True  # a baseline that shares no workload and concurrency level with this run compares nothing
    if breaches:
        verdict = "fail"
    elif not measured:
        verdict = "incomplete"
    elif gated and unreadable:
        verdict = "no-baseline"
    elif gated and missing:
        verdict = "incomplete"
    else:
        verdict = "pass"
    return {"verdict": verdict, "checks": checks, "breaches": breaches, "regressions": regressions,
            "missing": missing, "regressions_gated": gated, "compared_with_previous_levels": compared,
            "baseline": {k: baseline.get(k) for k in ("status", "source", "version", "detail")}}


def baseline_line(g: dict[str, Any]) -> str:
    """One line on the regression baseline, for bench.md and the build summary."""
    b = g.get("baseline") or {}
    st = b.get("status")
    if st == "found":
        levels = g.get("compared_with_previous_levels", 0)
        line = (f"Regression baseline: {b.get('version') or b.get('source')} ({levels} levels compared"
                f"{'' if g.get('regressions_gated') else '; reported only'}).")
        if not levels:
            line = line[:-1] + ": it shares no workload and concurrency level with this run; nothing compared."
        if g.get("missing"):
            line += " Not compared: " + "; ".join(g["missing"]) + "."
        return line
    if st == "none":
        return "Regression baseline: none (no bundle published yet); nothing compared."
    if st == "disabled":
        return "Regression baseline: not compared (bench.gates.regression_pct is null)."
    what = "unreachable" if st == "unreachable" else "unreadable"
    return f"Regression baseline: **{what}**: {b.get('detail')}; nothing compared."
