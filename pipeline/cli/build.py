"""``build``, ``plan`` and ``validate``: compose the config, preflight it, run the stages, show the report."""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
from typing import Any

from omegaconf import DictConfig

from pipeline.cli import sweep
from pipeline.cli.common import add_overrides, subcommand
from pipeline.errors import UserError

JSON_HELP = "print the result as JSON on stdout (the human-readable output goes to stderr instead)"
MULTIRUN_HELP = ("Hydra multirun: one job per combination of the comma-separated override values; every job is "
                 "checked before any runs (hydra/launcher=NAME picks where they run)")


def register(sub) -> None:
    p = subcommand(sub, "build", help="run every stage that is not cached (fetch -> ... -> publish)",
                   description="Run fetch -> quantize -> build -> package -> bench -> publish for the composed config; "
                               "cached stages are skipped.\n\n"
                               "  until=STAGE        stop after STAGE\n"
                               "  force=[quantize]   re-run the named stages even when cached\n\n"
                               "Progress goes to stderr; the summary to stdout and reports/<label>.md/.json. Exit 1 "
                               "when a stage or gate fails, 2 on bad input.")
    p.add_argument("--json", action="store_true",
                   help="print the build report as JSON on stdout (the summary goes to stderr instead)")
    p.add_argument("-m", "--multirun", action="store_true", help=MULTIRUN_HELP)
    add_overrides(p)
    p.set_defaults(func=_build_or_plan, verb="build")

    p = subcommand(sub, "plan", help="fingerprints and cached/run per stage; does no work",
                   description="Resolve the config; print each stage's fingerprint, whether it is cached and where "
                               "its output goes, the tensor-parallel size and the KV-cache capacity table. Nothing "
                               "is run or written.")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("-m", "--multirun", action="store_true", help=MULTIRUN_HELP)
    add_overrides(p)
    p.set_defaults(func=_build_or_plan, verb="plan")

    p = subcommand(sub, "validate", help="compose every shipped model x quant x target x runtime combination",
                   description="Compose every shipped model x quant x target x runtime combination and report every "
                               "problem at once. Combinations the compatibility rules refuse are listed with the "
                               "reason and do not fail; a config error exits 2. AXIS=OPTION[,OPTION...] keeps only "
                               "those options of an axis (model, quant, target, runtime), e.g. quant=int8_wo: every "
                               "combination of one new format.")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("only", nargs="*", metavar="AXIS=OPTIONS", help="e.g. quant=fp8,nvfp4 target=h100")
    p.set_defaults(func=lambda a: cmd_validate(a.json, a.only))


def _build_or_plan(args: argparse.Namespace) -> None:
    if args.multirun:
        sweep.multirun(args.verb, args.args, functools.partial(run_verb, args.verb, as_json=args.json))
        return
    from pipeline import perfmodel
    from pipeline.hardware import compose  # target/runtime auto: this machine's

    perfmodel.start(args.args)  # NVIDIA's performance model imports while the config is composed

    run_verb(args.verb, compose(args.args, say=args.verb != "plan"), args.json)  # plan shows it in its output


def run_verb(verb: str, cfg: DictConfig, as_json: bool) -> Any:
    """Run one composed job (also a Hydra multirun job's body). Anything unexpected becomes one line, with its
    traceback in the run log."""
    from pipeline import errors, serving_plan

    serving_plan.prewarm(cfg)  # the performance model's tables load while the plan is made
    _warm_code_digests()
    try:
        if verb == "plan":
            return cmd_plan(cfg, as_json)
        return cmd_build(cfg, as_json)
    except errors.PipelineError:
        raise
    except BrokenPipeError:  # stdout's reader went away: end quietly (also inside Hydra's multirun, which would
        from pipeline.cli.common import stdout_gone  # report it as a failed job)

        stdout_gone()
        raise SystemExit(141)
    except Exception as exc:
        raise errors.known(exc) from exc


def _warm_code_digests() -> None:
    """Hash the stages' code (their modules and imports, read with ``ast``) now, while the performance model's
    process loads its tables: the fingerprints then find them done. In this thread: CPython 3.11's ``ast.parse`` is
    not safe beside another thread's (its constructor's depth counter is shared: "SystemError: AST constructor
    recursion depth mismatch", python/cpython#106905), and a thread would overlap nothing more on one GIL."""
    from pipeline.runner.fingerprint import stage_code_digest
    from pipeline.stages import STAGES

    for st in STAGES:
        try:
            stage_code_digest(st)
        except Exception:  # the fingerprint computes it again, and says what failed
            return


