"""``python -m pipeline VERB [--json] [-m] [hydra overrides...]``

Verbs:
  build     run fetch -> quantize -> build -> package -> bench -> publish (cached stages are skipped)
  plan      resolve the config; print each stage's fingerprint and whether it is cached; do no work
  validate  compose every shipped model x quant x target x runtime combination; report every problem at once
  lint      lint REPO [--trtllm-version X | --container IMAGE]: check a Triton model repository (generated or
            hand-edited) against upstream's recorded interface for that TensorRT-LLM version
  serve     serve REPO_OR_BUNDLE [overrides]: stand a repository or published bundle up on Triton (serve.launcher);
            prints the HTTP and gRPC addresses and the ready models, runs until interrupted
  verify    verify BUNDLE_OR_URL [--container IMAGE] [--public-key PEM] [--require-signature]: checksums, signature,
            GPU SM, TRT-LLM/TensorRT versions (of the image, from the recorded pairs); one line each
  diff      diff OLD NEW: size, accuracy, bench and version changes between two bundles (Markdown)
  matrix    matrix [NAME] [--outdated] [overrides]: conf/matrix/NAME.yaml as a CI matrix (impossible entries dropped)
  outdated  outdated [NAME] [overrides]: matrix entries whose fingerprint differs from their latest published bundle
  gc        gc [--dry-run] [overrides]: remove stage outputs no published bundle references, older than gc.max_age_days

``build until=STAGE`` stops after STAGE; ``build force=[quantize]`` re-runs the named stages; ``-m`` sweeps.
Exit codes: 0 ok, 1 a stage or gate failed (report written), 2 bad input (one line on stderr, nothing written).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.errors import StageFailed, UserError

VERBS = ("build", "plan", "validate", "lint", "serve", "verify", "diff", "matrix", "outdated", "gc")
USAGE = __doc__.strip()


def _stages():
    from pipeline.stages import STAGES

    return list(STAGES)


def _selected(cfg: DictConfig) -> list:
    stages = _stages()
    if cfg.until is not None:
        names = [s.name for s in stages]
        stages = stages[: names.index(cfg.until) + 1]
    return stages


def plan_checks(cfg: DictConfig, stages: list, *, environment: bool = True) -> list[str]:
    """Incompatibilities of the config (and, with ``environment``, of this machine) found before any work."""
    problems: list[str] = []
    for st in stages:
        if st.check is not None:
            problems.extend(st.check(cfg))
        if environment and st.env_check is not None:
            problems.extend(st.env_check(cfg))
    return problems


def _plan(cfg: DictConfig, *, environment: bool = True):
    """Fingerprint the selected stages after every plan-time check: config incompatibilities first (alone), then,
    with ``environment``, what this machine lacks to run them."""
    from pipeline import runner

    stages = _selected(cfg)
    problems = plan_checks(cfg, stages, environment=False)
    if not problems and environment:
        problems = plan_checks(cfg, stages)
    if problems:
        raise UserError(problems[0] if len(problems) == 1 else "; ".join(problems), problems=problems)
    return runner.plan(cfg, stages)


def cmd_plan(cfg: DictConfig, as_json: bool) -> dict[str, Any]:
    planned = _plan(cfg, environment=False)
    here = [p for st in _selected(cfg) if st.env_check for p in st.env_check(cfg)]
    rows = [{"stage": p.stage.name, "fingerprint": p.fingerprint, "cached": p.cached, "reason": p.reason,
             "output": str(p.out)} for p in planned]
    from pipeline import planning

    cap = planning.summary(cfg)
    doc = {"model": cfg.model.name, "quant": cfg.quant.format.value, "kv_cache": cfg.quant.kv_cache.value,
           "target": cfg.target.name, "runtime": cfg.runtime.name.value, "tp": planning.effective_tp(cfg),
           "capacity": cap, "stages": rows, "not_buildable_here": here}
    if as_json:
        print(json.dumps(doc, indent=2))
    else:
        from rich.table import Table

        from pipeline.ui import console

        t = Table(title=f"plan: {doc['model']} {doc['quant']} (KV {doc['kv_cache']}) on {doc['target']} / "
                        f"{doc['runtime']}")
        for col in ("stage", "fingerprint", "status", "output"):
            t.add_column(col)
        for r in rows:
            t.add_row(r["stage"], r["fingerprint"][:12], "[green]cached[/]" if r["cached"] else
                      f"[yellow]run[/] ({r['reason']})", r["output"])
        console.print(t)
        if cap:
            c = Table(title=f"KV-cache capacity per GPU on {doc['target']}: TP={cap['tp']}"
                            f"{' (chosen by the planner)' if cap['tp_chosen_by_planner'] else ''}, PP={cap['pp']}, "
                            f"weights {cap['weights_gb_per_gpu']} GB/GPU, free fraction "
                            f"{cap['kv_cache_free_gpu_mem_fraction']}")
            for col in ("KV dtype", "KiB/token/GPU", "pool GB/GPU", "max tokens", "max sequences"):
                c.add_column(col, justify="right")
            for r in cap["table"]:
                mark = " ←" if r["kv_dtype"] == cap["chosen_kv"] else ""
                c.add_row(r["kv_dtype"] + mark, f"{r['kv_kib_per_token_per_gpu']:.1f}", f"{r['kv_pool_gb_per_gpu']:.1f}",
                          f"{r['max_tokens']:,}", f"{r['max_concurrent_sequences']:,}")
            console.print(c)
            for w in cap["warnings"]:
                console.print(f"[yellow]warning:[/] {w}")
        for p in here:
            console.print(f"[yellow]build here would be refused:[/] {p}")
    return doc


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_build(cfg: DictConfig, as_json: bool = False) -> dict[str, Any]:
    """Run every selected stage that is not cached. The summary goes to stderr (and ``reports/``); with ``as_json``
    the report is also printed as JSON on stdout."""
    from omegaconf import OmegaConf

    from pipeline import runner, store
    from pipeline.config import resolved_paths
    from pipeline.ui import console

    planned_list = _plan(cfg)  # every plan-time problem surfaces before anything is written
    log_path = _log_path(cfg)
    _setup_logging(log_path)
    logging.getLogger("pipeline").info("resolved config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
    planned = {p.stage.name: p for p in planned_list}
    console.print(f"[bold]build[/] {cfg.model.name} · {cfg.quant.format.value} (KV {cfg.quant.kv_cache.value}) · "
                  f"{cfg.target.name} · {cfg.runtime.name.value}   [dim]log: {log_path}[/]")
    rows = []
    t_all = time.perf_counter()
    for ps in planned_list:
        t0 = time.perf_counter()
        if ps.cached:
            manifest = store.read_manifest(ps.out) or {}
            status = "cached"
        else:
            console.print(f"[bold cyan]▶ {ps.stage.name}[/] [dim]({ps.reason})[/]")
            runner.upstream_missing(ps, planned)
            with _quiet(log_path, ps.stage.name):
                manifest = runner.execute(cfg, ps, planned, console)
            status = "cached" if ps.cached else "ran"  # a concurrent run may have built it while we waited
        elapsed = time.perf_counter() - t0
        size = sum(f["size"] for f in manifest.get("files", []))
        rows.append({"stage": ps.stage.name, "status": status, "seconds": round(elapsed, 2),
                     "stage_wall_s": manifest.get("wall_s"), "peak_rss_mb": manifest.get("peak_rss_mb"),
                     "bytes": size, "output": str(ps.out), "fingerprint": ps.fingerprint, "result":
                     manifest.get("result", {})})
        if status == "ran":
            console.print(f"  [green]✓[/] {ps.stage.name} {elapsed:.1f}s → {ps.out}")
        logging.getLogger("pipeline").info("stage %s: %s (%.2fs) %s", ps.stage.name, status, elapsed, ps.out)
    published = None
    if "publish" in planned:
        from pipeline.stages.publish import upload

        published = upload(planned["publish"].out, str(cfg.publish.dest),
                           lock_dir=resolved_paths(cfg)["store"] / "locks")
        logging.getLogger("pipeline").info("published: %s", published)
    summary = {"model": cfg.model.name, "quant": cfg.quant.format.value, "kv_cache": cfg.quant.kv_cache.value,
               "published": published,
               "target": cfg.target.name, "runtime": cfg.runtime.name.value, "total_s": round(time.perf_counter()
                                                                                            - t_all, 2),
               "stages": rows, "log": str(log_path),
               "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    report = write_report(summary, resolved_paths(cfg)["reports"])
    print_summary(summary, report)
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
    return summary


@contextlib.contextmanager
def _quiet(log_path: Path, stage: str | None = None):
    """While a stage runs: library prints (ModelOpt is chatty on stdout), Python warnings and the libraries' log
    records go to the run log; the console shows the stage's one progress display (see ``pipeline.ui``)."""
    from pipeline import ui

    logging.captureWarnings(True)
    ui.route_library_logs()
    with open(log_path, "a") as f, contextlib.redirect_stdout(f), ui.stage(stage or "working"):
        yield


