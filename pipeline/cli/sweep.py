"""``-m``/``--multirun``: check every job of a Hydra sweep, then hand the ones that can run to Hydra's multirun."""
from __future__ import annotations

import sys
from typing import Any, Callable

from omegaconf import DictConfig

from pipeline.errors import UserError

LOCAL_LAUNCHERS = ("basic", "submitit_local", "joblib")  # Hydra launchers that run every job on this machine


def _launcher(overrides: list[str]) -> str:
    """The Hydra launcher a sweep's overrides name (``hydra/launcher=X``), else Hydra's default, ``basic``."""
    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip().lstrip("+~") == "hydra/launcher":
            return value.strip()
    return "basic"


def _job_label(job: list[str], jobs: list[list[str]]) -> str:
    """A job named by the overrides that differ between the sweep's jobs (all of them when there is one job)."""
    varying = [o for o in job if any(o not in other for other in jobs)]
    return " ".join(varying or job)


def multirun(verb: str, overrides: list[str], body: Callable[[DictConfig], Any]) -> None:
    """Check every job of the sweep, then run ``body`` on each one that can run, through Hydra's multirun.

    A config error in any job refuses the sweep (exit 2, nothing launched). A job refused by the plan-time checks
    (e.g. a quant the target's GPU cannot serve) is left out with its reason on stderr, and the rest run; when no
    job is left the sweep is refused. What the machine must provide (its GPU's SM, an installed TensorRT-LLM) is
    checked here only when the launcher runs the jobs here; otherwise each job checks it where it runs.
    ``target``/``runtime`` ``auto`` (given, swept, or left to the defaults) are first replaced by what they resolve
    to here, so Hydra's jobs receive the same values the checks composed."""
    import hydra

    from pipeline import schema

    from pipeline.runner import executor
    from pipeline.config import compose_many, conf_dir, expand_sweeps, shipped_targets
    from pipeline.hardware import resolve_overrides
    from pipeline.stages import STAGES

    overrides = resolve_overrides(overrides, shipped_targets(), say=True)
    jobs = expand_sweeps(overrides)
    runs_here = verb == "build" and _launcher(overrides) in LOCAL_LAUNCHERS
    errors: list[str] = []
    refused: dict[int, list[str]] = {}  # job position -> why it is left out
    for i, (job, cfg) in enumerate(zip(jobs, compose_many(jobs))):
        if isinstance(cfg, UserError):
            errors.append(f"{' '.join(job)}: {cfg}")
            continue
        stages = executor.select(cfg, STAGES)
        problems = executor.plan_checks(cfg, stages, environment=False)
        if not problems and runs_here:
            problems = executor.plan_checks(cfg, stages)
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
        return body(cfg)

    skip = ["hydra/sweeper=pipeline", f"hydra.sweeper.skip=[{','.join(map(str, refused))}]"] if refused else []
    sys.argv = [sys.argv[0], "--multirun", *overrides, *skip]
    task()
