"""The CLI's config contract end to end: one-line errors (exit 2, no traceback, nothing written), ``paths.root``,
and ``validate`` over every shipped combination. In-process config tests are in ``tests/unit/test_config.py``."""
from __future__ import annotations

import json

import pytest

from pipeline import config
from tests.conftest import run_cli


@pytest.mark.parametrize("args, expected", [
    (["plan", "model=nope"], "error: unknown model 'nope'"),
    (["build", "build.max_batch_size=-1"], "error: build.max_batch_size=-1 is out of range"),
    (["build", "quant.nonsense=1"], "error: unknown config key 'quant.nonsense'"),
    (["frobnicate"], "error: unknown verb 'frobnicate'"),
    (["build", "model=tiny-qwen3", "model.source=/does/not/exist"], "no such directory"),
    (["build", "-m", "quant=fp8,nope"], "unknown quant 'nope'"),
])
def test_cli_user_errors_exit_2_without_traceback_or_output(tmp_path, args, expected):
    root = tmp_path / "out"
    proc = run_cli(*args, root=root)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and expected in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not any(p for p in root.rglob("*")), "nothing may be written on a config error"


def test_paths_root_moves_every_output(tmp_path):
    proc = run_cli("plan", "--json", "model=tiny-qwen3", root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    outs = [s["output"] for s in doc["stages"]]
    assert all(o.startswith(str(tmp_path)) for o in outs)
    assert any("/engines/" in o for o in outs) and any("/triton_repo/" in o for o in outs)
    assert any("/.store/" in o for o in outs) and any("/bundles/" in o for o in outs)


def _validated(tmp_path, *only: str) -> tuple[dict, set]:
    proc = run_cli("validate", "--json", *only, root=tmp_path)
    doc = json.loads(proc.stdout)
    assert proc.returncode == 0 and doc["failing"] == 0, doc
    refused = {tuple(r["combination"][k] for k in ("model", "quant", "target", "runtime"))
               for r in doc["results"] if r["refused"]}
    return doc, refused


@pytest.mark.slow  # ~50 s on 2 cores: every shipped combination composed and planned
def test_validate_composes_every_shipped_combination(tmp_path):
    doc, refused = _validated(tmp_path)
    models, quants = config.group_options("model"), config.group_options("quant")
    # target=auto and runtime=auto resolve to one of the others
    targets = [t for t in config.group_options("target") if t != "auto"]
    runtimes = [r for r in config.group_options("runtime") if r != "auto"]
    assert doc["combinations"] == len(models) * len(quants) * len(targets) * len(runtimes)
    assert ("smollm2-135m", "int4_awq", "cpu", "reference") in refused  # hidden 576, AWQ block 128
    assert ("qwen32b", "nvfp4", "h100", "trtllm_engine") in refused  # NVFP4 serves on Blackwell only
    assert ("qwen32b", "fp8", "h100", "trtllm_engine") not in refused
    assert ("qwen32b", "nvfp4", "b200", "trtllm_llmapi") not in refused


def test_validate_composes_every_quant_of_the_embedded_models_on_the_cpu(tmp_path):
    """The fast tier's share of the test above: ``validate`` through the CLI over every shipped quant of the two
    embedded models on the CPU; the whole product (the flagship on every target and runtime, the performance model
    choosing its settings) runs in the slow tier."""
    doc, refused = _validated(tmp_path, "model=smollm2-135m,tiny-qwen3", "target=cpu", "runtime=reference")
    assert doc["combinations"] == 2 * len(config.group_options("quant"))
    assert ("smollm2-135m", "int4_awq", "cpu", "reference") in refused  # hidden 576, AWQ block 128
    assert ("tiny-qwen3", "fp8", "cpu", "reference") not in refused


def test_validate_over_processes_gives_the_one_process_results_in_order():
    """validate spreads its combinations over processes (one task per target): the results, in the combinations'
    order, are those of composing and checking them all in this process, refusals and predictions alike."""
    from pipeline.cli.build import check_combinations, check_in_parallel

    combos = config.combinations({"model": ["qwen32b"], "quant": ["fp8", "nvfp4"], "runtime": ["trtllm_llmapi"]})
    serial = check_combinations(combos)
    assert len({c["target"] for c in combos}) > 2 and any(r["refused"] for r in serial)
    assert check_in_parallel(combos, processes=2) == serial