def write_report(summary: dict[str, Any], reports_dir: Path) -> Path:
    from pipeline import store

    reports_dir.mkdir(parents=True, exist_ok=True)
    label = f"{summary['model']}.{summary['quant']}-kv{summary['kv_cache']}.{summary['target']}.{summary['runtime']}"
    path = reports_dir / f"{label}.md"
    store.write_text_atomic(path, report_markdown(summary))
    store.write_json_atomic(reports_dir / f"{label}.json", summary)
    return path


def _bench_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Every (workload, level) row of the bench stage's result."""
    for r in summary["stages"]:
        if r["stage"] == "bench":
            return [{"workload": w, **lv} for w, rows in r["result"].get("workloads", {}).items() for lv in rows]
    return []


def _bench_gate(summary: dict[str, Any]) -> str | None:
    """The bench stage's gate verdict and regression baseline, one line (None without a bench result)."""
    from pipeline.stages.bench import baseline_line

    for r in summary["stages"]:
        g = r["result"].get("gates") if r["stage"] == "bench" else None
        if g:
            return f"Bench gate: {g['verdict']} (entry point {r['result'].get('model')}). {baseline_line(g)}"
    return None


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def report_markdown(s: dict[str, Any]) -> str:
    lines = [f"# build report: {s['model']} · {s['quant']} (KV {s['kv_cache']}) · {s['target']} · {s['runtime']}", "",
             f"Finished {s['finished']} in {s['total_s']} s. Log: `{s['log']}`", "",
             "| stage | status | time (s) | peak RSS (MB) | size | output |", "|---|---|---|---|---|---|"]
    for r in s["stages"]:
        t = r["seconds"] if r["status"] == "ran" else f"{r['seconds']} (built in {r['stage_wall_s']})"
        lines.append(f"| {r['stage']} | {r['status']} | {t} | {_fmt(r['peak_rss_mb'])} | {_human(r['bytes'])} | "
                     f"`{r['output']}` |")
    if s.get("published"):
        p = s["published"]
        lines += ["", f"Published `{p['url']}` ({p['uploaded_files']} files uploaded; `latest` "
                      f"{'moved' if p['latest_moved'] else 'not moved: a gate did not pass'})."]
    bench = _bench_rows(s)
    if bench:
        lines += ["", "| workload | concurrency | requests | errors | TTFT p50 (ms) | ITL p50 (ms) | latency p95 (ms) | "
                      "output tok/s | req/s |", "|---|---|---|---|---|---|---|---|---|"]
        for lv in bench:
            lines.append(f"| {lv['workload']} | {lv['concurrency']} | {lv['request_count']} | {lv['error_count']} | "
                         f"{_fmt(lv['ttft_p50_ms'])} | {_fmt(lv['itl_p50_ms'])} | {_fmt(lv['latency_p95_ms'])} | "
                         f"{_fmt(lv['output_tokens_per_s'])} | {_fmt(lv['requests_per_s'], '.2f')} |")
    if _bench_gate(s):
        lines += ["", _bench_gate(s)]
    for r in s["stages"]:
        if r["stage"] == "quantize" and r["result"].get("accuracy"):
            a = r["result"]["accuracy"]
            q, e = a["quantized_vs_unquantized"], a["exported_vs_fake_quant"]
            lines += ["", f"Accuracy (held-out): quantized vs unquantized KL {q['kl_mean']:.4f}, top-1 "
                          f"{q['top1_agreement']:.3f}, perplexity ratio {q['ppl_ratio']:.3f}; export check "
                          f"{a['export_check']} (KL {e['kl_mean']:.4f} vs fake-quant)."]
    return "\n".join(lines) + "\n"


