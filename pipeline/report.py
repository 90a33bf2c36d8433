"""What a build and a plan show: the build report (Markdown and JSON under ``paths.reports``), the console summary
tables, and the plan tables. Presentation only: nothing here changes an output."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.markup import escape

from pipeline import store
from pipeline.identity import ArtifactKey


def human(n: float) -> str:
    """A byte count in B/KB/MB/GB/TB (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt(v: Any, spec: str = ".1f") -> str:
    """``v`` formatted with ``spec``; ``-`` for a missing value."""
    return "-" if v is None else format(v, spec)


def write(summary: dict[str, Any], reports_dir: Path) -> Path:
    """``<reports_dir>/<label>.md`` and ``.json`` (the JSON is ``BuildReport.to_dict()``); returns the Markdown path."""
    reports_dir.mkdir(parents=True, exist_ok=True)
    label = ArtifactKey.of_report(summary).label
    path = reports_dir / f"{label}.md"
    store.write_text_atomic(path, markdown(summary))
    store.write_json_atomic(reports_dir / f"{label}.json", summary)
    return path


def stage_result(summary: dict[str, Any], stage: str) -> Any:
    """The typed result (``pipeline.results``) of ``stage`` in the report's rows; None when it is not there."""
    from pipeline import results

    for r in summary["stages"]:
        if r["stage"] == stage and r["result"]:
            return results.load(stage, r["result"])
    return None


def bench_rows(summary: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every (workload, level row) of the bench stage's result."""
    res = stage_result(summary, "bench")
    return [] if res is None else [(w, lv) for w, rows in res.workloads.items() for lv in rows]


def bench_note(summary: dict[str, Any]) -> str | None:
    """What a bench table of this build measures, where that is not the target's performance (the reference runtime:
    the serving path on PyTorch); None otherwise."""
    from pipeline.stages.bench.bench_md import note

    return note({"runtime": summary.get("runtime")}) if bench_rows(summary) else None


def bench_gate(summary: dict[str, Any]) -> str | None:
    """The bench stage's gate verdict and regression baseline, one line (None without a bench result)."""
    from pipeline.stages.bench.gates import baseline_line

    res = stage_result(summary, "bench")
    if res is None:
        return None
    return (f"Bench gate: {res.gates.verdict} (entry point {res.model}). "
            f"{baseline_line(res.gates.model_dump(mode='json'))}")


def eval_lines(summary: dict[str, Any]) -> list[str]:
    """The task gate, one line per task (none without an evaluate result)."""
    res = stage_result(summary, "evaluate")
    if res is None or not res.tasks:
        return []
    return [f"Task gate: {t['verdict']}: {name} {t['metric']} {t['baseline']:.4f} (unquantized) -> "
            f"{t['quantized']:.4f}, difference {t['difference']:+.4f}, {int(100 * t['confidence'])}% CI "
            f"[{t['ci_low']:+.4f}, {t['ci_high']:+.4f}], {t['items']} items, allowed drop {t['max_drop']:g}"
            for name, t in res.tasks.items()]


def markdown(s: dict[str, Any]) -> str:
    """The build report as Markdown: stages, publish outcome, bench table and gate, quantization accuracy."""
    lines = [f"# build report: {s['model']} · {s['quant']} (KV {s['kv_cache']}) · {s['target']} · {s['runtime']}", "",
             f"Finished {s['finished']} in {s['total_s']} s. Log: `{s['log']}`", "",
             "| stage | status | time (s) | peak RSS (MB) | size | output |", "|---|---|---|---|---|---|"]
    for r in s["stages"]:
        t = r["seconds"] if r["status"] == "ran" else f"{r['seconds']} (built in {r['stage_wall_s']})"
        lines.append(f"| {r['stage']} | {r['status']} | {t} | {fmt(r['peak_rss_mb'])} | {human(r['bytes'])} | "
                     f"`{r['output']}` |")
    if s.get("published"):
        p = s["published"]
        lines += ["", f"Published `{p['url']}` ({p['uploaded_files']} files uploaded; `latest` {latest_line(p)})."]
        if p.get("gates"):
            lines += ["", f"Gates: {p['gates']}."]
    bench = bench_rows(s)
    if bench:
        lines += ["", "| workload | concurrency | requests | errors | TTFT p50 (ms) | ITL p50 (ms) | "
                      "latency p95 (ms) | output tok/s | req/s |", "|---|---|---|---|---|---|---|---|---|"]
        for w, lv in bench:
            lines.append(f"| {w} | {lv.concurrency} | {lv.request_count} | {lv.error_count} | {fmt(lv.ttft_p50_ms)} | "
                         f"{fmt(lv.itl_p50_ms)} | {fmt(lv.latency_p95_ms)} | {fmt(lv.output_tokens_per_s)} | "
                         f"{fmt(lv.requests_per_s, '.2f')} |")
        note = bench_note(s)
        if note:
            lines += ["", f"_{note}._"]
    gate = bench_gate(s)
    if gate:
        lines += ["", gate]
    lines += [x for line in eval_lines(s) for x in ("", line)]
    quant = stage_result(s, "quantize")
    if quant is not None and quant.accuracy is not None:
        a = quant.accuracy
        q, e = a.quantized_vs_unquantized, a.exported_vs_fake_quant
        lines += ["", f"Accuracy (held-out): quantized vs unquantized KL {q['kl_mean']:.4f}, top-1 "
                      f"{q['top1_agreement']:.3f}, perplexity ratio {q['ppl_ratio']:.3f}; export check "
                      f"{a.export_check} (KL {e['kl_mean']:.4f} vs fake-quant)."]
    return "\n".join(lines) + "\n"


def latest_line(published: dict[str, Any]) -> str:
    """Whether ``latest`` moved, and why not: with the gates named when one of them kept it."""
    if published["latest_moved"]:
        return "moved"
    return f"not moved: {published.get('latest_not_moved') or 'a gate did not pass'}"


def print_summary(s: dict[str, Any], report: Path, console=None) -> None:
    """The build's stage table, bench table and gates, publish outcome and total (``console``: stdout by default,
    :func:`pipeline.ui.results`)."""
    from rich.table import Table

    from pipeline import ui

    console = console or ui.out

    t = Table(title="stages")
    for col in ("stage", "status", "time", "size"):
        t.add_column(col, no_wrap=True)
    for r in s["stages"]:
        st = "[green]ran[/]" if r["status"] == "ran" else "[dim]cached[/]"
        t.add_row(r["stage"], st, f"{r['seconds']:.1f}s", human(r["bytes"]))
    console.print(t)
    print_paths(console, [(r["stage"], r["output"]) for r in s["stages"]])
    bench = bench_rows(s)
    if bench:
        b = Table(title="bench (streaming gRPC)")
        for col in ("workload", "conc.", "errors", "TTFT p50 ms", "ITL p50 ms", "p95 ms", "tok/s", "req/s"):
            b.add_column(col, justify="right")
        for w, lv in bench:
            b.add_row(w, str(lv.concurrency), str(lv.error_count), fmt(lv.ttft_p50_ms), fmt(lv.itl_p50_ms),
                      fmt(lv.latency_p95_ms), fmt(lv.output_tokens_per_s), fmt(lv.requests_per_s, ".2f"))
        console.print(b)
        note = bench_note(s)
        if note:
            console.print(note.replace("`", ""), markup=False, style="dim", soft_wrap=True)
    gate = bench_gate(s)
    if gate:
        console.print(gate.replace("**", ""), markup=False)
    for line in eval_lines(s):
        console.print(line, markup=False)
    p = s.get("published")
    if p:
        console.print(f"published {p['url']} ({p['uploaded_files']} files uploaded; latest {latest_line(p)})",
                      markup=False, soft_wrap=True)
        if p.get("gates") and p["latest_moved"]:  # a latest kept back names them in its own line
            console.print(f"gates: {p['gates']}", markup=False, soft_wrap=True)
    console.print(f"total {s['total_s']:.1f}s · report: {report}", markup=False, soft_wrap=True)


def serve_lines(s: dict[str, Any], openai: dict[str, Any] | None) -> list[str]:
    """How to serve what the build made: ``pipeline serve`` on the published bundle (its base when ``latest`` moved,
    else the version; the local bundle when the destination is remote), else on the package stage's repository;
    and the OpenAI base URL it will answer on (``openai``: ``serve.openai``; None or disabled: none)."""
    outputs = {r["stage"]: r["output"] for r in s["stages"]}
    p = s.get("published")
    if p and "://" not in p["url"]:
        where = str(Path(p["url"]).parent) if p["latest_moved"] else p["url"]
    else:
        where = outputs.get("publish") or outputs.get("package")
    if where is None:
        return []
    if not (openai and openai.get("enabled", True)):
        return [f"serve it: python -m pipeline serve {where}"]
    # `serve` composes its own config: a port this build was given is carried into the command, or serve would
    # listen on the default
    host, port = openai.get("host", "127.0.0.1"), int(openai.get("port", DEFAULT_OPENAI_PORT))
    own = f" serve.openai.port={port}" if port != DEFAULT_OPENAI_PORT else ""
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port if port else '<port it prints>'}/v1"
    model = openai.get("model_name") or s["model"]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}]})
    return [f"serve it: python -m pipeline serve {where}{own}",
            f"OpenAI API: {url} (model '{model}') once it is up (serve.openai.port=N for another port, 0 for any "
            f"free one, which serve prints), e.g.",
            f"  curl {url}/chat/completions -H 'Content-Type: application/json' -d '{body}'"]


