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