def print_summary(s: dict[str, Any], report: Path) -> None:
    from rich.table import Table

    from pipeline.ui import console

    t = Table(title="stages")
    for col in ("stage", "status", "time", "size", "output"):
        t.add_column(col, overflow="fold")
    for r in s["stages"]:
        st = "[green]ran[/]" if r["status"] == "ran" else "[dim]cached[/]"
        t.add_row(r["stage"], st, f"{r['seconds']:.1f}s", _human(r["bytes"]), r["output"])
    console.print(t)
    bench = _bench_rows(s)
    if bench:
        b = Table(title="bench (streaming gRPC)")
        for col in ("workload", "concurrency", "errors", "TTFT p50 ms", "ITL p50 ms", "latency p95 ms", "tok/s",
                    "req/s"):
            b.add_column(col, justify="right")
        for lv in bench:
            b.add_row(lv["workload"], str(lv["concurrency"]), str(lv["error_count"]), _fmt(lv["ttft_p50_ms"]),
                      _fmt(lv["itl_p50_ms"]), _fmt(lv["latency_p95_ms"]), _fmt(lv["output_tokens_per_s"]),
                      _fmt(lv["requests_per_s"], ".2f"))
        console.print(b)
    if _bench_gate(s):
        console.print(_bench_gate(s).replace("**", ""), markup=False)
    p = s.get("published")
    if p:
        console.print(f"published {p['url']} ({p['uploaded_files']} files uploaded; latest "
                      f"{'moved' if p['latest_moved'] else 'not moved: a gate did not pass'})")
    console.print(f"total {s['total_s']:.1f}s · report: {report}")


