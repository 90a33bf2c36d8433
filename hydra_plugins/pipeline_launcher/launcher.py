"""The launcher class (see the package docstring).

Submitting: one Slurm array per (partition, constraint, GPU count, CPUs, memory), every array before waiting on any.
Each job asks for the CPUs and host memory its plan needs (:func:`pipeline.capacity.job_host_needs`: the processes
it runs at once, the bf16 checkpoint it loads and its own process's memory), unless ``hydra.launcher.cpus_per_task``
/ ``mem_gb`` (or a per-GPU or per-CPU form) is set; the line after each array's says where each number came from.

Waiting: the arrays' states come from ``squeue`` (the controller's view, which holds finished jobs for ``MinJobAge``
seconds; no accounting database is needed, unlike submitit's own ``sacct`` watcher) and each job's result from the
file submitit's job writes when its function returns. A line on stderr counts the jobs queued (with squeue's reason
for the wait: ``Resources``, ``Priority``, ...), running, done and failed, with the time since the sweep was
submitted, whenever one of those numbers changes and at least every ``hydra.launcher.heartbeat_s`` (120 s) between.

Finishing: a summary names the submit directory and, for each job, its Slurm job id, its state and its log. A job
that failed (its build refused or failed, or Slurm ended it before it wrote a result) fails only itself; the others
run to the end, then the sweep exits 1 with one line naming every failed job, its Slurm job id and its log.

Ctrl-C (SIGINT) or SIGTERM on the submitting process cancels every array it submitted (``scancel``), waits until
Slurm has ended them, removes what a cancelled stage may have left half-written in the store (``store.orphans``:
only outputs whose lock no running build holds), writes the summary (each job done, failed, or cancelled) and exits
130. In the job, Slurm's cancel (SIGTERM, then SIGKILL after ``KillWait``) interrupts the running stage the way
Ctrl-C does locally: its temp output is removed and its lock released before the process ends.

SIGHUP (the terminal closed) cancels nothing: the submitter writes one line on stderr naming the arrays, which run
on, and exits 129. Running the same sweep again is the resume: its jobs take the stage outputs the first ones
finished from the store (the same fingerprints) and wait on the lock of a stage one of them is still building.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from hydra_plugins.pipeline_launcher.config import PipelineSlurmConf
from omegaconf import OmegaConf

log = logging.getLogger(__name__)

# Slurm's job states (squeue(1), "JOB STATE CODES"), as this launcher counts them
QUEUED = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "SUSPENDED",
          "STOPPED"}
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "SPECIAL_EXIT", "REVOKED"}
RESULT_GRACE_S = 30  # a job Slurm has ended gets this long for its result file to show (a slow shared filesystem)


def job_resources(overrides: Sequence[str]) -> dict[str, Any]:
    """Slurm partition, constraint and GPU count for one job, from its composed config; the CPUs and host memory its
    plan needs (``cpus_per_task``, ``mem_gb``, each with where it comes from in ``sizing``:
    :func:`pipeline.capacity.job_host_needs`); and the output folders its stages write (where a cancelled job's
    half-written output is looked for)."""
    from pipeline import capacity, planning
    from pipeline.config import compose, resolved_paths
    from pipeline.runner import executor
    from pipeline.stages import STAGES

    cfg = compose(list(overrides))
    t = cfg.target
    gpus = planning.resolve(cfg).world if t.device.value == "cuda" else 0  # TP x PP
    stages = executor.select(cfg, STAGES)
    serves = any(s.serves for s in stages)
    ranks = gpus if cfg.runtime.name.value != "reference" and (serves or "build" in [s.name for s in stages]) else 0
    host = capacity.job_host_needs(float(cfg.model.shape.get("params_b") or 0), device=t.device.value, ranks=ranks,
                                   serves=serves)
    paths = resolved_paths(cfg)
    return {"partition": t.slurm.partition or None, "constraint": t.slurm.constraint or None,
            "gpus_per_node": gpus or None, "target": t.name,
            "cpus_per_task": host["cpus_per_task"][0], "mem_gb": host["mem_gb"][0],
            "sizing": {k: why for k, (_, why) in host.items()},
            "outputs": [str(paths[k]) for k in ("store", "engines", "triton_repo", "bundles") if k in paths],
            "locks": str(paths["store"] / "locks")}


# The launcher's own settings (PipelineSlurmConf), which are no sbatch option: kept from submitit's executor
OWN_PARAMS = ("heartbeat_s",)
# What a setting under hydra.launcher stands in for: a per-GPU or per-CPU form excludes the per-job one
HOST_KEYS = {"cpus_per_task": ("cpus_per_task", "cpus_per_gpu"), "mem_gb": ("mem_gb", "mem_per_cpu", "mem_per_gpu")}


def host_resources(params: dict[str, Any], job: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``cpus_per_task`` and ``mem_gb`` for a job (``job``: :func:`job_resources`): the plan's, unless the user set
    it (or a per-GPU/per-CPU form of it) under ``hydra.launcher``; and for each, where it came from."""
    out, notes = {}, []
    for key, given_as in HOST_KEYS.items():
        given = next((k for k in given_as if params.get(k) is not None), None)
        if given == key:
            out[key] = params[key]
        if given:
            notes.append(f"{sbatch_flag(given, params[given])} from hydra.launcher.{given}")
        else:
            out[key] = job[key]
            notes.append(f"{sbatch_flag(key, job[key])} from the plan: {job['sizing'][key]}")
    return out, notes


