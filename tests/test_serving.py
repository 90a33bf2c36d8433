"""Triton repositories for every layout, the linter (one broken repository per rule), the python models in a real
tritonserver, the bench launchers, workloads, BLS entry point and gates."""
from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from pipeline import config
from pipeline.errors import UserError
from pipeline.stages.package import ENGINE_REL, render_repository
from pipeline.triton import lint, server
from tests.conftest import TINY, run_cli, statuses

LABEL = "tiny-qwen3.fp8-kvfp8.cpu.reference"


def _tokenizer_into(dst: Path, tiny_build: Path) -> None:
    src = next(tiny_build.glob("engines/*-build-*/manifest.json")).parent / "engine"
    for p in src.glob("tokenizer*"):
        shutil.copy2(p, dst / p.name)


def engine_repo(tmp_path: Path, tiny_build: Path, *, world: int = 1, version: str = "1.2.1", engine_bs: int = 8,
                extra: tuple[str, ...] = ()) -> Path:
    """An inflight_batcher_llm repository around a stand-in engine directory: TensorRT-LLM cannot run here, so
    config.json and rank{N}.engine are placeholders shaped like trtllm-build's output."""
    repo = tmp_path / "engine-repo"
    eng = repo / ENGINE_REL
    eng.mkdir(parents=True)
    (eng / "config.json").write_text(json.dumps({
        "version": version, "pretrained_config": {"mapping": {"world_size": world, "tp_size": world, "pp_size": 1}},
        "build_config": {"max_batch_size": engine_bs, "max_seq_len": 2048}}))
    for r in range(world):
        (eng / f"rank{r}.engine").write_bytes(b"stand-in")
    _tokenizer_into(eng, tiny_build)
    cfg = config.compose(["model=qwen32b", "quant=fp8", "target=h100", "runtime=trtllm_engine", *extra])
    render_repository(cfg, repo)
    return repo


def test_engine_layout_fills_every_mandatory_parameter(tiny_build, tmp_path):
    from pipeline.triton.render import parse_model_config

    repo = engine_repo(tmp_path, tiny_build)
    assert sorted(p.name for p in repo.iterdir()) == ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm",
                                                      "tensorrt_llm_bls"]
    cfg = parse_model_config((repo / "tensorrt_llm" / "config.pbtxt").read_text())
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert cfg.backend == "tensorrtllm" and cfg.model_transaction_policy.decoupled
    assert params["engine_dir"] == "/models/tensorrt_llm/1/engine"
    assert params["batching_strategy"] == "inflight_fused_batching"
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.9"
    assert int(params["max_tokens_in_paged_kv_cache"]) > 100_000  # from the capacity planner (Qwen3-32B, FP8 KV)
    for key in ("encoder_input_features_data_type", "logits_datatype", "max_beam_width"):
        assert params[key]
    assert lint.lint(repo, trtllm_version="1.2.1") == []


def test_llmapi_layout_has_model_yaml_from_the_options(tiny_build, tmp_path):
    import yaml

    repo = tmp_path / "llmapi"
    eng = repo / ENGINE_REL
    eng.mkdir(parents=True)
    cfg = config.compose(["model=qwen32b", "quant=nvfp4", "target=b200", "runtime=trtllm_llmapi"])
    from pipeline.planning import effective_tp
    from pipeline.runtime import trtllm

    (eng / "llmapi.json").write_text(json.dumps(trtllm.llmapi_options(config.to_plain(cfg.build), "fp8",
                                                                       effective_tp(cfg), 1)))
    _tokenizer_into(eng, tiny_build)
    assert render_repository(cfg, repo) == ["tensorrt_llm"]
    doc = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert doc["model"] == "engine" and doc["backend"] == "pytorch"
    assert doc["triton_config"] == {"max_batch_size": 8, "decoupled": True}
    assert doc["kv_cache_config"]["dtype"] == "fp8" and doc["tensor_parallel_size"] == 1
    assert lint.lint(repo) == []