def cmd_validate(as_json: bool) -> int:
    """Compose every shipped combination. Config errors fail (exit 2); combinations the compatibility rules refuse
    are listed with the reason (they are expected, e.g. a quant a GPU cannot serve) and do not fail."""
    from pipeline.config import combinations, compose_many

    combos = combinations()
    results = []
    for combo, cfg in zip(combos, compose_many([[f"{k}={v}" for k, v in c.items()] for c in combos])):
        errors: list[str] = []
        refused: list[str] = []
        if isinstance(cfg, UserError):
            errors = cfg.problems or [str(cfg)]
        else:
            try:
                refused = plan_checks(cfg, _stages(), environment=False)
            except UserError as exc:
                errors = exc.problems or [str(exc)]
        results.append({"combination": combo, "errors": errors, "refused": refused})
    bad = [r for r in results if r["errors"]]
    refused = [r for r in results if r["refused"] and not r["errors"]]
    if as_json:
        print(json.dumps({"combinations": len(results), "failing": len(bad), "refused": len(refused),
                          "results": results}, indent=2))
    else:
        from pipeline.ui import console

        for r in results:
            name = " ".join(f"{k}={v}" for k, v in r["combination"].items())
            for p in r["errors"]:
                console.print(f"[red]✗[/] {name}: {p}")
            for p in r["refused"]:
                console.print(f"[yellow]–[/] {name}: refused by the compatibility rules: {p}")
        console.print(f"{len(results) - len(bad)}/{len(results)} combinations compose; {len(refused)} refused by "
                      f"the compatibility rules; {len(bad)} with config errors")
    return 2 if bad else 0


def cmd_lint(args: list[str]) -> int:
    """Print every finding, one per line; exit 2 when there is any (a repository that would fail to serve)."""
    from pipeline.triton import lint

    version, args = _flag(args, "--trtllm-version", value=True)
    container, args = _flag(args, "--container", value=True)
    mount, args = _flag(args, "--repo-mount", value=True)
    if len(args) != 1:
        raise UserError("usage: python -m pipeline lint REPO [--trtllm-version X | --container IMAGE] "
                        "[--repo-mount /models]")
    findings = lint.lint(Path(args[0]), trtllm_version=version, repo_mount=mount or lint.REPO_MOUNT,
                         container=container)
    for f in findings:
        print(f"error: {f}", file=sys.stderr)
    if not findings:
        print(f"ok: {args[0]}")
    return 2 if findings else 0


def serve_target(where: str) -> Path:
    """The model repository of a repository directory or a published bundle (``triton_repo/``; a bundle base with
    ``latest`` resolves to that version)."""
    p = Path(where)
    if p.is_file() and p.name == "bundle.json":
        p = p.parent
    if not p.is_dir():
        raise UserError(f"{where}: no such directory; give a model repository or a published bundle (download a "
                        f"remote bundle first)")
    if (p / "latest").is_file() and not (p / "bundle.json").is_file():
        p = p / (p / "latest").read_text().strip()
    if (p / "bundle.json").is_file():
        p = p / "triton_repo"
    if not any(p.glob("*/config.pbtxt")):
        raise UserError(f"{where}: neither a model repository (*/config.pbtxt) nor a bundle (triton_repo/)")
    return p


