"""The scheduled rebuild's GPU job runs TensorRT-LLM entries in the TRT-LLM container recorded for the supported
TensorRT-LLM version, and installs the project over that container's Python (its tensorrt_llm stays visible)."""
from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _build_job() -> dict:
    return yaml.safe_load((REPO / ".github" / "workflows" / "rebuild.yml").read_text())["jobs"]["build"]


def test_trtllm_entries_build_in_the_recorded_container_with_the_gpus():
    from pipeline import upstream

    image = upstream.container_for("1.2.1")
    job = _build_job()
    expr = job["container"]["image"]
    assert f"startsWith(matrix.runtime, 'trtllm') && '{image}'" in expr
    assert expr.endswith("|| '') }}")  # other entries: no container, the runner itself
    assert "--gpus all" in job["container"]["options"]
    assert job["defaults"]["run"]["shell"] == "bash"  # a container's default shell is sh; the steps use bash


def test_the_container_install_keeps_the_containers_tensorrt_llm_and_the_host_install_the_rest():
    steps = _build_job()["steps"]
    inside = next(s for s in steps if s.get("name") == "install into the TRT-LLM container")
    assert inside["if"] == "startsWith(matrix.runtime, 'trtllm')"
    run = inside["run"]
    assert "venv --system-site-packages .venv" in run and "import tensorrt_llm" in run
    assert "make setup" not in run and "torch==" not in run  # no CPU torch pin over the container's CUDA torch
    assert "cpu-server" not in run  # NVIDIA's tritonserver is on PATH there
    assert "'.[hub]'" in run  # hf:// models calibrate on a Hub dataset
    # the performance model chooses the serving settings: its environment beside the container's (numpy<2) one
    assert ".venv/bin/python -m pipeline.perfmodel --if-needed" in run
    outside = next(s for s in steps if str(s.get("run", "")).startswith("make setup"))
    assert "'.[hub]'" in outside["run"]
    assert outside["if"] == "${{ !startsWith(matrix.runtime, 'trtllm') }}"