def _resolved_now(cfg: DictConfig) -> set[str]:
    """The keys whose recorded ``auto`` resolution is this config's (a sweep's other jobs may name them)."""
    from pipeline.hardware import RESOLVED
    from pipeline.identity import ArtifactKey

    out = set()
    for k, v in (("target", str(cfg.target.name)), ("runtime", ArtifactKey.of(cfg).runtime)):
        if f"=auto -> {v} " in RESOLVED.get(k, ""):
            out.add(k)
    return out


def cmd_plan(cfg: DictConfig, as_json: bool) -> dict[str, Any]:
    from pipeline import report
    from pipeline.runner import executor
    from pipeline.identity import ArtifactKey
    from pipeline.stages import STAGES

    plan = executor.preflight(cfg, STAGES, environment=False)
    here = executor.env_problems(plan)
    rows = [{"stage": p.stage.name, "fingerprint": p.fingerprint, "cached": p.cached, "reason": p.reason,
             "output": str(p.out)} for p in plan.stages]
    key = ArtifactKey.of(cfg)
    from pipeline.upstream import rules

    from pipeline import serving_plan
    from pipeline.config import to_plain
    from pipeline.hardware import RESOLVED

    sp = serving_plan.with_predictions(cfg, plan.capacity)  # the performance model's figures (cached on disk)
    adjusted = [f.message for f in rules.adjustments(cfg, serving_plan.build_settings(to_plain(cfg.build),
                                                                                     sp.settings))]
    auto = [RESOLVED[k] for k in ("target", "runtime") if k in RESOLVED and k in _resolved_now(cfg)]
    doc = {"model": key.model, "quant": key.quant, "kv_cache": key.kv, "target": key.target, "runtime": key.runtime,
           "auto": auto, "tp": plan.capacity.tp, "capacity": plan.capacity.summary, "serving": sp.record(),
           "stages": rows, "not_buildable_here": here, "adjusted": adjusted}
    if any(p.stage.name == "quantize" for p in plan.stages):
        from pipeline import calib

        doc["calibration"] = calib.plan_summary(cfg)
        if cfg.quant.get("recipe"):  # what the recipe's export carries (preflight derived it and refused what fails)
            from pipeline import planning
            from pipeline.quant import recipes

            derived = recipes.derive(str(cfg.quant.recipe), planning.model_type(cfg))
            doc["recipe"] = recipes.summary(derived, recipes.to_formats(derived))
    if as_json:
        print(json.dumps(doc, indent=2))
    else:
        from rich.markup import escape

        from pipeline import ui

        report.print_plan(doc, ui.out)
        report.print_serving(doc, ui.out)
        for a in adjusted:
            ui.out.print(f"[cyan]adjusted:[/] {escape(a)}")
    return doc