def cmd_serve(args: list[str]) -> int:
    """Serve until SIGINT/SIGTERM; the server is stopped on every exit path."""
    import json as _json
    import signal
    import tempfile
    import urllib.request

    from pipeline.config import compose
    from pipeline.stages.package import ENTRY_POINTS
    from pipeline.triton import lint, server

    where = [a for a in args if "=" not in a or Path(a).exists()]
    overrides = [a for a in args if a not in where]
    if len(where) != 1:
        raise UserError("usage: python -m pipeline serve REPO_OR_BUNDLE [serve.launcher=local|docker] [overrides]")
    repo = serve_target(where[0]).resolve()
    cfg = compose(overrides)
    if cfg.serve.launcher.value == "external":
        raise UserError("serve.launcher=external points at a server that already runs; use local or docker")
    layout = lint.layout_of({d.name: d for d in repo.iterdir() if d.is_dir()})

    def _stop(signum, frame):
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}  # SIGINT too: a
    # background job starts with it ignored
    work = Path(tempfile.mkdtemp(prefix="pipeline-serve-"))
    try:
        with server.launched(cfg.serve, repo, work) as s:
            req = urllib.request.Request(f"{s.http_url}/v2/repository/index", data=b"{}", method="POST")
            with urllib.request.urlopen(req, timeout=10) as r:
                index = _json.loads(r.read())
            ready = sorted(m["name"] for m in index if m.get("state") == "READY")
            print(f"serving {repo} ({layout} layout; entry points: {', '.join(ENTRY_POINTS[layout])})")
            print(f"HTTP  {s.http_url}")
            print(f"gRPC  {s.grpc_url}")
            print(f"ready {', '.join(ready)}")
            print("stop with Ctrl-C (SIGINT) or SIGTERM", flush=True)
            while s.alive():
                time.sleep(0.5)
            print(f"error: the server exited; its log {s.log_path}:\n{s.log_tail()}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print("stopped", flush=True)
        return 0
    except server.ServerError as exc:
        raise UserError(f"the server did not start: {exc}") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _flag(args: list[str], name: str, value: bool = False) -> tuple[Any, list[str]]:
    if name not in args:
        return (None if value else False), args
    i = args.index(name)
    if not value:
        return True, args[:i] + args[i + 1:]
    if i + 1 >= len(args):
        raise UserError(f"{name} needs a value")
    return args[i + 1], args[:i] + args[i + 2:]


def cmd_verify(args: list[str], as_json: bool) -> int:
    from pipeline import bundle

    container, args = _flag(args, "--container", value=True)
    public_key, args = _flag(args, "--public-key", value=True)
    require, args = _flag(args, "--require-signature")
    chain: list[str] = []
    while "--certificate-chain" in args:
        cert, args = _flag(args, "--certificate-chain", value=True)
        chain.append(cert)
    if len(args) != 1 or args[0].startswith("--"):
        raise UserError("usage: python -m pipeline verify BUNDLE_DIR_OR_URL [--container IMAGE] "
                        "[--public-key PEM | --certificate-chain PEM ...] [--require-signature]")
    checks = bundle.verify(args[0], container=container, public_key=public_key, certificate_chain=chain,
                           require_signature=require)
    failed = [c for c in checks if c[1] is False]
    if as_json:
        print(json.dumps([{"check": n, "ok": ok, "message": m} for n, ok, m in checks], indent=2))
    else:
        for name, ok, msg in checks:
            print(f"{'PASS' if ok else 'SKIP' if ok is None else 'FAIL'} {name}: {msg}")
    return 1 if failed else 0


def cmd_diff(args: list[str], as_json: bool) -> int:
    from pipeline import bundle

    if len(args) != 2:
        raise UserError("usage: python -m pipeline diff OLD_BUNDLE NEW_BUNDLE")
    print(bundle.diff(args[0], args[1]), end="")
    return 0


def _matrix_args(args: list[str]) -> tuple[str, list[str]]:
    name = args[0] if args and "=" not in args[0] and not args[0].startswith("-") else "default"
    return name, [a for a in args if "=" in a]


def cmd_matrix(args: list[str], as_json: bool) -> int:
    from pipeline import fleet

    only_outdated, args = _flag(args, "--outdated")
    name, overrides = _matrix_args(args)
    keep, drop = fleet.entries(name, overrides)
    doc = fleet.ci_matrix(keep, drop)
    if only_outdated:
        here = [fleet.judged_here(e["_cfg"]) for e in keep]
        stale = {tuple(e["overrides"]) for e in fleet.outdated([e for e, ok in zip(keep, here) if ok])}
        for e in (e for e, ok in zip(keep, here) if not ok):
            stale.add(tuple(e["overrides"]))
            print(f"deferred {_entry_name(e)}: judged on its runner by `outdated --entry` (its GPU and libraries "
                  f"enter the fingerprint)", file=sys.stderr)
        doc["include"] = [e for e in doc["include"] if tuple(e["overrides"]) in stale]
    print(json.dumps(doc, separators=(",", ":")))
    return 0


def _entry_name(e: dict[str, Any]) -> str:
    return " ".join(f"{k}={e[k]}" for k in ("model", "quant", "target", "runtime") if k in e)


def cmd_outdated(args: list[str], as_json: bool) -> int:
    from pipeline import fleet
    from pipeline.config import compose

    entry, args = _flag(args, "--entry")
    if entry:  # one entry given by its overrides, judged on this machine (a scheduled job on the entry's runner)
        st = fleet.entry_status(compose(args))
        if as_json:
            print(json.dumps(st, indent=2))
        elif st["outdated"]:
            print(f"outdated: {'; '.join(st['why'])} (would publish {st['version']})")
        else:
            print(f"up to date: {st['version']} is published")
        return 0
    name, overrides = _matrix_args(args)
    keep, _ = fleet.entries(name, overrides)
    stale = fleet.outdated(keep)
    if as_json:
        print(json.dumps(stale, indent=2))
    else:
        for e in stale:
            print(f"{e['model']} {e['quant']} {e['target']} {e['runtime']}: {'; '.join(e['why'])}")
        print(f"{len(stale)} of {len(keep)} entries outdated")
    return 0


def cmd_gc(args: list[str], as_json: bool) -> int:
    from pipeline import fleet
    from pipeline.config import compose

    dry, args = _flag(args, "--dry-run")
    cfg = compose(args)
    res = fleet.gc(cfg, float(cfg.gc.max_age_days), dry_run=dry)
    if as_json:
        print(json.dumps(res, indent=2))
    else:
        for p in res["removed"]:
            print(f"{'would remove' if dry else 'removed'} {p}")
        print(f"{len(res['removed'])} outputs {'to remove' if dry else 'removed'} ({_human(res['freed_bytes'])}), "
              f"{res['kept']} kept")
    return 0


FLEET_VERBS = {"verify": cmd_verify, "diff": cmd_diff, "matrix": cmd_matrix, "outdated": cmd_outdated, "gc": cmd_gc}


def _log_path(cfg: DictConfig | None) -> Path:
    from pipeline.config import resolved_paths

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = resolved_paths(cfg)["store"] / "logs" if cfg is not None else Path(os.environ.get("TMPDIR", "/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    return base / f"{stamp}-{os.getpid()}.log"


def _setup_logging(log_path: Path) -> None:
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def run_verb(verb: str, cfg: DictConfig, as_json: bool) -> Any:
    """Run one composed job (also the Hydra multirun task body)."""
    try:
        if verb == "plan":
            return cmd_plan(cfg, as_json)
        return cmd_build(cfg, as_json)
    except (UserError, StageFailed):
        raise
    except OSError as exc:
        import errno

        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            what = {errno.ENOSPC: "no space left on the device", errno.EFBIG: "the file size limit was reached",
                    errno.EDQUOT: "the disk quota is exhausted"}[exc.errno]
            raise StageFailed(f"{what} writing {exc.filename or 'an output'}; nothing was published (free space or "
                              f"move paths.root)") from exc
        raise _internal(exc) from exc
    except Exception as exc:
        raise _internal(exc) from exc


def _internal(exc: BaseException) -> "InternalError":
    """An unexpected error: the traceback goes to the run log, the user gets one line naming it."""
    log_path = _current_log() or _log_path(None)
    with open(log_path, "a") as f:
        traceback.print_exception(exc, file=f)
    return InternalError(f"{type(exc).__name__}: {exc} (traceback in {log_path})")


def _current_log() -> Path | None:
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler):
            return Path(h.baseFilename)
    return None


class InternalError(Exception):
    exit_code = 1


LOCAL_LAUNCHERS = ("basic", "submitit_local", "joblib")  # Hydra launchers that run every job on this machine


def _launcher(overrides: list[str]) -> str:
    """The Hydra launcher a sweep's overrides name (``hydra/launcher=X``), else Hydra's default, ``basic``."""
    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip().lstrip("+~") == "hydra/launcher":
            return value.strip()
    return "basic"


def _resolve_auto_target(overrides: list[str]) -> list[str]:
    """``target``/``runtime`` ``auto`` (given, among swept values such as ``target=auto,h100``, or left to the
    defaults) replaced by what they resolve to here, so Hydra's jobs receive the same values the pre-launch checks
    composed."""
    from pipeline.hardware import resolve_overrides

    return resolve_overrides(overrides, say=True)


def _job_label(job: list[str], jobs: list[list[str]]) -> str:
    """A job named by the overrides that differ between the sweep's jobs (all of them when there is one job)."""
    varying = [o for o in job if any(o not in other for other in jobs)]
    return " ".join(varying or job)


def _multirun(verb: str, overrides: list[str], as_json: bool) -> None:
    """Check every job of the sweep, then hand the ones that can run to Hydra's multirun.

    A config error in any job refuses the sweep (exit 2, nothing launched). A job refused by the plan-time checks
    (e.g. a quant the target's GPU cannot serve) is left out with its reason on stderr, and the rest run; when no
    job is left the sweep is refused. What the machine must provide (its GPU's SM, an installed TensorRT-LLM) is
    checked here only when the launcher runs the jobs here; otherwise each job checks it where it runs."""
    import hydra

    from pipeline import schema
    from pipeline.config import compose_many, conf_dir, expand_sweeps

    overrides = _resolve_auto_target(overrides)
    jobs = expand_sweeps(overrides)
    runs_here = verb == "build" and _launcher(overrides) in LOCAL_LAUNCHERS
    errors: list[str] = []
    refused: dict[int, list[str]] = {}  # job position -> why it is left out
    for i, (job, cfg) in enumerate(zip(jobs, compose_many(jobs))):
        if isinstance(cfg, UserError):
            errors.append(f"{' '.join(job)}: {cfg}")
            continue
        problems = plan_checks(cfg, _selected(cfg), environment=False)
        if not problems and runs_here:
            problems = plan_checks(cfg, _selected(cfg))
        if problems:
            refused[i] = problems
    if not errors and len(refused) == len(jobs):
        errors = [f"{' '.join(jobs[i])}: {p}" for i, problems in refused.items() for p in problems]
    if errors:
        raise UserError(errors[0] if len(errors) == 1 else f"{len(errors)} problems: " + "; ".join(errors))
    for i, problems in refused.items():
        print(f"skipped {_job_label(jobs[i], jobs)}: {'; '.join(problems)}", file=sys.stderr)
    schema.register()

    @hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
    def task(cfg: DictConfig) -> Any:
        return run_verb(verb, cfg, as_json)

    skip = ["hydra/sweeper=pipeline", f"hydra.sweeper.skip=[{','.join(map(str, refused))}]"] if refused else []
    sys.argv = [sys.argv[0], "--multirun", *overrides, *skip]
    task()


def main(argv: list[str] | None = None) -> None:
    import signal

    if hasattr(signal, "SIGXFSZ"):  # a file-size limit becomes an EFBIG error (a clean failure), not a kill
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    from pipeline.ui import quiet_third_party_progress

    quiet_third_party_progress()  # before any library that draws progress bars is imported
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    verb, rest = argv[0], argv[1:]
    as_json = "--json" in rest
    multirun = any(a in ("-m", "--multirun") for a in rest)
    overrides = [a for a in rest if a not in ("--json", "-m", "--multirun")]
    try:
        if verb not in VERBS:
            raise UserError(f"unknown verb '{verb}'; choose one of: {', '.join(VERBS)}")
        if verb == "validate":
            sys.exit(cmd_validate(as_json))
        if verb == "lint":
            sys.exit(cmd_lint(overrides))
        if verb == "serve":
            sys.exit(cmd_serve(overrides))
        if verb in ("verify", "diff", "matrix", "outdated", "gc"):
            sys.exit(FLEET_VERBS[verb](overrides, as_json))
        if multirun:
            _multirun(verb, overrides, as_json)
        else:
            from pipeline.config import compose

            run_verb(verb, compose(overrides), as_json)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except (StageFailed, InternalError) as exc:
        print(f"failed: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
