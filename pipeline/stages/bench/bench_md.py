"""The bench's human reports: ``bench.md`` and the latency/throughput plot."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.stages.bench.gates import baseline_line
from pipeline.stages.bench.load import COUNTING
from pipeline.stages.bench.noise import CONFIDENCE


# Said beside every table and plot of a bench on the reference runtime (PyTorch behind Triton, an emulator of the
# TensorRT-LLM model's interface): its timings are those of the serving path, not of TensorRT-LLM on the target.
REFERENCE_NOTE = ("reference runtime: these figures exercise the serving path (Triton, batching, the front end) on "
                  "PyTorch; they are not a performance measurement (`plan` shows NVIDIA's performance model's "
                  "prediction for TensorRT-LLM)")


def note(r: dict[str, Any]) -> str | None:
    """:data:`REFERENCE_NOTE` for a bench on the reference runtime (``r["runtime"]``), else None."""
    return REFERENCE_NOTE if r.get("runtime") == "reference" else None


# How far a TensorRT-LLM bench may stray from NVIDIA's performance model before it warns: the model's GEMM tables
# matched this project's H200 within 0.82-1.16x (FACTS §9), and a served request adds Triton, tokenization and the
# network on top; +-30% of the prediction is a difference worth a look, not a failure.
PREDICTION_TOLERANCE = 0.30
# measured (a level's key, its statistic) -> predicted figure
COMPARED = {"TTFT p50 ms": (("time_to_first_token", "p50"), "ttft_ms"),
            "ITL p50 ms": (("inter_token_latency", "p50"), "tpot_ms"),
            "output tokens/s": (("output_token_throughput", "avg"), "tokens_per_s")}


def against_prediction(r: dict[str, Any], predictions: dict[str, Any] | None, gpus: int,
                       tolerance: float = PREDICTION_TOLERANCE) -> dict[str, Any] | None:
    """A TensorRT-LLM bench's measurements beside NVIDIA's performance model's prediction at the same workload and
    concurrency (``predictions``: the serving plan's, ``workloads.NAME.by_concurrency``): one row per level and
    figure, and a warning for each measured figure off the prediction by more than ``tolerance``. None on the
    reference runtime (an emulator's timings), or without predictions."""
    if note(r) or not predictions:
        return None
    rows, warnings = [], []
    for wname, w in r["workloads"].items():
        by_c = ((predictions.get("workloads") or {}).get(wname) or {}).get("by_concurrency") or {}
        for lv in w["levels"]:
            pred = by_c.get(str(lv["concurrency"]))
            if not pred or "error" in pred:
                continue
            pred = {**pred, "tokens_per_s": pred["tokens_per_s_per_gpu"] * max(1, gpus)}
            for label, ((key, stat), pkey) in COMPARED.items():
                measured = (lv.get(key) or {}).get(stat)
                if measured is None or not pred.get(pkey):
                    continue
                ratio = measured / pred[pkey]
                rows.append({"workload": wname, "concurrency": lv["concurrency"], "figure": label,
                             "measured": round(measured, 2), "predicted": pred[pkey], "ratio": round(ratio, 3)})
                if abs(ratio - 1) > tolerance:
                    warnings.append(f"{wname} c={lv['concurrency']}: {label} measured {measured:.1f}, predicted "
                                    f"{pred[pkey]:.1f} ({ratio:.2f}x; tolerance ±{tolerance:.0%})")
    return {"tolerance": tolerance, "tables": predictions.get("trtllm_tables"), "model": predictions.get("model"),
            "rows": rows, "warnings": warnings}


NOISE_LEGEND = (f"{CONFIDENCE:.0%} interval: the bootstrap interval of each figure over the level's own requests "
                "(pipeline.stages.bench.noise); `pipeline diff` marks a change whose two intervals overlap as within "
                "noise. `-`: fewer than two requests, no interval")


def noise_cell(n: dict[str, Any] | None) -> str:
    """A level's intervals for the table: ``[low, high]`` of TTFT p50, latency p95 and output tokens/s."""
    if not n:
        return "not recorded"

    def one(key: str, spec: str) -> str:
        v = n.get(key)
        return "-" if not v else f"[{v[0]:{spec}}, {v[1]:{spec}}]"

    return " / ".join((one("ttft_p50_ms", ".1f"), one("latency_p95_ms", ".1f"), one("output_tokens_per_s", ".1f")))


def markdown(model: str, r: dict[str, Any]) -> str:
    g = r["gates"]
    lines = [f"# bench: {model}", "", f"Entry point `{r['model']}` ({r.get('layout')} layout), launcher "
             f"{r['launcher']}, server start {r.get('server_start_s')} s. Gate: **{g['verdict']}**", "",
             baseline_line(g), "", f"Counting: {r.get('counting', COUNTING)}."]
    if note(r):
        lines += ["", f"**Note:** {note(r)}."]
    vs = r.get("against_prediction")
    if vs and vs["rows"]:
        lines += ["", f"Measured against NVIDIA's performance model ({vs['model']}, TensorRT-LLM {vs['tables']} "
                  f"tables) at the same concurrency; a figure off by more than ±{vs['tolerance']:.0%} is a warning:",
                  "", "| workload | concurrency | figure | measured | predicted | ratio |", "|---|---|---|---|---|---|"]
        lines += [f"| {x['workload']} | {x['concurrency']} | {x['figure']} | {x['measured']} | {x['predicted']} | "
                  f"{x['ratio']:.2f}x |" for x in vs["rows"]]
        lines += [f"- warning: {x}" for x in vs["warnings"]]
    if g["breaches"]:
        lines.append("")
    lines += [f"- {b}" for b in g["breaches"]]
    if g.get("regressions") and not g.get("regressions_gated"):
        lines += ["", "Slower than the previous bundle (reported only: on target=cpu, set "
                  "bench.gates.regression_on_cpu=true to fail on it):", ""]
        lines += [f"- {x}" for x in g["regressions"]]
    if r["answers"]:
        lines += ["", "| answer check | expected | output | result |", "|---|---|---|---|"]
        for a in r["answers"]:
            out = (a["error"] or a["text"]).replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {a['prompt']} | {', '.join(a['expect'])} | {out} | {'pass' if a['pass'] else 'FAIL'} |")
    for wname, w in r["workloads"].items():
        lines += ["", f"## {wname}: ~{w['prompt_words']} prompt words, {w['max_tokens']} output tokens", "",
                  *([f"_{note(r)}._", ""] if note(r) else []),
                  "| concurrency | requests | errors | TTFT p50/p95/p99 ms | ITL p50/p95/p99 ms | "
                  f"latency p50/p95/p99 ms | output tok/s | req/s | {CONFIDENCE:.0%} interval: TTFT p50 / latency p95 / "
                  "tok/s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for lv in w["levels"]:
            def f(key):
                return "/".join("-" if lv[key][p] is None else f"{lv[key][p]:.1f}" for p in ("p50", "p95", "p99"))
            lines.append(f"| {lv['concurrency']} | {lv['request_count']} | {lv['error_count']} | "
                         f"{f('time_to_first_token')} | {f('inter_token_latency')} | {f('request_latency')} | "
                         f"{lv['output_token_throughput']['avg']:.1f} | {lv['request_throughput']['avg']:.2f} | "
                         f"{noise_cell(lv.get('noise'))} |")
        if any(lv.get("noise") for lv in w["levels"]):
            lines += ["", NOISE_LEGEND]
        if w.get("openai_levels"):
            ep = (r.get("openai") or {}).get("endpoint", "the OpenAI endpoint")
            lines += ["", f"Through the OpenAI front end ({ep}, streamed), the same prompts:", "",
                      "| concurrency | requests | errors | TTFT p50/p95/p99 ms | ITL p50/p95/p99 ms | "
                      "latency p50/p95/p99 ms | output tok/s | req/s | front-end overhead: TTFT p50 / ITL p50 / "
                      "tok/s |", "|---|---|---|---|---|---|---|---|---|"]
            for lv in w["openai_levels"]:
                def f(key):
                    return "/".join("-" if lv[key][p] is None else f"{lv[key][p]:.1f}" for p in ("p50", "p95", "p99"))
                o = lv["overhead"]
                ov = " / ".join(["-" if o["ttft_p50_added_ms"] is None else f"{o['ttft_p50_added_ms']:+.1f} ms",
                                 "-" if o["itl_p50_ratio"] is None else f"{o['itl_p50_ratio']:.2f}x",
                                 "-" if o["throughput_ratio"] is None else f"{o['throughput_ratio']:.2f}x"])
                lines.append(f"| {lv['concurrency']} | {lv['request_count']} | {lv['error_count']} | "
                             f"{f('time_to_first_token')} | {f('inter_token_latency')} | {f('request_latency')} | "
                             f"{lv['output_token_throughput']['avg']:.1f} | {lv['request_throughput']['avg']:.2f} | "
                             f"{ov} |")
            runs = [lv for lv in w["openai_levels"] if lv.get("aiperf")]
            if runs:
                a0 = runs[0]["aiperf"]
                lines += ["", f"aiperf {a0.get('aiperf_version') or ''} natively against the front end "
                          f"(`--endpoint-type {a0['endpoint_type']} --streaming`; its export: "
                          f"`aiperf/{wname}/concurrency_<N>/`):", "",
                          "| concurrency | requests | errors | TTFT p50 ms | ITL p50 ms | output tok/s |",
                          "|---|---|---|---|---|---|"]
                for lv in runs:
                    a = lv["aiperf"]
                    cells = ["-" if a[k] is None else f"{a[k]:.1f}" for k in
                             ("time_to_first_token_p50_ms", "inter_token_latency_p50_ms", "output_token_throughput")]
                    lines.append(f"| {lv['concurrency']} | {a['request_count']} | {a['error_count']} | "
                                 f"{' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    """Latency (p50/p95) and output throughput against concurrency, one row per workload."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, so any thread may draw

    names = list(r["workloads"])
    fig = Figure(figsize=(10, 3.2 * len(names)))
    axes = fig.subplots(len(names), 2, squeeze=False)
    for row, name in enumerate(names):
        levels = r["workloads"][name]["levels"]
        conc = [lv["concurrency"] for lv in levels]
        ax = axes[row][0]
        for key, label in (("time_to_first_token", "TTFT"), ("request_latency", "request latency")):
            for p, style in (("p50", "-o"), ("p95", "--o")):
                ax.plot(conc, [lv[key][p] or 0 for lv in levels], style, label=f"{label} {p}")
        ax.set(title=f"{name}: latency", xlabel="concurrency", ylabel="ms", xscale="log")
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.minorticks_off()
        ax.legend(fontsize=7)
        ax = axes[row][1]
        ax.plot(conc, [lv["output_token_throughput"]["avg"] for lv in levels], "-o")
        ax.set(title=f"{name}: output throughput", xlabel="concurrency", ylabel="tokens/s", xscale="log")
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.minorticks_off()
    if note(r):
        fig.suptitle("reference runtime: the serving path, not a performance measurement", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
