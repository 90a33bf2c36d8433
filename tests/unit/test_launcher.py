"""The pipeline_slurm Hydra launcher's per-target resources."""
from __future__ import annotations


def test_pipeline_slurm_launcher_asks_for_each_targets_resources():
    """Partition, constraint and GPUs per target; CPUs and host memory from the plan, each with its source: a GPU
    job's memory is at least the bf16 checkpoint it loads (qwen32b: 32.8 B parameters, 65.6 GB) plus its process's
    measured 11.6 GB; its CPUs one for the job, one per TensorRT-LLM rank, three while it serves. A value set under
    hydra.launcher wins, and a per-GPU form of it stands in for it."""
    from hydra_plugins.pipeline_launcher.launcher import host_resources, job_resources

    h100 = job_resources(["model=qwen32b", "quant=fp8", "target=h100"])
    a10g = job_resources(["model=qwen32b", "quant=fp8", "target=a10g", "runtime=trtllm_llmapi"])
    tiny = job_resources(["model=tiny-qwen3", "quant=fp8", "target=cpu", "until=quantize"])
    assert (h100["partition"], h100["constraint"], h100["gpus_per_node"]) == ("gpu", "h100", 1)  # reference: 1 GPU
    assert a10g["constraint"] == "a10g" and a10g["gpus_per_node"] == 2  # 34 GB of FP8 weights on 24 GB GPUs
    assert (h100["cpus_per_task"], h100["mem_gb"]) == (4, 78)  # ceil(65.6 + 11.6); 1 + 3 serving processes
    assert h100["sizing"]["mem_gb"].startswith("65.6 GB of bf16 checkpoint")
    assert (a10g["cpus_per_task"], a10g["mem_gb"]) == (6, 78)  # 1 + 2 ranks + 3
    assert "2 TensorRT-LLM ranks" in a10g["sizing"]["cpus_per_task"]
    assert (tiny["cpus_per_task"], tiny["mem_gb"]) == (1, 1)  # nothing served, a model of a few MB
    unset = {"cpus_per_task": None, "mem_gb": None}
    assert host_resources(unset, h100)[0] == {"cpus_per_task": 4, "mem_gb": 78}
    res, notes = host_resources({**unset, "cpus_per_task": 16, "mem_per_gpu": "100G"}, h100)
    assert res == {"cpus_per_task": 16}  # the user's; --mem-per-gpu goes to sbatch, and --mem with it would not
    assert notes == ["--cpus-per-task=16 from hydra.launcher.cpus_per_task",
                     "--mem-per-gpu=100G from hydra.launcher.mem_per_gpu"]
    assert host_resources(unset, h100)[1][1] == f"--mem=78GB from the plan: {h100['sizing']['mem_gb']}"


def test_in_a_slurm_job_the_gpu_refusal_names_the_node_the_job_and_what_it_lacks(monkeypatch):
    """Outside Slurm, no GPU here advises the Slurm fan-out (the control); in a Slurm job (the variables slurmd sets)
    that advice would resubmit to the same node, so the line names the node, the job (as the summary does) and
    what the node lacks, and points at target.slurm. A wrong-SM GPU (NVML's answer stood in for: no GPU here)
    likewise."""
    from pipeline import hardware, planning
    from pipeline.config import compose

    for k in [k for k in __import__("os").environ if k.startswith("SLURM")]:
        monkeypatch.delenv(k)
    cfg = compose(["model=qwen32b", "quant=fp8", "target=h100", "runtime=trtllm_llmapi"])
    fanout = "python -m pipeline build -m target=h100 hydra/launcher=pipeline_slurm"
    assert fanout in planning.local_sm_problems(cfg)[0]  # control: outside a job
    for k, v in {"SLURM_JOB_ID": "15", "SLURM_ARRAY_JOB_ID": "14", "SLURM_ARRAY_TASK_ID": "1",
                 "SLURMD_NODENAME": "gpu-07", "SLURM_JOB_GPUS": "0"}.items():
        monkeypatch.setenv(k, v)
    [line] = planning.local_sm_problems(cfg)
    assert fanout not in line
    assert line.startswith("target h100 (sm90) needs its GPU to build, and node gpu-07 (Slurm job 14_1) has none "
                           "that NVML can see, although Slurm allocated it GPU 0: the node lacks an sm90 GPU with a "
                           "working NVIDIA driver; make target.slurm (partition=gpu constraint=h100) select only "
                           "nodes with an sm90 GPU"), line
    monkeypatch.setattr(hardware, "local_gpu", lambda: {"name": "NVIDIA A100-SXM4-80GB", "sm": 80, "count": 1,
                                                        "memory_gb": 80.0})
    [line] = planning.local_sm_problems(cfg)
    assert line.startswith("target h100 is sm90 but the GPU of node gpu-07 (Slurm job 14_1) is NVIDIA "
                           "A100-SXM4-80GB (sm80): engines run only on the SM they were built on: the node lacks an "
                           "sm90 GPU; make target.slurm (partition=gpu constraint=h100)"), line