def sbatch_flag(key: str, value: Any) -> str:
    """A launcher setting as the sbatch option submitit writes for it (``mem_gb=4`` is ``--mem=4GB``)."""
    if key == "mem_gb":
        return f"--mem={value}GB"
    return f"--{key.replace('_', '-')}={value}"


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


def signalled_at_time_limit(log: str) -> bool:
    """Whether the job's stderr log shows srun's task killed by SIGUSR2, the signal submitit asks sbatch to send
    before the time limit, arriving before submitit's job had set its handler (while it was still loading). Slurm
    may send it up to 60 s before the requested time (``man sbatch``, ``--signal``), so a short limit can signal a job
    that is still starting; it then dies without the "timed-out" result."""
    return re.search(r"^srun: error: \S+: tasks? [\d,-]+: User defined signal 2$", log, re.M) is not None


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


class HungUp(BaseException):
    """SIGHUP on the submitting process (its terminal closed): it stops waiting and leaves the arrays running.
    (Not an Exception, so that nothing on the way treats it as a failure or as Ctrl-C.)"""


def _hung_up(signum: int, frame: Any) -> None:
    raise HungUp


def hangup_line(arrays: Sequence[str], unfinished: int, submitted: int, total: int) -> str:
    """The line a SIGHUP leaves: the arrays run on, and re-running the same sweep is the resume."""
    s = "s" if len(arrays) != 1 else ""
    left = f"; {total - submitted} not submitted" if total > submitted else ""
    return (f"hangup (SIGHUP: the terminal closed): stopped waiting; Slurm array{s} {', '.join(arrays)} "
            f"run{'' if s else 's'} on, nothing cancelled ({unfinished} of {submitted} jobs not finished{left}; "
            f"scancel {' '.join(arrays)} stops them); run the same sweep again to resume: it reuses the stage "
            f"outputs they finish from the store, waits for a stage one of them is still building, and writes the "
            f"summary")


def elapsed(seconds: float) -> str:
    """``H:MM:SS``, as squeue's TIME column shows a job's time."""
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def progress_line(n: int, counts: tuple[int, int, int, int], reasons: Sequence[str], seconds: float) -> str:
    """The waiting line: the jobs queued (with why they wait, squeue's reason: ``Resources``, ``Priority``, ...),
    running, done and failed, and the time since the first array was submitted."""
    q, r, d, f = counts
    why = ""
    if q and reasons:
        tally = Counter(reasons).most_common()
        why = f" ({tally[0][0]})" if len(tally) == 1 else " (" + ", ".join(f"{k} {v}" for v, k in tally) + ")"
    return f"slurm: {n} jobs: {q} queued{why}, {r} running, {d} done, {f} failed; {elapsed(seconds)} elapsed"


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
        self.why = ""  # squeue's reason while it is queued (Resources, Priority, ...)
        self.ended_at: float | None = None  # when squeue first showed it ended (or lost it) without a result file
        self.outcome = ""  # "done" or "failed" once known ("cancelled" after Ctrl-C)
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


