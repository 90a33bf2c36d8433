"""``plan`` sizes the machine quantize runs on, not only the target: qwen32b on a 24 GB host without a GPU is
refused with what would work; the same plan on a host with one H200, or a small model here, is not."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline import hardware
from pipeline.stages import quantize


@pytest.fixture()
def host(monkeypatch):
    import psutil

    def set_host(gpu=None, ram_gb=24.0):
        monkeypatch.setattr(hardware, "local_gpu", lambda: gpu)
        monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=ram_gb * 1e9))
    return set_host


def test_a_quantize_that_cannot_fit_this_host_is_refused_with_what_works(host, tmp_path):
    host(gpu=None, ram_gb=24)
    cfg = hardware.compose(["model=qwen32b", "quant=nvfp4", "target=b200", f"paths.root={tmp_path}"])
    problem = quantize.machine_fit_problem(cfg)
    assert problem is not None and problem.startswith("qwen32b needs ~72 GB to calibrate")
    assert "quantize runs on this machine, which has 24 GB of memory and no GPU" in problem
    for remedy in ("1× 141 GB GPU", "until=quantize", "hydra/launcher=pipeline_slurm", "until=fetch"):
        assert remedy in problem, remedy
    assert quantize.check(cfg) == []  # the target's check alone (8 B200 GPUs) passes it: the bug this catches


def test_the_same_plan_on_a_gpu_host_or_a_small_model_passes(host, tmp_path):
    host(gpu={"name": "NVIDIA H200", "sm": 90, "memory_gb": 141.0, "count": 1}, ram_gb=24)
    cfg = hardware.compose(["model=qwen32b", "quant=nvfp4", "target=b200", f"paths.root={tmp_path}"])
    assert quantize.machine_fit_problem(cfg) is None
    host(gpu=None, ram_gb=24)
    assert quantize.machine_fit_problem(hardware.compose(["model=smollm2-135m", f"paths.root={tmp_path}"])) is None