def cmd_build(cfg: DictConfig, as_json: bool = False) -> dict[str, Any]:
    """Run every selected stage that is not cached. Progress goes to stderr; the summary to stdout (and
    ``reports/``); with ``as_json`` stdout holds the report as JSON and the summary goes to stderr."""
    from omegaconf import OmegaConf

    from pipeline import errors, report

    from pipeline.runner import executor
    from pipeline.config import resolved_paths
    from pipeline.identity import ArtifactKey
    from pipeline.stages import STAGES
    from pipeline.ui import console, results

    executor.writable_root(cfg)  # an unwritable root: one line, before planning (which memoises digests there)
    plan = executor.preflight(cfg, STAGES)  # every plan-time problem surfaces before anything is written
    paths = resolved_paths(cfg)
    log_path = errors.log_path(paths["store"] / "logs")
    errors.setup_logging(log_path)
    logging.getLogger("pipeline").info("resolved config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
    key = ArtifactKey.of(cfg)
    console.print(f"[bold]build[/] {key.model} · {key.quant} (KV {key.kv}) · {key.target} · {key.runtime}   "
                  f"[dim]log: {log_path}[/]")
    summary = executor.run(plan, console).to_dict()
    path = report.write(summary, paths["reports"])
    report.print_summary(summary, path, results(as_json))
    from pipeline.config import to_plain

    for line in report.serve_lines(summary, to_plain(cfg.serve.openai)):
        results(as_json).print(line, markup=False, soft_wrap=True)
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
    return summary


def refusal_summary(refused: list[dict[str, Any]]) -> list[str]:
    """The expected refusals (a quant a GPU cannot serve, a runtime a target has not) in one line per target: how
    many combinations, and the most common reason with its count (``validate --json`` lists every one)."""
    from collections import Counter

    by_target: dict[str, Counter] = {}
    for r in refused:
        by_target.setdefault(str(r["combination"].get("target")), Counter()).update(r["refused"][:1])
    out = []
    for target, reasons in sorted(by_target.items()):
        n = sum(reasons.values())
        (top, k), *others = reasons.most_common()
        more = f"; {len(others)} other reason{'s' if len(others) != 1 else ''}" if others else ""
        out.append(f"target={target}: {n} combination{'s' if n != 1 else ''} refused by the compatibility rules "
                   f"({k}× {top}{more}; validate --json lists each)")
    return out


def check_combinations(combos: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Compose and plan-check ``combos`` in this process: per combination its config errors and the compatibility
    rules' refusals."""
    from pipeline.config import compose_many
    from pipeline.runner import executor
    from pipeline.stages import STAGES

    results = []
    for combo, cfg in zip(combos, compose_many([[f"{k}={v}" for k, v in c.items()] for c in combos])):
        errors: list[str] = []
        refused: list[str] = []
        if isinstance(cfg, UserError):
            errors = cfg.problems or [str(cfg)]
        else:
            try:
                refused = executor.plan_checks(cfg, STAGES, environment=False)
            except UserError as exc:
                errors = exc.problems or [str(exc)]
        results.append({"combination": combo, "errors": errors, "refused": refused})
    return results


# Below this many combinations, starting processes costs more than it saves.
PARALLEL_FROM = 64


def check_in_parallel(combos: list[dict[str, str]], processes: int = 0) -> list[dict[str, Any]]:
    """:func:`check_combinations` over ``processes`` (0: this machine's CPUs): one task per target (a GPU's performance tables load in
    one process only), handed to whichever process is free; results in the combinations' order. Composing (Hydra)
    is CPU-bound Python, so processes, not threads."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from pipeline import ui

    by_target: dict[str, list[int]] = {}
    for i, c in enumerate(combos):
        by_target.setdefault(str(c.get("target")), []).append(i)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = min(processes or cpus, len(by_target))
    if n < 2 or (not processes and len(combos) < PARALLEL_FROM):
        return check_combinations(combos)
    out: list[dict[str, Any] | None] = [None] * len(combos)
    # spawn: the parent may hold threads (the performance model's readers), which fork would copy mid-state
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool, \
            ui.progress(f"validate: {len(combos)} combinations on {n} processes", len(combos)) as bar:
        tasks = {pool.submit(check_combinations, [combos[i] for i in idx]): idx for idx in by_target.values()}
        for done in as_completed(tasks):
            for i, r in zip(tasks[done], done.result()):
                out[i] = r
            bar.advance(len(tasks[done]))
    return [r for r in out if r is not None]


def cmd_validate(as_json: bool, only: list[str] | None = None) -> int:
    """Compose every shipped combination (``only``: ``AXIS=OPTION[,OPTION]`` filters), over this machine's CPUs.
    Config errors fail (exit 2); combinations the compatibility rules refuse are listed with the reason (they are
    expected, e.g. a quant a GPU cannot serve) and do not fail."""
    from pipeline import perfmodel
    from pipeline.config import combinations

    if perfmodel.available():  # it chooses the settings of every TensorRT-LLM combination on a GPU with tables
        raise UserError(f"validate plans every shipped combination: {perfmodel.available()}")
    filters: dict[str, list[str]] = {}
    for item in only or []:
        axis, sep, options = item.partition("=")
        if not sep or not options:
            raise UserError(f"validate: {item!r} is not AXIS=OPTION[,OPTION...] (e.g. quant=fp8)")
        filters[axis] = [o for o in options.split(",") if o]
    results = check_in_parallel(combinations(filters))
    bad = [r for r in results if r["errors"]]
    refused = [r for r in results if r["refused"] and not r["errors"]]
    if as_json:
        print(json.dumps({"combinations": len(results), "failing": len(bad), "refused": len(refused),
                          "results": results}, indent=2))
    else:
        from rich.markup import escape

        from pipeline.ui import out as console

        for r in results:
            name = " ".join(f"{k}={v}" for k, v in r["combination"].items())
            for p in r["errors"]:
                console.print(f"[red]✗[/] {escape(name)}: {escape(p)}")
        for line in refusal_summary(refused):
            console.print(f"[yellow]–[/] {escape(line)}")
        console.print(f"{len(results) - len(bad)}/{len(results)} combinations compose; {len(refused)} refused by "
                      f"the compatibility rules; {len(bad)} with config errors")
    return 2 if bad else 0
