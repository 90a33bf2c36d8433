"""The launcher class (see the package docstring).

Submitting: one Slurm array per (partition, constraint, GPU count), every array before waiting on any.

Waiting: the arrays' states come from ``squeue`` (the controller's view, which holds finished jobs for ``MinJobAge``
seconds; no accounting database is needed, unlike submitit's own ``sacct`` watcher) and each job's result from the
file submitit's job writes when its function returns. A line on stderr counts the jobs queued, running, done and
failed whenever one of those numbers changes.

Finishing: a summary names the submit directory and, for each job, its Slurm job id, its state and its log. A job
that failed (its build refused or failed, or Slurm ended it before it wrote a result) fails only itself; the others
run to the end, then the sweep exits 1 with one line naming every failed job, its Slurm job id and its log.

Ctrl-C (SIGINT) or SIGTERM on the submitting process cancels every array it submitted (``scancel``), waits until
Slurm has ended them, removes what a cancelled stage may have left half-written in the store (``store.orphans``:
only outputs whose lock no running build holds), and exits 130. In the job, Slurm's cancel (SIGTERM, then SIGKILL
after ``KillWait``) interrupts the running stage the way Ctrl-C does locally: its temp output is removed and its lock
released before the process ends.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf

log = logging.getLogger(__name__)

# Slurm's job states (squeue(1), "JOB STATE CODES"), as this launcher counts them
QUEUED = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "SUSPENDED",
          "STOPPED"}
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "SPECIAL_EXIT", "REVOKED"}
RESULT_GRACE_S = 30  # a job Slurm has ended gets this long for its result file to show (a slow shared filesystem)


def job_resources(overrides: Sequence[str]) -> dict[str, Any]:
    """Slurm partition, constraint and GPU count for one job, from its composed config, and the output folders its
    stages write (where a cancelled job's half-written output is looked for)."""
    from pipeline import planning
    from pipeline.config import compose, resolved_paths

    cfg = compose(list(overrides))
    t = cfg.target
    gpus = planning.resolve(cfg).world if t.device.value == "cuda" else 0  # TP x PP
    paths = resolved_paths(cfg)
    return {"partition": t.slurm.partition or None, "constraint": t.slurm.constraint or None,
            "gpus_per_node": gpus or None, "target": t.name,
            "outputs": [str(paths[k]) for k in ("store", "engines", "triton_repo", "bundles") if k in paths],
            "locks": str(paths["store"] / "locks")}


class JobFailed(Exception):
    """Ends a failed job with an error (submitit keeps its traceback as the job's result; Slurm records FAILED);
    its message is the failure's one line."""


def failure_line(trace: str) -> str:
    """The one line of a failed job from the traceback submitit kept: :class:`JobFailed`'s message, else the
    traceback's last line."""
    lines = [x for x in str(trace).strip().splitlines() if x.strip()]
    for x in reversed(lines):
        head, sep, msg = x.partition(": ")
        if sep and head.endswith("JobFailed"):
            return msg
    return f"failed: {lines[-1]}" if lines else "failed: no traceback"


def timeout_line(timeout_min: Any, signal_delay_s: Any) -> str:
    """The one line of a job that ran into its time limit. submitit asks sbatch to signal the job
    ``signal_delay_s`` before Slurm's limit (``--signal=USR2@...``) and, unless the job may be requeued
    (``max_num_timeout``, 0 here: a stage does not resume half-way), ends it then with "timed-out too many times"."""
    return (f"failed: the job ran into its time limit, hydra.launcher.timeout_min={timeout_min} (Slurm's limit: "
            f"{timeout_min} min; submitit stops the job hydra.launcher.signal_delay_s={signal_delay_s} s before it); "
            f"raise hydra.launcher.timeout_min and run the sweep again (the stages that finished are reused)")


def timed_out(trace: str) -> bool:
    """Whether submitit ended the job at its time limit (its ``UncompletedJobError``: "timed-out ...")."""
    return "UncompletedJobError" in str(trace) and "timed-out" in str(trace)


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def one_line(exc: BaseException) -> str:
    """A failed job's exception as the CLI would print it (``error: ...`` for bad input, ``failed: ...`` else)."""
    from pipeline.errors import PipelineError

    if isinstance(exc, PipelineError):
        return f"{exc.prefix}: {exc}"
    return f"failed: {type(exc).__name__}: {exc}"


class SweepJob:
    """One submitted job of the sweep and what is known of it. (A plain class: Hydra's plugin scan executes this
    module without registering it in ``sys.modules``, which ``dataclasses`` needs.)"""

    def __init__(self, index: int, num: int, label: str, job: Any):
        self.index = index  # position in this launch's job list
        self.num = num  # Hydra's job number (the sweep subdirectory)
        self.label = label
        self.job = job  # submitit's SlurmJob
        self.state = "PENDING"  # Slurm's, as squeue last showed it
        self.ended_at: float | None = None  # when squeue first showed it ended (or lost it) without a result file
        self.outcome = ""  # "done" or "failed" once known
        self.reason = ""
        self.ret: JobReturn | None = None
        self.missing = 0  # polls in a row that squeue did not list it
        self.result_at: float | None = None  # when its result file was read

    def settled(self) -> bool:
        """Its outcome is known and Slurm has ended it (its process writes the result just before it exits)."""
        if not self.outcome:
            return False
        ended = self.state in ENDED or self.missing > 0
        return ended or self.result_at is None or time.monotonic() - self.result_at >= RESULT_GRACE_S

    @property
    def slurm_id(self) -> str:
        return str(self.job.job_id)

    @property
    def array_id(self) -> str:
        return self.slurm_id.split("_")[0]

    @property
    def log(self) -> Path:
        return Path(self.job.paths.stderr)


def squeue_states(array_ids: Sequence[str]) -> dict[str, str] | None:
    """``{job_id: state}`` of every task of the arrays that the controller still holds (pending tasks one by one:
    ``-r``), or None when squeue cannot answer."""
    try:
        proc = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(array_ids), "-o", "%i|%T"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    out = {}
    for line in proc.stdout.splitlines():
        jid, _, state = line.strip().partition("|")
        if jid:
            out[jid] = state.split()[0] if state else ""
    return out


def _varying(jobs: Sequence[Sequence[str]]) -> list[str]:
    """Each job named by its overrides that differ between the sweep's jobs (all of them for a single job)."""
    jobs = [filter_overrides(j) for j in jobs]
    return [" ".join([o for o in j if any(o not in other for other in jobs)] or j) for j in jobs]


class PipelineSlurmLauncher(SlurmLauncher):
    poll_s = (1.0, 15.0)  # the first poll of squeue after this long, growing to at most this long between polls

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Submit one Slurm array per (partition, constraint, GPU count), every array before waiting on any. Job
        numbers (and so the jobs' sweep subdirectories) follow the sweep's order, whatever the grouping."""
        from rich.markup import escape
        from submitit.core.utils import FailedJobError

        from pipeline.ui import console

        assert self.config is not None
        if shutil.which("sbatch") is None:
            console.print("error: hydra/launcher=pipeline_slurm submits with Slurm's sbatch, which is not on PATH "
                          "here; run the sweep on a machine of the cluster (a login node), or use "
                          "hydra/launcher=submitit_local to run it here", markup=False, soft_wrap=True)
            raise SystemExit(2)
        groups: dict[tuple, list[int]] = {}
        resources = [job_resources(o) for o in job_overrides]
        for i, r in enumerate(resources):
            groups.setdefault((r["partition"], r["constraint"], r["gpus_per_node"]), []).append(i)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        submit_dir = Path(str(self.params["submitit_folder"]).split("%j")[0]).resolve()
        log.info(f"Submitit 'slurm' sweep output dir : {sweep_dir}")
        labels = _varying(job_overrides)
        jobs: list[SweepJob] = []
        previous = signal.signal(signal.SIGTERM, _interrupted)  # a CI timeout's SIGTERM cancels like Ctrl-C
        try:
            try:
                for (partition, constraint, gpus), idxs in groups.items():
                    res = {k: v for k, v in (("partition", partition), ("constraint", constraint),
                                             ("gpus_per_node", gpus)) if v is not None}
                    executor = self._executor({**self.params, **res})
                    args = []
                    for i in idxs:
                        num = initial_job_idx + i
                        log.info(f"\t#{num} : {' '.join(filter_overrides(job_overrides[i]))} ({res})")
                        args.append((list(job_overrides[i]), "hydra.sweep.dir", num, f"job_id_for_{num}",
                                     Singleton.get_state()))
                    asked = " ".join(f"--{k.replace('_', '-')}={v}" for k, v in res.items()) or "default partition"
                    try:
                        submitted = executor.map_array(self, *zip(*args))
                    except (FailedJobError, OSError) as exc:  # sbatch refused it (its own line is printed above)
                        self._cancel(jobs, resources)
                        why = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
                        console.print(f"error: Slurm refused the array for {escape(asked)}: {escape(why)}; check "
                                      f"target.slurm (partition, constraint) and hydra.launcher's settings against "
                                      f"the cluster (sinfo)", soft_wrap=True)
                        raise SystemExit(2) from None
                    jobs += [SweepJob(i, initial_job_idx + i, labels[i], job) for i, job in zip(idxs, submitted)]
                    console.print(f"submitted Slurm array {escape(jobs[-1].array_id)}: {len(idxs)} job"
                                  f"{'s' if len(idxs) != 1 else ''} ({escape(asked)})", soft_wrap=True)
                console.print(f"submit dir: {escape(str(submit_dir))}", soft_wrap=True)
                self._wait(jobs)
            except KeyboardInterrupt:
                self._cancel(jobs, resources)
                raise
        finally:
            signal.signal(signal.SIGTERM, previous)
        return self._finish(jobs, len(job_overrides), submit_dir)

    # ------------------------------------------------------------------------------------------------ waiting
    def _wait(self, jobs: list[SweepJob]) -> None:
        from pipeline.ui import console

        arrays = sorted({j.array_id for j in jobs})
        shown, t0 = None, time.monotonic()
        while True:
            states = squeue_states(arrays)
            for j in jobs:
                self._update(j, states)
            counts = self._counts(jobs)
            if counts != shown:
                q, r, d, f = counts
                console.print(f"slurm: {len(jobs)} jobs: {q} queued, {r} running, {d} done, {f} failed",
                              markup=False, highlight=False)
                shown = counts
            if all(j.settled() for j in jobs):
                return
            lo, hi = self.poll_s
            time.sleep(min(hi, lo + (time.monotonic() - t0) / 20))

    @staticmethod
    def _counts(jobs: list[SweepJob]) -> tuple[int, int, int, int]:
        done = sum(j.outcome == "done" for j in jobs)
        failed = sum(j.outcome == "failed" for j in jobs)
        queued = sum(not j.outcome and j.state in QUEUED for j in jobs)
        return queued, len(jobs) - done - failed - queued, done, failed

    def _update(self, j: SweepJob, states: dict[str, str] | None) -> None:
        """Read the job's result file once it exists; else take Slurm's state, and fail a job Slurm has ended (or
        no longer lists) that wrote no result within :data:`RESULT_GRACE_S`."""
        from submitit.core import utils

        if states is not None:
            state = states.get(j.slurm_id)
            j.missing = 0 if state else j.missing + 1
            if state:
                j.state = state
        if j.outcome:
            return
        result = Path(j.job.paths.result_pickle)
        if result.exists():
            try:
                outcome, value = utils.pickle_load(result)
            except EOFError:  # still being moved into place
                return
            j.result_at = time.monotonic()
            if outcome == "success" and isinstance(value, JobReturn):
                j.ret = value
                if value.status == JobStatus.COMPLETED:
                    j.outcome = "done"
                else:
                    j.outcome, j.reason = "failed", one_line(value._return_value)
            else:  # a failed job (JobFailed) or an error outside Hydra's job: submitit keeps the traceback
                j.outcome, j.reason = "failed", (self._timeout_line() if timed_out(value) else failure_line(value))
            return
        gone = j.state in ENDED or j.missing >= 3
        if not gone:
            j.ended_at = None
            return
        now = time.monotonic()
        j.ended_at = j.ended_at or now
        if now - j.ended_at >= RESULT_GRACE_S or j.state in ("CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                                                                 "BOOT_FAIL", "PREEMPTED", "DEADLINE"):
            j.outcome = "failed"
            why = f"Slurm ended it ({j.state})" if j.state in ENDED else "it left Slurm's queue"
            j.reason = self._timeout_line() if j.state == "TIMEOUT" else f"failed: {why} without a result; see its log"

    def _timeout_line(self) -> str:
        return timeout_line(self.params.get("timeout_min"), self.params.get("signal_delay_s"))

    # ------------------------------------------------------------------------------------------------ finishing
    def _finish(self, jobs: list[SweepJob], n: int, submit_dir: Path) -> list[JobReturn]:
        from rich.markup import escape

        from pipeline.ui import console, out

        failed = [j for j in jobs if j.outcome == "failed"]
        out.print(f"Slurm sweep: {len(jobs) - len(failed)} done, {len(failed)} failed; submit dir: "
                  f"{escape(str(submit_dir))}", soft_wrap=True)
        for j in sorted(jobs, key=lambda j: j.num):
            mark = "[green]✓[/]" if j.outcome == "done" else "[red]✗[/]"
            out.print(f"  {mark} #{j.num} {escape(j.label)}  job {escape(j.slurm_id)}  {j.outcome}  "
                      f"log: {escape(str(j.log))}", soft_wrap=True)
            if j.reason:
                out.print(f"      {escape(j.reason)}", soft_wrap=True)
        if failed:
            each = "; ".join(f"#{j.num} {j.label} (Slurm job {j.slurm_id}, log {j.log}): {j.reason}" for j in failed)
            console.print(f"failed: {len(failed)} of {len(jobs)} Slurm jobs failed: {escape(each)}", soft_wrap=True)
            raise SystemExit(1)
        results: list[Any] = [None] * n
        for j in jobs:
            results[j.index] = j.ret
        return results

    def _cancel(self, jobs: list[SweepJob], resources: list[dict[str, Any]]) -> None:
        """scancel every array submitted, wait until Slurm has ended their jobs, then remove what they left
        half-written in the store. A second Ctrl-C stops the wait."""
        from rich.markup import escape

        from pipeline import store
        from pipeline.ui import console

        arrays = sorted({j.array_id for j in jobs})
        if not arrays:
            return
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the cancel itself is not interrupted half-way
        try:
            subprocess.run(["scancel", *arrays], capture_output=True, timeout=60)
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        console.print(f"cancelling Slurm array{'s' if len(arrays) > 1 else ''} {escape(', '.join(arrays))} ...",
                      soft_wrap=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            states = squeue_states(arrays)
            if states is None or all(s in ENDED for s in states.values()):
                break
            time.sleep(1)
        for lock_dir in sorted({r["locks"] for r in resources}):
            roots = [Path(p) for r in resources if r["locks"] == lock_dir for p in r["outputs"]]
            for p in store.remove_orphans(sorted(set(roots)), Path(lock_dir)):
                log.info("removed %s, left by a cancelled job", p)
        console.print(f"cancelled Slurm array{'s' if len(arrays) > 1 else ''} {escape(', '.join(arrays))}",
                      soft_wrap=True)

    # ------------------------------------------------------------------------------------------------ in the job
    def __call__(self, sweep_overrides: list[str], job_dir_key: str, job_num: int, job_id: str,
                 singleton_state: dict) -> JobReturn:
        """The job's body on the node: Hydra's job, with Slurm's SIGTERM (scancel, the time limit) interrupting the
        running stage as Ctrl-C would (its temp output removed, its lock released). A failed job prints its one line
        on its stderr (its log) and ends with an error, so that Slurm records it as FAILED."""
        signal.signal(signal.SIGTERM, _interrupted)
        ret = super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
        if ret.status == JobStatus.FAILED:
            line = one_line(ret._return_value)
            print(line, file=sys.stderr, flush=True)
            raise JobFailed(line)
        return ret

    def _executor(self, params: dict[str, Any]) -> Any:
        """A submitit executor with ``params`` (this launcher's, with one group's resources), set up the way
        submitit's own launcher sets up its executor."""
        import submitit

        init_keys = {"submitit_folder", "max_num_timeout"}
        init = {f"{self._EXECUTOR}_max_num_timeout": params["max_num_timeout"]} if "max_num_timeout" in params else {}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=params["submitit_folder"], **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items()
                                      if k not in init_keys})
        return executor