def test_a_failed_jobs_line_comes_from_its_traceback():
    """submitit keeps a failed job's traceback; the summary shows the JobFailed message, else the last line."""
    from hydra_plugins.pipeline_launcher.launcher import failure_line

    trace = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
             "hydra_plugins.pipeline_launcher.launcher.JobFailed: error: target h100 (sm90) needs its GPU\n")
    assert failure_line(trace) == "error: target h100 (sm90) needs its GPU"
    assert failure_line("Traceback ...\nMemoryError: out of memory\n") == "failed: MemoryError: out of memory"
    assert failure_line("") == "failed: no traceback"


def test_sweep_jobs_are_named_by_what_differs_between_them():
    from hydra_plugins.pipeline_launcher.launcher import _varying

    jobs = [["model=tiny-qwen3", "target=cpu", "quant=fp8"], ["model=tiny-qwen3", "target=cpu", "quant=none"]]
    assert _varying(jobs) == ["quant=fp8", "quant=none"]
    assert _varying(jobs[:1]) == ["model=tiny-qwen3 target=cpu quant=fp8"]


def test_a_job_past_its_time_limit_names_timeout_min_the_limit_and_the_fix():
    """submitit ends a job at its time limit with "timed-out too many times" (hydra's max_num_timeout is 0); the
    summary's line says which setting, what it was and what to do instead."""
    from hydra_plugins.pipeline_launcher.launcher import failure_line, timed_out, timeout_line

    trace = ("Traceback (most recent call last):\n  File \"submitit/core/job_environment.py\", line 226\n"
             "submitit.core.utils.UncompletedJobError: Job not requeued because: timed-out too many times.\n")
    assert timed_out(trace)
    line = timeout_line(60, 120)
    assert line.startswith("failed: the job ran into its time limit, hydra.launcher.timeout_min=60 (Slurm's limit: "
                           "60 min; submitit stops the job hydra.launcher.signal_delay_s=120 s before it)")
    assert "raise hydra.launcher.timeout_min" in line
    # control: any other failure keeps its own line
    assert not timed_out("Traceback ...\nMemoryError: out of memory\n")
    assert not timed_out(failure_line(trace).replace("timed-out", "cancelled"))


def test_a_job_killed_by_the_time_limits_signal_before_its_handler_is_named_as_a_time_limit(tmp_path):
    """Slurm may send the time limit's USR2 up to 60 s early (``man sbatch``, ``--signal``): a job still loading then
    dies of it before submitit's handler is set, Slurm records FAILED and there is no result. srun's line in the
    job's log (as a real run on the test cluster wrote it) makes it the time-limit line; any other death keeps the
    generic one."""
    import time
    from types import SimpleNamespace

    from hydra_plugins.pipeline_launcher.launcher import (RESULT_GRACE_S, PipelineSlurmLauncher, SweepJob,
                                                          signalled_at_time_limit, timeout_line)

    def reason(log: str) -> str:
        err = tmp_path / "28_0_log.err"
        err.write_text(log)
        paths = SimpleNamespace(result_pickle=tmp_path / "28_0_result.pkl", stderr=err)
        j = SweepJob(0, 0, "quant=fp8", SimpleNamespace(job_id="28", paths=paths))
        j.ended_at = time.monotonic() - RESULT_GRACE_S - 1
        launcher = PipelineSlurmLauncher()
        launcher.params = {"timeout_min": 1, "signal_delay_s": 40}
        launcher._update(j, {"28": ("FAILED", "None")})
        assert j.outcome == "failed"
        return j.reason

    srun = "srun: error: node1: task 0: User defined signal 2\n"
    assert signalled_at_time_limit(srun) and signalled_at_time_limit("x\n" * 5000 + srun)
    assert reason("loading...\n" * 2000 + srun) == timeout_line(1, 40)
    # controls: other deaths, and the words inside a job's own output rather than srun's line
    for log in ("srun: error: node1: task 0: Killed\n", "srun: error: node1: task 0: User defined signal 1\n",
                "my job printed: User defined signal 2\n", ""):
        assert not signalled_at_time_limit(log)
        assert reason(log) == "failed: Slurm ended it (FAILED) without a result; see its log"


def sweep_commands() -> list[list[str]]:
    """Every ``python -m pipeline build -m`` line of docs/hosts.md's "Sweeps on a Slurm cluster", as arguments."""
    import shlex

    from tests.conftest import REPO

    text = (REPO / "docs" / "hosts.md").read_text().split("## Sweeps on a Slurm cluster", 1)[1]
    return [shlex.split(line.split("#", 1)[0])[4:] for line in text.splitlines()
            if line.startswith("    python -m pipeline build -m ")]