def squeue_states(array_ids: Sequence[str]) -> dict[str, tuple[str, str]] | None:
    """``{job_id: (state, reason)}`` of every task of the arrays that the controller still holds (pending tasks one
    by one: ``-r``; the reason is why a pending job waits, ``None`` for one that does not), or None when squeue
    cannot answer."""
    try:
        proc = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(array_ids), "-o", "%i|%T|%r"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    out = {}
    for line in proc.stdout.splitlines():
        jid, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        if jid:
            out[jid] = (state.split()[0] if state.strip() else "", reason.strip())
    return out


def _varying(jobs: Sequence[Sequence[str]]) -> list[str]:
    """Each job named by its overrides that differ between the sweep's jobs (all of them for a single job)."""
    jobs = [filter_overrides(j) for j in jobs]
    return [" ".join([o for o in j if any(o not in other for other in jobs)] or j) for j in jobs]


class PipelineSlurmLauncher(SlurmLauncher):
    poll_s = (1.0, 15.0)  # the first poll of squeue after this long, growing to at most this long between polls

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Submit one Slurm array per (partition, constraint, GPU count, CPUs, memory), every array before waiting
        on any. Job numbers (and so the jobs' sweep subdirectories) follow the sweep's order, whatever the
        grouping."""
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
        hosts = [host_resources(self.params, r) for r in resources]
        for i, r in enumerate(resources):
            key = (r["partition"], r["constraint"], r["gpus_per_node"], *sorted(hosts[i][0].items()))
            groups.setdefault(key, []).append(i)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        submit_dir = Path(str(self.params["submitit_folder"]).split("%j")[0]).resolve()
        log.info(f"Submitit 'slurm' sweep output dir : {sweep_dir}")
        labels = _varying(job_overrides)
        jobs: list[SweepJob] = []
        self._t0 = time.monotonic()
        # a CI timeout's SIGTERM cancels like Ctrl-C; a closed terminal's SIGHUP leaves the arrays running
        previous = {sig: signal.signal(sig, handler) for sig, handler in ((signal.SIGTERM, _interrupted),
                                                                        (signal.SIGHUP, _hung_up))}
        try:
            try:
                for idxs in groups.values():
                    r = resources[idxs[0]]
                    host, notes = hosts[idxs[0]]
                    res = {k: v for k, v in (("partition", r["partition"]), ("constraint", r["constraint"]),
                                             ("gpus_per_node", r["gpus_per_node"]), *host.items()) if v is not None}
                    executor = self._executor({**self.params, **res})
                    args = []
                    for i in idxs:
                        num = initial_job_idx + i
                        log.info(f"\t#{num} : {' '.join(filter_overrides(job_overrides[i]))} ({res})")
                        args.append((list(job_overrides[i]), "hydra.sweep.dir", num, f"job_id_for_{num}",
                                     Singleton.get_state()))
                    asked = " ".join(sbatch_flag(k, v) for k, v in res.items()) or "default partition"
                    try:
                        submitted = executor.map_array(self, *zip(*args))
                    except (FailedJobError, OSError) as exc:  # sbatch refused it (its own line is printed above)
                        self._cancel(jobs, resources)
                        why = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
                        console.print(f"error: Slurm refused the array for {escape(asked)}: {escape(why)}; check "
                                      f"target.slurm (partition, constraint) and hydra.launcher's settings "
                                      f"(cpus_per_task and mem_gb come from the plan unless set there) against "
                                      f"the cluster (sinfo)", soft_wrap=True)
                        raise SystemExit(2) from None
                    jobs += [SweepJob(i, initial_job_idx + i, labels[i], job) for i, job in zip(idxs, submitted)]
                    console.print(f"submitted Slurm array {escape(jobs[-1].array_id)}: {len(idxs)} job"
                                  f"{'s' if len(idxs) != 1 else ''} ({escape(asked)})", soft_wrap=True)
                    console.print(f"  {escape('; '.join(notes))}", soft_wrap=True)
                console.print(f"submit dir: {escape(str(submit_dir))}", soft_wrap=True)
                self._wait(jobs)
            except KeyboardInterrupt:
                signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the cancel runs to its end
                self._cancel(jobs, resources)
                self._summary(jobs, len(job_overrides), submit_dir, interrupted=True)
                raise
            except HungUp:
                self._say_hung_up(jobs, len(job_overrides))
                raise SystemExit(129) from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self._finish(jobs, len(job_overrides), submit_dir)

    # ------------------------------------------------------------------------------------------------ waiting
    @property
    def heartbeat_s(self) -> float:
        """The longest the waiting stays silent while nothing changes (``hydra.launcher.heartbeat_s``)."""
        return float(self.params.get("heartbeat_s") or PipelineSlurmConf.heartbeat_s)

    def _wait(self, jobs: list[SweepJob]) -> None:
        """Poll squeue until every job has settled. A line on stderr whenever the counts change, and else every
        :attr:`heartbeat_s`: the counts, why the queued jobs wait, and the time since the sweep was submitted."""
        from pipeline.ui import console

        arrays = sorted({j.array_id for j in jobs})
        shown, said = None, 0.0
        while True:
            states = squeue_states(arrays)
            for j in jobs:
                self._update(j, states)
            counts = self._counts(jobs)
            now = time.monotonic()
            if counts != shown or now - said >= self.heartbeat_s:
                reasons = [j.why for j in jobs if not j.outcome and j.state in QUEUED and j.why]
                console.print(progress_line(len(jobs), counts, reasons, now - self._t0), markup=False,
                              highlight=False)
                shown, said = counts, now
            if all(j.settled() for j in jobs):
                return
            lo, hi = self.poll_s
            pause = min(hi, lo + (now - self._t0) / 20)
            time.sleep(max(0.1, min(pause, said + self.heartbeat_s - time.monotonic())))

    @staticmethod
    def _counts(jobs: list[SweepJob]) -> tuple[int, int, int, int]:
        done = sum(j.outcome == "done" for j in jobs)
        failed = sum(j.outcome == "failed" for j in jobs)
        queued = sum(not j.outcome and j.state in QUEUED for j in jobs)
        return queued, len(jobs) - done - failed - queued, done, failed

    def _update(self, j: SweepJob, states: dict[str, tuple[str, str]] | None) -> None:
        """Read the job's result file once it exists; else take Slurm's state, and fail a job Slurm has ended (or
        no longer lists) that wrote no result within :data:`RESULT_GRACE_S`."""
        if states is not None:
            state, why = states.get(j.slurm_id, ("", ""))
            j.missing = 0 if state else j.missing + 1
            if state:
                j.state, j.why = state, ("" if why == "None" else why)
        if j.outcome or self._read_result(j):
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
            j.reason = (self._timeout_line() if j.state == "TIMEOUT" or self._signalled(j)
                        else f"failed: {why} without a result; see its log")

    def _read_result(self, j: SweepJob) -> bool:
        """The job's outcome from the result file submitit's job writes when its function returns; False while
        there is none."""
        from submitit.core import utils

        result = Path(j.job.paths.result_pickle)
        if not result.exists():
            return False
        try:
            outcome, value = utils.pickle_load(result)
        except EOFError:  # still being moved into place
            return False
        j.result_at = time.monotonic()
        if outcome == "success" and isinstance(value, JobReturn):
            j.ret = value
            if value.status == JobStatus.COMPLETED:
                j.outcome = "done"
            else:
                j.outcome, j.reason = "failed", one_line(value._return_value)
        else:  # a failed job (JobFailed) or an error outside Hydra's job: submitit keeps the traceback
            j.outcome, j.reason = "failed", (self._timeout_line() if timed_out(value) else failure_line(value))
        return True

    @staticmethod
    def _signalled(j: SweepJob) -> bool:
        """Whether the job's log shows it killed by the time limit's signal (:func:`signalled_at_time_limit`)."""
        try:
            with open(j.job.paths.stderr, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                return signalled_at_time_limit(f.read().decode(errors="replace"))
        except OSError:
            return False

    def _timeout_line(self) -> str:
        return timeout_line(self.params.get("timeout_min"), self.params.get("signal_delay_s"))

    # ------------------------------------------------------------------------------------------------ finishing
    def _finish(self, jobs: list[SweepJob], n: int, submit_dir: Path) -> list[JobReturn]:
        from rich.markup import escape

        from pipeline.ui import console

        failed = self._summary(jobs, n, submit_dir)
        if failed:
            each = "; ".join(f"#{j.num} {j.label} (Slurm job {j.slurm_id}, log {j.log}): {j.reason}" for j in failed)
            console.print(f"failed: {len(failed)} of {len(jobs)} Slurm jobs failed: {escape(each)}", soft_wrap=True)
            raise SystemExit(1)
        results: list[Any] = [None] * n
        for j in jobs:
            results[j.index] = j.ret
        return results

    def _summary(self, jobs: list[SweepJob], n: int, submit_dir: Path, interrupted: bool = False) -> list[SweepJob]:
        """The summary on stdout: the submit dir, then each job's Slurm job id, outcome (done, failed, or after
        Ctrl-C cancelled) and log; returns the failed jobs. After Ctrl-C, a job that finished before the cancel
        keeps its outcome (its result file says which), the others are cancelled."""
        from rich.markup import escape

        from pipeline.ui import out

        if interrupted:
            for j in jobs:
                if not j.outcome and not self._read_result(j):
                    j.outcome, j.reason = "cancelled", ""
        tally = Counter(j.outcome for j in jobs)
        failed = [j for j in jobs if j.outcome == "failed"]
        head = f"Slurm sweep: {tally['done']} done, {tally['failed']} failed"
        if interrupted:
            head = (f"Slurm sweep interrupted: {tally['done']} done, {tally['failed']} failed, {tally['cancelled']} "
                    f"cancelled" + (f", {n - len(jobs)} not submitted" if n > len(jobs) else ""))
        out.print(f"{head}; submit dir: {escape(str(submit_dir))}", soft_wrap=True)
        for j in sorted(jobs, key=lambda j: j.num):
            mark = "[green]✓[/]" if j.outcome == "done" else "[red]✗[/]"
            out.print(f"  {mark} #{j.num} {escape(j.label)}  job {escape(j.slurm_id)}  {j.outcome}  "
                      f"log: {escape(str(j.log))}", soft_wrap=True)
            if j.reason:
                out.print(f"      {escape(j.reason)}", soft_wrap=True)
        return failed

    def _say_hung_up(self, jobs: list[SweepJob], n: int) -> None:
        """SIGHUP: one line on stderr (a closed terminal may no longer take it: a redirected stderr, nohup's file
        or a multiplexer's scrollback does), and nothing cancelled."""
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        arrays = sorted({j.array_id for j in jobs})
        unfinished = sum(not j.outcome for j in jobs)
        line = (hangup_line(arrays, unfinished, len(jobs), n) if arrays else
                "hangup (SIGHUP: the terminal closed): stopped before any array was submitted")
        try:
            print(line, file=sys.stderr, flush=True)
        except OSError:  # the terminal is gone
            pass
        try:
            sys.stdout.flush()
        except OSError:  # at exit Python's own flush would fail, and turn the exit status into 120
            sys.stdout = open(os.devnull, "w")

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
            if states is None or all(s in ENDED for s, _ in states.values()):
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
                                      if k not in init_keys and k not in OWN_PARAMS})
        return executor
