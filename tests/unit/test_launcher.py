"""The pipeline_slurm Hydra launcher's per-target resources."""
from __future__ import annotations


def test_pipeline_slurm_launcher_asks_for_each_targets_resources():
    from hydra_plugins.pipeline_launcher.launcher import job_resources

    h100 = job_resources(["model=qwen32b", "quant=fp8", "target=h100"])
    a10g = job_resources(["model=qwen32b", "quant=fp8", "target=a10g"])
    assert (h100["partition"], h100["constraint"], h100["gpus_per_node"]) == ("gpu", "h100", 1)
    assert a10g["constraint"] == "a10g" and a10g["gpus_per_node"] == 2  # 34 GB of FP8 weights on 24 GB GPUs