# ---------------------------------------------------------------------------------------------------- lint rules
def _reference_repo(tiny_build: Path, tmp_path: Path) -> Path:
    src = next(tiny_build.glob("triton_repo/*-package-*/manifest.json")).parent
    dst = tmp_path / "repo"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("manifest.json"))
    for p in dst.rglob("*"):
        p.chmod(p.stat().st_mode | stat.S_IWUSR)
    return dst


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def test_the_packaged_repository_is_clean(tiny_build, tmp_path):
    assert lint.lint(_reference_repo(tiny_build, tmp_path)) == []
    proc = run_cli("lint", str(_reference_repo(tiny_build, tmp_path / "x")), root=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("ok:")


@pytest.mark.parametrize("rule, edit, expected", [
    ("schema", ("ensemble/config.pbtxt", "max_batch_size: 8", "max_batch_size: eight"),
     "not a valid Triton model config"),
    ("placeholder", ("preprocessing/config.pbtxt", 'string_value: "tensorrt_llm/1/engine"',
                     'string_value: "${tokenizer_dir}"'), "unfilled placeholder ${tokenizer_dir}"),
    ("ensemble tensor", ("ensemble/config.pbtxt", 'value: "_INPUT_ID"', 'value: "_INPUT_IDS"'),
     "reads \"_INPUT_ID\", which no ensemble input or earlier step provides"),
    ("ensemble type", ("ensemble/config.pbtxt", '{ name: "max_tokens" data_type: TYPE_INT32',
                       '{ name: "max_tokens" data_type: TYPE_INT64'), "\"max_tokens\" is TYPE_INT64 but"),
    ("batch size", ("tensorrt_llm/config.pbtxt", "max_batch_size: 8", "max_batch_size: 4"),
     "max_batch_size 8 exceeds step model \"tensorrt_llm\"'s 4"),
    ("streaming needs decoupled", ("tensorrt_llm/config.pbtxt", "decoupled: true", "decoupled: false"),
     "has a streaming input but is not decoupled"),
    ("tokenizer_dir", ("postprocessing/config.pbtxt", 'string_value: "tensorrt_llm/1/engine"',
                       'string_value: "tensorrt_llm/1/nowhere"'), "tokenizer_dir tensorrt_llm/1/nowhere has no tokenizer"),
    ("engine_dir", ("tensorrt_llm/config.pbtxt", 'key: "engine_dir" value: { string_value: "tensorrt_llm/1/engine"',
                    'key: "engine_dir" value: { string_value: "/models/missing"'), "engine_dir /models/missing does not exist"),
])
def test_each_lint_rule_catches_its_breakage(tiny_build, tmp_path, rule, edit, expected):
    repo = _reference_repo(tiny_build, tmp_path)
    _edit(repo / edit[0], edit[1], edit[2])
    findings = lint.lint(repo)
    assert any(expected in f for f in findings), findings
    proc = run_cli("lint", str(repo), root=tmp_path / "cwd")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert any(expected in line for line in proc.stderr.splitlines())


def test_engine_rules_rank_files_batch_size_and_version(tiny_build, tmp_path):
    repo = engine_repo(tmp_path / "a", tiny_build, world=2)
    (repo / ENGINE_REL / "rank1.engine").unlink()
    assert any("lacks rank1.engine for world size 2" in f for f in lint.lint(repo))
    repo = engine_repo(tmp_path / "b", tiny_build, engine_bs=4, extra=("build.max_batch_size=8",))
    cfgf = repo / "tensorrt_llm" / "config.pbtxt"
    assert "max_batch_size: 4" in cfgf.read_text()  # packaging clamps to the engine's
    _edit(cfgf, "max_batch_size: 4", "max_batch_size: 16")
    assert any("exceeds the engine's 4" in f for f in lint.lint(repo))
    repo = engine_repo(tmp_path / "c", tiny_build, version="1.2.0")
    assert any("built by TensorRT-LLM 1.2.0, serving container has 1.2.1" in f
               for f in lint.lint(repo, trtllm_version="1.2.1"))
    _edit(repo / "tensorrt_llm" / "config.pbtxt", 'key: "decoupled_mode"' if False else "decoupled: true",
          "decoupled: false")
    assert any("not decoupled" in f for f in lint.lint(repo))


def test_lint_of_a_non_repository_is_one_line(tmp_path):
    proc = run_cli("lint", str(tmp_path / "nothing"), root=tmp_path / "cwd")
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {tmp_path / 'nothing'}: no such directory"


def test_engine_layout_python_models_load_in_the_real_server(tiny_build, tmp_path):
    """preprocessing, postprocessing and the BLS of the engine layout load in tritonserver; the C++ tensorrtllm
    backend does not exist here, so that one model is left out of this repository copy."""
    import urllib.request

    repo = engine_repo(tmp_path, tiny_build)
    models = ["preprocessing", "postprocessing", "tensorrt_llm_bls"]  # not tensorrt_llm (C++ backend), not ensemble
    with server.running(repo, host="127.0.0.1", server_bin=None, work_dir=tmp_path / "w", timeout_s=180,
                        models=models) as s:
        for m in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
            with urllib.request.urlopen(f"{s.http_url}/v2/models/{m}/ready", timeout=5) as r:
                assert r.status == 200, m


# --------------------------------------------------------------------------------------------------------- bench
def test_bench_json_keeps_genai_perf_fields_and_both_workloads(tiny_build):
    out = next(tiny_build.glob(".store/*-bench-*/manifest.json")).parent
    doc = json.loads((out / "bench.json").read_text())
    assert set(doc["workloads"]) == {"chat", "rag"}
    lv = doc["workloads"]["rag"]["levels"][0]
    for key in ("time_to_first_token", "inter_token_latency", "request_latency"):
        assert set(lv[key]) >= {"unit", "avg", "p50", "p95", "p99"} and lv[key]["unit"] == "ms"
    assert lv["output_token_throughput"]["unit"] == "tokens/sec" and lv["request_throughput"]["avg"] > 0
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["gates"]["verdict"] == "pass"
    chat, rag = doc["workloads"]["chat"], doc["workloads"]["rag"]
    assert rag["prompt_words"] > chat["prompt_words"] and rag["max_tokens"] < chat["max_tokens"]


def test_requests_are_drawn_reproducibly():
    from pipeline.stages.bench import make_prompts

    assert make_prompts(5, 40, 3) == make_prompts(5, 40, 3) != make_prompts(5, 40, 4)
    assert all(len(p.split()) >= 40 for p in make_prompts(5, 40, 3))


def _copy(tiny_build: Path, dst: Path) -> Path:
    shutil.copytree(tiny_build, dst)
    return dst


def test_bls_entry_point_and_an_absolute_gate_breach(tiny_build, tmp_path):
    root = _copy(tiny_build, tmp_path / "g")
    proc = run_cli("build", *TINY, "bench.model=tensorrt_llm_bls", "bench.workloads=[chat]",
                   "bench.gates.ttft_p95_ms=0.001", root=root)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "chat at concurrency 1: TTFT p95" in proc.stderr and "> 0.001 ms" in proc.stderr
    kept = next((root / "reports" / "failed").glob("*-bench-*/bench.json"))
    doc = json.loads(kept.read_text())
    assert doc["model"] == "tensorrt_llm_bls" and doc["workloads"]["chat"]["levels"][0]["error_count"] == 0


def test_regression_against_the_previous_published_bundle(tiny_build, tmp_path):
    root = _copy(tiny_build, tmp_path / "r")
    bundle = next(root.glob(f"bundles/{LABEL}-publish-*/bundle.json"))
    bundle.chmod(0o644)
    doc = json.loads(bundle.read_text())
    for rows in doc["bench"]["workloads"].values():
        for lv in rows:
            lv["output_tokens_per_s"] *= 100  # the previous build was (recorded as) 100x faster
    bundle.write_text(json.dumps(doc))
    proc = run_cli("build", *TINY, "force=[bench]", "bench.gates.regression_pct=25", root=root)
    assert proc.returncode == 1
    assert "output tokens/s" in proc.stderr and "in the previous bundle (-99%, allowed 25%)" in proc.stderr


def test_external_launcher_uses_a_running_server(tiny_build, tmp_path):
    root = _copy(tiny_build, tmp_path / "e")
    repo = next(root.glob("triton_repo/*-package-*/manifest.json")).parent
    with server.running(repo, host="127.0.0.1", server_bin=None, work_dir=tmp_path / "w", timeout_s=180) as s:
        proc = run_cli("build", *TINY, "force=[bench]", "until=bench", "serve.launcher=external",
                       f"serve.url={s.grpc_url}", root=root)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert statuses(root)["bench"] == "ran"
    from tests.conftest import report

    out = next(Path(r["output"]) for r in report(root)["stages"] if r["stage"] == "bench")
    assert json.loads((out / "bench.json").read_text())["launcher"] == "external"


def test_docker_launcher_command_and_its_clear_refusal(tmp_path):
    cmd = server.docker_command(Path("/srv/repo"), image="nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3",
                                mount="/models", host="127.0.0.1", http_port=18000, grpc_port=18001, name="b")
    assert cmd[:2] == ["docker", "run"] and "--gpus" in cmd and "/srv/repo:/models:ro" in cmd
    assert "127.0.0.1:18001:8001" in cmd and "--model-repository=/models" in cmd
    cfg = config.compose(["serve.launcher=docker"])
    if shutil.which("docker") and os.system("docker info >/dev/null 2>&1") == 0:
        pytest.skip("a Docker engine runs here; the refusal path is for machines without one")
    with pytest.raises(UserError, match="serve.launcher=docker"):
        with server.launched(cfg.serve, tmp_path, tmp_path / "w"):
            pass
