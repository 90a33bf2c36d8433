"""Hardware and library requirements of tests, each with its marker and its skip reason, defined once.

As a decorator (``@requires_gpu``), in a module's ``pytestmark = requires_trtllm.marks``, or inside a test
(``requires_trtllm.check()``, which skips at run time). The markers (``gpu``, ``sm``, ``trtllm``) are registered in
``pyproject.toml`` (``--strict-markers``), so ``pytest -m gpu`` selects every CUDA test and ``-m "not gpu"`` none.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import pytest


@functools.cache
def cuda_sm() -> int | None:
    """The visible CUDA GPU's compute capability as ``major*10 + minor`` (90 for Hopper), or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


@functools.cache
def trtllm_version() -> str | None:
    """The installed TensorRT-LLM's version, or None (it cannot be installed from PyPI: NVIDIA's containers have it)."""
    from pipeline.runtime import trtllm

    return trtllm.detect().version


@dataclass(frozen=True)
class Requirement:
    """A marker and the reason to skip when ``missing()`` says the machine lacks what it names."""

    markers: tuple[pytest.MarkDecorator, ...]
    missing: Callable[[], str | None]  # the skip reason, or None when the requirement is met

    @property
    def marks(self) -> list[pytest.MarkDecorator]:
        reason = self.missing()
        return [*self.markers, pytest.mark.skipif(reason is not None, reason=reason or "")]

    def __call__(self, obj):
        for mark in self.marks:
            obj = mark(obj)
        return obj

    def check(self) -> None:
        """Skip the running test (or, at module level, the module) when the requirement is not met."""
        reason = self.missing()
        if reason is not None:
            pytest.skip(reason, allow_module_level=True)


GPU_MISSING = "needs a CUDA GPU (none visible)"
TRTLLM_MISSING = "tensorrt_llm is not installed (NVIDIA's TRT-LLM container and a GPU are needed)"

requires_gpu = Requirement((pytest.mark.gpu,), lambda: GPU_MISSING if cuda_sm() is None else None)
requires_trtllm = Requirement((pytest.mark.trtllm,), lambda: TRTLLM_MISSING if trtllm_version() is None else None)


def _sm_missing(minimum: int, why: str) -> str | None:
    sm = cuda_sm()
    if sm is None:
        return f"{GPU_MISSING}: {why}"
    if sm < minimum:
        return f"needs SM >= {minimum / 10:.1f} ({why}); this GPU is sm{sm}"
    return None


def requires_sm(minimum: int, why: str) -> Requirement:
    """A CUDA GPU of compute capability ``minimum`` or newer (89 for FP8 kernels; marked ``gpu`` and ``sm``);
    ``why`` names what needs it."""
    return Requirement((pytest.mark.gpu, pytest.mark.sm(minimum)), lambda: _sm_missing(minimum, why))
