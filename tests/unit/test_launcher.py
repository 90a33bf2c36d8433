"""The pipeline_slurm Hydra launcher's per-target resources."""
from __future__ import annotations


def test_pipeline_slurm_launcher_asks_for_each_targets_resources():
    from hydra_plugins.pipeline_launcher.launcher import job_resources

    h100 = job_resources(["model=qwen32b", "quant=fp8", "target=h100"])
    a10g = job_resources(["model=qwen32b", "quant=fp8", "target=a10g", "runtime=trtllm_llmapi"])
    assert (h100["partition"], h100["constraint"], h100["gpus_per_node"]) == ("gpu", "h100", 1)  # reference: 1 GPU
    assert a10g["constraint"] == "a10g" and a10g["gpus_per_node"] == 2  # 34 GB of FP8 weights on 24 GB GPUs


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