def test_every_sweep_command_of_the_hosts_page_composes():
    """Each job of each documented sweep composes, launcher settings included (the trial sweep also runs as written
    on a real Slurm: tests/e2e/test_slurm.py). The page's former `additional_parameters={...}` is the control."""
    import pytest

    from pipeline.config import compose
    from pipeline.errors import UserError

    commands = sweep_commands()
    assert len(commands) == 3, commands
    for args in commands:
        assert args[:1] == ["-m"] and "hydra/launcher=pipeline_slurm" in args, args
        values = [a.split("=", 1) for a in args[1:]]
        sweeps = [(k, v.split(",")) for k, v in values if "," in v and not v.startswith("{")]
        for i in range(max(len(v) for _, v in sweeps)):
            job = [f"{k}={v}" for k, v in values if not any(k == s for s, _ in sweeps)]
            job += [f"{k}={v[i % len(v)]}" for k, v in sweeps]
            cfg = compose(job)  # raises UserError with the refused key
            assert cfg.model.name
    with pytest.raises(UserError, match=r"unknown config key 'hydra\.launcher\.additional_parameters\.mail_type'"):
        compose(["hydra/launcher=pipeline_slurm", "hydra.launcher.additional_parameters={mail_type:NONE}"])


def test_progress_lines_say_why_jobs_wait_and_for_how_long():
    """Each waiting line carries the time since submission and squeue's reasons for the queued jobs."""
    from hydra_plugins.pipeline_launcher.launcher import progress_line

    assert progress_line(2, (1, 1, 0, 0), ["Resources"], 65) == (
        "slurm: 2 jobs: 1 queued (Resources), 1 running, 0 done, 0 failed; 0:01:05 elapsed")
    assert progress_line(4, (3, 1, 0, 0), ["Priority", "Resources", "Priority"], 7384).startswith(
        "slurm: 4 jobs: 3 queued (2 Priority, 1 Resources), 1 running, 0 done, 0 failed; 2:03:04 elapsed")
    assert progress_line(2, (0, 2, 0, 0), [], 5) == (
        "slurm: 2 jobs: 0 queued, 2 running, 0 done, 0 failed; 0:00:05 elapsed")


def test_the_summary_after_ctrl_c_says_what_finished(tmp_path, capsys):
    """After Ctrl-C each submitted job is listed as the normal summary lists it: done or failed from the result file
    submitit's job wrote before the cancel, cancelled where there is none. (The jobs are submitit's result files and
    paths, written here in its format; Slurm itself is in tests/e2e/test_slurm.py.)"""
    from types import SimpleNamespace

    from hydra.core.utils import JobReturn, JobStatus
    from submitit.core.utils import cloudpickle_dump

    from hydra_plugins.pipeline_launcher.launcher import PipelineSlurmLauncher, SweepJob

    def job(i: int, result: tuple | None) -> SweepJob:
        pkl = tmp_path / f"12_{i}_result.pkl"
        if result is not None:
            cloudpickle_dump(result, pkl)
        paths = SimpleNamespace(result_pickle=pkl, stderr=tmp_path / f"12_{i}_log.err")
        return SweepJob(i, i, f"quant=q{i}", SimpleNamespace(job_id=f"12_{i}", paths=paths))

    done = JobReturn()
    done.status, done.return_value = JobStatus.COMPLETED, None
    jobs = [job(0, ("success", done)),
            job(1, ("error", "Traceback ...\nhydra_plugins.pipeline_launcher.launcher.JobFailed: error: no GPU\n")),
            job(2, None)]
    failed = PipelineSlurmLauncher()._summary(jobs, 4, tmp_path, interrupted=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("Slurm sweep interrupted: 1 done, 1 failed, 1 cancelled, 1 not submitted; submit dir: "
                        f"{tmp_path}")
    assert [x.split("  ")[3] for x in lines if "  job 12_" in x] == ["done", "failed", "cancelled"]
    assert "      error: no GPU" in lines and [j.slurm_id for j in failed] == ["12_1"]


def test_a_hangup_says_the_arrays_run_on_and_how_to_resume():
    from hydra_plugins.pipeline_launcher.launcher import hangup_line

    line = hangup_line(["12", "13"], 3, 4, 4)
    assert line.startswith("hangup (SIGHUP: the terminal closed): stopped waiting; Slurm arrays 12, 13 run on, "
                           "nothing cancelled (3 of 4 jobs not finished; scancel 12 13 stops them); run the same "
                           "sweep again to resume"), line