DEFAULT_OPENAI_PORT = 9000  # conf/serve/default.yaml serve.openai.port


def print_paths(console, rows: list[tuple[str, str]]) -> None:
    """``name  path`` lines below a table: a path is never cut or folded by a column width, with or without a
    terminal (each line is written whole; a terminal wraps it, a log keeps it on one line)."""
    width = max((len(n) for n, _ in rows), default=0)
    for name, path in rows:
        console.print(f"  {name:<{width}}  {path}", markup=False, highlight=False, soft_wrap=True)


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def print_serving(doc: dict[str, Any], console=None) -> None:
    """The serving plan (``plan`` verb): each serving setting and where it came from, the service profile with its
    runners-up, and NVIDIA's performance model's predictions per workload (chosen KV dtype, bf16 KV, speed of
    light), or one line saying why there are none."""
    from rich.table import Table

    from pipeline import ui

    console = console or ui.out
    sv = doc.get("serving")
    if not sv:
        return
    console.print(f"serving settings on {escape(doc['target'])} (a value set in build wins):")
    for name, v in sv["settings"].items():
        value = v["value"]
        shown = ", ".join(map(str, value)) if isinstance(value, list) else f"{value:,}" if isinstance(value, int) \
            else str(value)
        console.print(escape(f"  {name} = {shown}  ({v.get('source', '')}: {v.get('why', '')})"))
    cap = doc.get("capacity") or {}
    if cap.get("table"):
        row = next(r for r in cap["table"] if r["kv_dtype"] == cap["chosen_kv"])
        seq = sv["settings"]["max_seq_len"]["value"]
        typical = cap.get("typical_requests")
        console.print(escape(
            f"KV pool: {row['max_tokens']:,} tokens per GPU hold {cap.get('full_length_sequences', 0):,} sequences "
            f"at the full max_seq_len of {seq:,} tokens" + (f", or {typical:,} typical requests" if typical else "")
            + " at once; " + ("the reference runtime keeps its own KV cache and decodes up to max_batch_size "
                              "sequences together, the rest wait" if doc.get("runtime") == "reference" else
                              "when the pool is full, " + _QUEUE)))
    prof = sv.get("profile")
    if prof:
        c = prof["chosen"]
        console.print(escape(f"profile ({prof['objective']}, {prof.get('concurrency', 1)} concurrent requests): "
                             f"TP={c['tp']} batch {c['batch']}, predicted TTFT {c['ttft_ms']:.0f} ms, TPOT "
                             f"{c['tpot_ms']:.1f} ms, {c['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU; {prof['why']}"))
        for r in prof["runners_up"]:
            console.print(escape(f"  runner-up: TP={r['tp']} batch {r['batch']}: TTFT {r['ttft_ms']:.0f} ms, TPOT "
                                 f"{r['tpot_ms']:.1f} ms, {r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU"))
    pred = sv.get("predictions")
    if pred:
        attention = "FP8" if pred.get("fmha") == "fp8" else "bf16"
        t = Table(title=f"predicted on {pred['system']} by NVIDIA's performance model ({pred['model']}, measured "
                        f"TensorRT-LLM {pred['trtllm_tables']} kernel tables; not measured here; SOL: speed of "
                        f"light) at the bundle's settings: TP={cap.get('tp', 1)}, batch "
                        f"{sv['settings']['max_batch_size']['value']}, "
                        f"max_num_tokens {pred['ctx_tokens']:,}, max_seq_len {pred['max_seq_len']:,}, {attention} "
                        f"context attention")
        for col in ("workload", "in/out", "KV", "TTFT ms", "TPOT ms", "tok/s/GPU", "GB", "GB full"):
            t.add_column(col, justify="right", no_wrap=True)
        over = False
        for name, w in pred["workloads"].items():
            for kv, label in [(k, k.removeprefix("kv_")) for k in w if k.startswith("kv_")] + [
                    ("speed_of_light", "SOL")]:
                f = w[kv]
                if "error" in f:
                    t.add_row(name, f"{w['isl']}/{w['osl']}", label, "no data", "", "", "", "")
                    continue
                over = over or f.get("oom", False)
                t.add_row(name, f"{w['isl']}/{w['osl']}", label, f"{f['ttft_ms']:.1f}", f"{f['tpot_ms']:.2f}",
                          f"{f['tokens_per_s_per_gpu']:,.0f}", f"{f.get('memory_gb_at_request', f['memory_gb']):.1f}",
                          f"{f['memory_gb']:.1f}" + ("*" if f.get("oom") else ""))
        console.print(t)
        console.print(escape(f"GB: GPU memory with every sequence of the batch at the workload's length; GB full: "
                             f"at the full max_seq_len of {pred['max_seq_len']:,} tokens" + (
                                 f" (* more than the {pred.get('gpu_gb', 0):g} GB GPU: aiconfigurator's worst case, "
                                 f"where its CLI stops with \"OOM\"; the figures do not depend on it, and "
                                 f"TensorRT-LLM's pool holds what fits while " + _QUEUE + ")" if over else "")))
    for n in sv.get("notes") or []:
        console.print(f"[yellow]serving plan:[/] {escape(n)}")


