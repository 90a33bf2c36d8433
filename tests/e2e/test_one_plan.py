"""One plan on every host: the same config planned and rendered in two environments gives the same fingerprints and
the same configs, and a host without NVIDIA's performance model refuses what the model would choose rather than plan
another bundle.

- host A: this checkout's environment, the performance model beside it (``.venv/perfmodel``);
- host B: the same installed model reached from another place (``PIPELINE_PERFMODEL_ENV``), as a TensorRT-LLM
  container's install makes it beside its own numpy<2 environment, with an empty answer cache: every figure computed
  afresh;
- host C: no performance model at all.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import perfmodel
from tests.conftest import cli_env, run_cli

pytestmark = pytest.mark.e2e

GPU = ["model=qwen32b", "quant=fp8", "target=h200", "runtime=trtllm_llmapi"]
REFERENCE = ["model=qwen32b", "quant=fp8", "target=h200", "runtime=reference"]


def _plan(root: Path, env: dict[str, str], *overrides: str) -> tuple[int, dict | str]:
    proc = run_cli("plan", "--json", *overrides, root=root, env=env)
    return proc.returncode, (json.loads(proc.stdout) if proc.returncode == 0 else proc.stderr)


def _render(root: Path, env: dict[str, str], dest: Path, *overrides: str) -> dict[str, bytes]:
    proc = run_cli("render", str(dest), *overrides, root=root, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted(dest.rglob("*")) if p.is_file()}


def test_two_hosts_plan_and_render_the_same_bundle_and_a_host_without_the_model_refuses(tmp_path):
    if perfmodel.available():
        pytest.skip(perfmodel.available())
    root = tmp_path / "root"
    host_a = cli_env(tmp_path)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "perfmodel").symlink_to(perfmodel.env_path(), target_is_directory=True)
    host_b = cli_env(tmp_path, PIPELINE_PERFMODEL_ENV=str(tmp_path / "b" / "perfmodel"))
    host_c = cli_env(tmp_path, PIPELINE_PERFMODEL_ENV=str(tmp_path / "c" / "perfmodel"))
    code_a, a = _plan(root, host_a, *GPU)
    code_b, b = _plan(root, host_b, *GPU)
    assert code_a == code_b == 0, (a, b)
    assert not (tmp_path / "b" / "perfmodel-cache").exists() or any((tmp_path / "b" / "perfmodel-cache").rglob(
        "*.json"))  # host B computed its own answers
    assert [s["fingerprint"] for s in a["stages"]] == [s["fingerprint"] for s in b["stages"]]
    assert a["serving"] == b["serving"] and a["serving"]["model"] == perfmodel.installed()
    assert a["serving"]["settings"]["max_seq_len"]["value"] == 40960
    assert _render(root, host_a, tmp_path / "ra", *GPU) == _render(root, host_b, tmp_path / "rb", *GPU)
    # host C: the model would choose these settings; without it, one line naming the fix, and nothing planned
    code_c, c = _plan(root, host_c, *GPU)
    assert code_c == 2 and "make perfmodel-env" in c and len(c.strip().splitlines()) == 1, c
    # where the model chooses nothing (here the reference runtime on a GPU) host C plans the same bundle
    (code_a, a), (code_c, c) = _plan(root, host_a, *REFERENCE), _plan(root, host_c, *REFERENCE)
    assert code_a == code_c == 0, (a, c)
    assert [s["fingerprint"] for s in a["stages"]] == [s["fingerprint"] for s in c["stages"]]
    assert a["serving"] == c["serving"] and a["serving"]["model"] is None
