"""The TRT-LLM runtimes' build check on a real TensorRT-LLM (NVIDIA's TRT-LLM container and a GPU): the build loads
what it built and must generate the requested number of tokens and non-empty text, both recorded in build.json.

Skipped, with the reason, where tensorrt_llm is missing, where there is no GPU, and where the installed TRT-LLM lacks
the runtime's backend (TRT-LLM >= 1.3 has no TensorRT-engine backend). The check's logic on plain data is tested in
tests/unit/test_quant_checks.py.
"""
from __future__ import annotations

import json

import pytest

from pipeline.errors import UserError
from pipeline.runtime import trtllm
from tests.conftest import run_cli
from tests.helpers.requires import requires_gpu, requires_trtllm

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@requires_trtllm
@requires_gpu
@pytest.mark.parametrize("runtime", ["trtllm_engine", "trtllm_llmapi"])
def test_trtllm_build_generates_the_requested_tokens_and_records_them(tmp_path, runtime):
    try:
        trtllm.require(runtime, None)
    except UserError as exc:  # e.g. TRT-LLM >= 1.3 for the engine runtime
        pytest.skip(f"the installed TensorRT-LLM cannot run {runtime}: {exc}")
    proc = run_cli("build", "model=tiny-qwen3", "quant.gate=warn", "target=auto", f"runtime={runtime}",
                   "runtime.check_tokens=8", "until=build", root=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("engines/*-build-*/build.json")
    check = json.loads(path.read_text())["check"]
    assert check["requested_tokens"] == 8 and check["tokens"] == 8, check
    assert check["completion"].strip() and check["pass"] is True, check
    assert trtllm.generation_problems(check, 8) == []