_QUEUE = ("its capacity scheduler (GUARANTEED_NO_EVICT) queues new requests until the KV blocks for their prompt and "
          "max_tokens are free; a started request is never evicted")


def _tp_why(doc: dict[str, Any], cap: dict[str, Any]) -> str:
    if not cap.get("tp_chosen_by_planner"):
        return " (build.tp_size)"
    if ((doc.get("serving") or {}).get("profile") or {}).get("chosen"):
        return " (the service profile's choice)"
    return " (the smallest whose KV pool holds the longest workload)"


def print_plan(doc: dict[str, Any], console=None) -> None:
    """The plan (``plan`` verb): each stage's fingerprint and cached/run status, the KV-cache capacity table, and
    what this machine would refuse to build (``console``: stdout by default)."""
    from rich.table import Table

    from pipeline import ui

    console = console or ui.out

    t = Table(title=f"plan: {doc['model']} {doc['quant']} (KV {doc['kv_cache']}) on {doc['target']} / "
                    f"{doc['runtime']}")
    for col in ("stage", "fingerprint", "status"):
        t.add_column(col)
    for r in doc["stages"]:
        t.add_row(r["stage"], r["fingerprint"][:12], "[green]cached[/]" if r["cached"] else
                  f"[yellow]run[/] ({escape(r['reason'])})")
    for line in doc.get("auto") or []:
        console.print(escape(line))
    console.print(t)
    print_paths(console, [(r["stage"], r["output"]) for r in doc["stages"]])
    cap = doc["capacity"]
    if cap:
        reference = doc.get("runtime") == "reference"
        c = Table(title=f"KV-cache capacity per GPU on {doc['target']}: " + (
                        "TP=1 (the reference runtime runs the model on one GPU), weights as TensorRT-LLM would hold "
                        f"them {cap['weights_gb_per_gpu']} GB; the KV fraction is TensorRT-LLM's (the reference "
                        "runtime keeps its own KV cache)" if reference else
                        f"TP={cap['tp']}{_tp_why(doc, cap)}, "
                        f"PP={cap['pp']}, weights {cap['weights_gb_per_gpu']} GB/GPU, free fraction "
                        f"{cap['kv_cache_free_gpu_mem_fraction']}"))
        for col in ("KV dtype", "KiB/token/GPU", "pool GB/GPU", "max tokens", "max sequences"):
            c.add_column(col, justify="right")
        for r in cap["table"]:
            mark = " ←" if r["kv_dtype"] == cap["chosen_kv"] else ""
            c.add_row(r["kv_dtype"] + mark, f"{r['kv_kib_per_token_per_gpu']:.1f}", f"{r['kv_pool_gb_per_gpu']:.1f}",
                      f"{r['max_tokens']:,}", f"{r['max_concurrent_sequences']:,}")
        console.print(c)
        for w in cap["warnings"]:
            console.print(f"[yellow]warning:[/] {escape(w)}")
    cal = doc.get("calibration")
    if cal:
        est = f"~{_duration(cal['estimated_s'])} on {doc['target']}" if cal["estimated_s"] is not None else \
            f"no time estimate for {doc['target']}"
        console.print(escape(f"calibration: {cal['dataset']}, {cal['num_samples']} rows × {cal['seq_len']} tokens "
                             f"({cal['tokens']:,} tokens; size from {cal['basis']}); {est}"))
        for note in (["short of the recipe: " + r for r in cal["short_reasons"]] + cal["notes"][len(
                cal["short_reasons"]):]):
            console.print("[yellow]calibration:[/] " + escape(note))
    rec = doc.get("recipe")
    if rec:
        group = f", group {rec['group_size']}" if rec["group_size"] else ""
        kv = (f"{rec['kv_cache_quant_algo']}{' (constant amax)' if rec['kv_constant_amax'] else ' (calibrated)'}"
              if rec["kv_cache_quant_algo"] else "none")
        console.print(escape(f"recipe: ModelOpt {rec['recipe']} ({rec['algorithm']} calibration): the export carries "
                             f"quant_algo {rec['quant_algo']}{group}, kv_cache_quant_algo {kv} (derived with "
                             f"ModelOpt's export code on a {rec['probe']} stand-in) = quant={rec['format']} "
                             f"quant.kv_cache={rec['kv_format']}"))
        if rec["partial"]:
            console.print("[yellow]recipe:[/] " + escape(f"leaves unquantized beyond quant={rec['format']}'s own "
                                                         f"exclusions: {', '.join(rec['partial'])}"))
    for p in doc["not_buildable_here"]:
        console.print(f"[yellow]build here would be refused:[/] {escape(p)}")
