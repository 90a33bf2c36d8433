"""Triton repositories for every layout, the linter (one broken repository per rule), the python models in a real
tritonserver, the bench launchers, workloads, BLS entry point and gates."""
from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from pipeline import config, hardware
from pipeline.errors import UserError
from pipeline.catalog import ENGINE_REL
from pipeline.triton.repository import render_repository
from pipeline.triton import lint, server
from tests.conftest import TINY, report, run_cli, statuses

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
    cfg = hardware.compose(["model=qwen32b", "quant=fp8", "target=h100", "runtime=trtllm_engine", *extra])
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
    assert params["gpt_model_path"] == params["tokenizer_dir"] == "/models/tensorrt_llm/1/engine"
    assert "engine_dir" not in params  # the C++ backend reads gpt_model_path; engine_dir is read by nothing
    # guided decoding as tensorrtllm_backend docs/guided_decoding.md sets it up for the C++ backend
    assert params["guided_decoding_backend"] == "xgrammar"
    assert params["xgrammar_tokenizer_info_path"] == "/models/tensorrt_llm/1/xgrammar_tokenizer_info.json"
    assert (repo / "tensorrt_llm" / "1" / "xgrammar_tokenizer_info.json").is_file()
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.9"
    assert int(params["max_tokens_in_paged_kv_cache"]) > 100_000  # from the capacity planner (Qwen3-32B, FP8 KV)
    assert params["max_beam_width"] == "1"
    types = {t.name: t.data_type for t in [*cfg.input, *cfg.output]}
    assert types["encoder_input_features"] and types["context_logits"]  # the data-type placeholders are filled
    assert lint.lint(repo, trtllm_version="1.2.1") == []


def _step(ensemble, model: str):
    return next(s for s in ensemble.ensemble_scheduling.step if s.model_name == model)


def test_engine_ensemble_feeds_the_tokenizers_end_and_pad_ids(tiny_build, tmp_path):
    """The ensemble feeds preprocessing's OUT_END_ID/OUT_PAD_ID to tensorrt_llm's end_id/pad_id (INT32 throughout);
    the ensemble and the BLS take optional end_id/pad_id from the caller, which preprocessing prefers."""
    from pipeline.triton.render import parse_model_config

    repo = engine_repo(tmp_path, tiny_build)
    cfgs = {m: parse_model_config((repo / m / "config.pbtxt").read_text())
            for m in ("ensemble", "preprocessing", "tensorrt_llm", "tensorrt_llm_bls")}
    pre, llm = _step(cfgs["ensemble"], "preprocessing"), _step(cfgs["ensemble"], "tensorrt_llm")
    assert pre.input_map["END_ID"] == "end_id" and pre.input_map["PAD_ID"] == "pad_id"
    assert llm.input_map["end_id"] == pre.output_map["OUT_END_ID"] == "_PREPROCESSOR_END_ID"
    assert llm.input_map["pad_id"] == pre.output_map["OUT_PAD_ID"] == "_PREPROCESSOR_PAD_ID"
    outputs = {o.name: o.data_type for o in cfgs["preprocessing"].output}
    inputs = {i.name: i.data_type for i in cfgs["tensorrt_llm"].input}
    assert outputs["OUT_END_ID"] == outputs["OUT_PAD_ID"] == inputs["end_id"] == inputs["pad_id"]
    for entry in ("ensemble", "tensorrt_llm_bls"):
        assert {"end_id", "pad_id"} <= {i.name for i in cfgs[entry].input if i.optional}
    assert lint.lint(repo, trtllm_version="1.2.1") == []


def llmapi_repo(tmp_path: Path, tiny_build: Path, *, extra: tuple[str, ...] = ()) -> Path:
    """An llmapi repository for Qwen3-32B NVFP4 on b200, around LLM-API options written as the build writes them."""
    from pipeline import planning
    from pipeline.runtime import trtllm

    repo = tmp_path / "llmapi"
    eng = repo / ENGINE_REL
    eng.mkdir(parents=True)
    cfg = hardware.compose(["model=qwen32b", "quant=nvfp4", "target=b200", "runtime=trtllm_llmapi", *extra])
    (eng / "llmapi.json").write_text(json.dumps(trtllm.llmapi_options(config.to_plain(cfg.build), "fp8",
                                                                       planning.resolve(cfg).tp, 1,
                                                                       chunked_prefill=True)))
    _tokenizer_into(eng, tiny_build)
    assert render_repository(cfg, repo) == ["tensorrt_llm"]
    return repo


def test_llm_instance_count_reaches_the_engine_and_llmapi_models(tiny_build, tmp_path):
    """llmapi: N instances in one group, each with its GPUs in gpu_device_ids (upstream's multi-instance form); the
    C++ backend's tensorrt_llm model keeps upstream's single instance (it batches in flight itself)."""
    from pipeline.triton.render import parse_model_config

    for repo, count in ((engine_repo(tmp_path / "e", tiny_build, extra=("serve.llm_instance_count=3",)), 1),
                        (llmapi_repo(tmp_path / "l", tiny_build, extra=("serve.llm_instance_count=3",)), 3)):
        cfg = parse_model_config((repo / "tensorrt_llm" / "config.pbtxt").read_text())
        assert [g.count for g in cfg.instance_group] == [count], repo
        if count > 1:
            assert len(cfg.parameters["gpu_device_ids"].string_value.split(";")) == count
        assert lint.lint(repo) == []


def test_llmapi_layout_has_model_yaml_from_the_options(tiny_build, tmp_path):
    import yaml

    repo = llmapi_repo(tmp_path, tiny_build)
    doc = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert doc["model"] == "/models/tensorrt_llm/1/engine" and doc["backend"] == "pytorch"
    assert doc["triton_config"] == {"max_batch_size": 0, "decoupled": True}  # upstream's: 1-D requests
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
    ("placeholder", ("preprocessing/config.pbtxt", 'string_value: "/models/tensorrt_llm/1/engine"',
                     'string_value: "${tokenizer_dir}"'), "unfilled placeholder ${tokenizer_dir}"),
    ("ensemble tensor", ("ensemble/config.pbtxt", 'value: "_INPUT_ID"', 'value: "_INPUT_IDS"'),
     "reads \"_INPUT_ID\", which no ensemble input or earlier step provides"),
    ("ensemble type", ("ensemble/config.pbtxt", '{ name: "max_tokens" data_type: TYPE_INT32',
                       '{ name: "max_tokens" data_type: TYPE_INT64'), "\"max_tokens\" is TYPE_INT64 but"),
    ("batch size", ("tensorrt_llm/config.pbtxt", "max_batch_size: 8", "max_batch_size: 4"),
     "max_batch_size 8 exceeds step model \"tensorrt_llm\"'s 4"),
    ("upstream tensor", ("tensorrt_llm/config.pbtxt", '{ name: "beam_width"', '{ name: "beam_widths"'),
     'tensorrt_llm/config.pbtxt: upstream input "beam_width" is missing'),
    ("tokenizer_dir", ("postprocessing/config.pbtxt", 'string_value: "/models/tensorrt_llm/1/engine"',
                       'string_value: "/models/tensorrt_llm/1/nowhere"'),
     "tokenizer_dir /models/tensorrt_llm/1/nowhere has no tokenizer"),
    ("engine_dir", ("tensorrt_llm/config.pbtxt", 'key: "engine_dir" value: { string_value: "tensorrt_llm/1/engine"',
                    'key: "engine_dir" value: { string_value: "/models/missing"'), "engine_dir /models/missing does not exist"),
    ("engine_dir off the mount", ("tensorrt_llm/config.pbtxt",
                                  'key: "engine_dir" value: { string_value: "tensorrt_llm/1/engine"',
                                  'key: "engine_dir" value: { string_value: "/wrong/mount/tensorrt_llm/1/engine"'),
     "engine_dir /wrong/mount/tensorrt_llm/1/engine is outside the repository; make it relative to the repository "
     "root, or absolute under"),
    ("tokenizer_dir off the mount", ("preprocessing/config.pbtxt", 'string_value: "/models/tensorrt_llm/1/engine"',
                                     'string_value: "/wrong/mount/tensorrt_llm/1/engine"'),
     "tokenizer_dir /wrong/mount/tensorrt_llm/1/engine is outside the repository"),
    ("decoupled_mode", ("tensorrt_llm/config.pbtxt", 'parameters { key: "engine_dir"',
                        'parameters { key: "decoupled_mode" value: { string_value: "false" } }\n'
                        'parameters { key: "engine_dir"'),
     "parameter decoupled_mode=false disagrees with the transaction policy (decoupled: true)"),
])
def test_each_lint_rule_catches_its_breakage(tiny_build, tmp_path, rule, edit, expected):
    repo = _reference_repo(tiny_build, tmp_path)
    _edit(repo / edit[0], edit[1], edit[2])
    findings = lint.lint(repo)
    assert any(expected in f for f in findings), findings
    proc = run_cli("lint", str(repo), root=tmp_path / "cwd")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert any(expected in line for line in proc.stderr.splitlines())


def test_absolute_paths_only_under_the_repository_or_its_mount(tiny_build, tmp_path):
    repo = _reference_repo(tiny_build, tmp_path)
    cfgf = repo / "tensorrt_llm" / "config.pbtxt"
    _edit(cfgf, 'string_value: "tensorrt_llm/1/engine"', f'string_value: "{repo.resolve() / ENGINE_REL}"')
    assert lint.lint(repo) == []
    _edit(cfgf, f'string_value: "{repo.resolve() / ENGINE_REL}"', 'string_value: "/srv/models/tensorrt_llm/1/engine"')
    for f in repo.glob("*/config.pbtxt"):  # every container path moves to the other mount
        f.write_text(f.read_text().replace('"/models/', '"/srv/models/'))
    assert lint.lint(repo, repo_mount="/srv/models") == []
    findings = lint.lint(repo)
    assert ("tensorrt_llm/config.pbtxt: engine_dir /srv/models/tensorrt_llm/1/engine is outside the "
            "repository; make it relative to the repository root, or absolute under "
            f"{repo.absolute()} or under the container mount /models (serve.repo_mount)") in findings
    repo = engine_repo(tmp_path / "e", tiny_build, extra=("serve.repo_mount=/srv/models",))
    assert lint.lint(repo, repo_mount="/srv/models") == []
    assert any("gpt_model_path /srv/models/tensorrt_llm/1/engine is outside the repository" in f
               for f in lint.lint(repo))
    assert run_cli("lint", str(repo), root=tmp_path / "cwd").returncode == 2
    proc = run_cli("lint", str(repo), "--repo-mount", "/srv/models", root=tmp_path / "cwd")
    assert proc.returncode == 0 and proc.stdout.startswith("ok: "), proc.stderr


@pytest.mark.parametrize("edit, expected", [
    ({"triton_config": {"max_batch_size": 0}},
     "tensorrt_llm/1/model.yaml: triton_config needs max_batch_size and decoupled"),
    ({"model": "/models/tensorrt_llm/1/missing"},
     "tensorrt_llm/1/model.yaml: model '/models/tensorrt_llm/1/missing' does not exist in the repository"),
    ({"model": "checkpoint"}, "tensorrt_llm/1/model.yaml: model 'checkpoint' is relative"),
    ({"model": "/wrong/mount/tensorrt_llm/1/engine"},
     "tensorrt_llm/1/model.yaml: model /wrong/mount/tensorrt_llm/1/engine is outside the repository"),
])
def test_llmapi_model_yaml_rule_catches_its_breakage(tiny_build, tmp_path, edit, expected):
    import yaml

    repo = llmapi_repo(tmp_path, tiny_build)
    path = repo / "tensorrt_llm" / "1" / "model.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **edit}, sort_keys=False))
    findings = lint.lint(repo)
    assert len(findings) == 1 and findings[0].startswith(expected), findings
    proc = run_cli("lint", str(repo), root=tmp_path / "cwd")
    assert proc.returncode == 2 and f"error: {findings[0]}" in proc.stderr.splitlines()


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
    _edit(repo / "tensorrt_llm" / "config.pbtxt", "decoupled: true", "decoupled: false")
    assert not any("not decoupled" in f for f in lint.lint(repo))  # unary serving (upstream's quick start) is valid


def test_lint_of_a_non_repository_is_one_line(tmp_path):
    proc = run_cli("lint", str(tmp_path / "nothing"), root=tmp_path / "cwd")
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {tmp_path / 'nothing'}: no such directory"


def test_engine_layout_python_models_load_in_the_real_server(tiny_build, tmp_path):
    """preprocessing, postprocessing and the BLS of the engine layout load in tritonserver, and preprocessing emits
    the tokenizer's eos/pad ids; the C++ tensorrtllm backend does not exist here, so that one model is left out."""
    import urllib.request

    import numpy as np
    import tritonclient.grpc as grpcclient
    from transformers import AutoTokenizer

    repo = engine_repo(tmp_path, tiny_build)
    tok = AutoTokenizer.from_pretrained(repo / ENGINE_REL)
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    assert eos is not None

    def preprocess(client, **ids):
        inputs = []
        for name, arr, dtype in (("QUERY", np.array([["The capital of France is".encode()]], dtype=object), "BYTES"),
                                 ("REQUEST_OUTPUT_LEN", np.array([[4]], dtype=np.int32), "INT32"),
                                 *((k, np.array([[v]], dtype=np.int32), "INT32") for k, v in ids.items())):
            inputs.append(grpcclient.InferInput(name, list(arr.shape), dtype))
            inputs[-1].set_data_from_numpy(arr)
        res = client.infer("preprocessing", inputs)
        return int(res.as_numpy("OUT_END_ID").reshape(-1)[0]), int(res.as_numpy("OUT_PAD_ID").reshape(-1)[0])

    models = ["preprocessing", "postprocessing", "tensorrt_llm_bls"]  # not tensorrt_llm (C++ backend), not ensemble
    with server.local_server(repo, host="127.0.0.1", server_bin=None, work_dir=tmp_path / "w", timeout_s=180,
                        models=models) as s:
        for m in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
            with urllib.request.urlopen(f"{s.http_url}/v2/models/{m}/ready", timeout=5) as r:
                assert r.status == 200, m
        client = grpcclient.InferenceServerClient(s.grpc_url)
        try:
            assert preprocess(client) == (eos, pad)  # the tokenizer's eos, pad falling back to eos
            assert preprocess(client, END_ID=7, PAD_ID=9) == (7, 9)  # the caller's, when given
        finally:
            client.close()


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


def test_requests_jsonl_has_one_line_per_request_sent(tiny_build):
    out = next(tiny_build.glob(".store/*-bench-*/manifest.json")).parent
    doc = json.loads((out / "bench.json").read_text())
    lines = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    fields = {"phase", "path", "workload", "concurrency", "prompt_index", "time_to_first_token_ms", "inter_token_latency_ms",
              "inter_chunk_latencies_ms", "request_latency_ms", "output_tokens", "responses", "error"}
    assert all(set(r) == fields for r in lines)
    measured = [r for r in lines if r["phase"] == "measure" and r["path"] == "grpc"]
    via_openai = [r for r in lines if r["phase"] == "measure" and r["path"] == "openai"]
    for wname, w in doc["workloads"].items():
        for key, rows in (("levels", measured), ("openai_levels", via_openai)):  # the OpenAI rows beside the gRPC
            assert [lv["concurrency"] for lv in w[key]] == [lv["concurrency"] for lv in w["levels"]]
            for lv in w[key]:
                here = [r for r in rows if r["workload"] == wname and r["concurrency"] == lv["concurrency"]]
                assert len(here) == lv["request_count"]
                assert sum(r["error"] is not None for r in here) == lv["error_count"]
    first = list(doc["workloads"])[0]  # TINY: 1 warm-up, sent once before the first workload
    assert [r["workload"] for r in lines if r["phase"] == "warmup"] == [first]
    assert len([r for r in lines if r["phase"] == "check"]) == len(doc["answers"])
    assert len(lines) == len(measured) + len(via_openai) + 1 + len(doc["answers"])
    for r in lines:
        assert r["error"] is None and r["request_latency_ms"] > 0
        # every response that carried text is a chunk; the stream may end with an empty final response
        assert 0 < len(r["inter_chunk_latencies_ms"]) + 1 <= r["responses"]
        if r["output_tokens"]:
            assert 0 < r["time_to_first_token_ms"] <= r["request_latency_ms"]
        if r["output_tokens"] >= 2:  # aiperf's inter-token latency, from the re-tokenized count
            expected = (r["request_latency_ms"] - r["time_to_first_token_ms"]) / (r["output_tokens"] - 1)
            assert r["inter_token_latency_ms"] == pytest.approx(expected, abs=0.01)
    assert sum(r["output_tokens"] for r in measured) == sum(
        round(lv["output_sequence_length"]["avg"] * lv["request_count"]) for w in doc["workloads"].values()
        for lv in w["levels"])


def test_requests_are_drawn_reproducibly():
    from pipeline.stages.bench import make_prompts

    assert make_prompts(5, 40, 3) == make_prompts(5, 40, 3) != make_prompts(5, 40, 4)
    assert all(len(p.split()) >= 40 for p in make_prompts(5, 40, 3))


def _copy(tiny_build: Path, dst: Path) -> Path:
    shutil.copytree(tiny_build, dst)
    return dst


@pytest.mark.slow  # a bench of its own through the BLS entry point (~16 s on 2 cores)
def test_bls_entry_point_and_an_absolute_gate_breach(tiny_build, tmp_path):
    root = _copy(tiny_build, tmp_path / "g")
    proc = run_cli("build", *TINY, "bench.model=tensorrt_llm_bls", "bench.only=[chat]",
                   "bench.gates.ttft_p95_ms=0.001", root=root)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "chat at concurrency 1: TTFT p95" in proc.stderr and "> 0.001 ms" in proc.stderr
    kept = next((root / "reports" / "failed").glob("*-bench-*/bench.json"))
    doc = json.loads(kept.read_text())
    assert doc["model"] == "tensorrt_llm_bls" and doc["workloads"]["chat"]["levels"][0]["error_count"] == 0


REGRESSIONS = {"output_tokens_per_s": (100, r"output tokens/s [\d.]+ vs [\d.]+ in the previous bundle \(-(99|100)%, "
                                              r"allowed 25%\)"),
               "ttft_p95_ms": (0.01, r"TTFT p95 [\d.]+ vs [\d.]+ in the previous bundle \(\+\d+%, allowed 25%\)")}


@pytest.mark.slow  # two bench and publish re-runs against a planted previous bundle (~29 s on 2 cores)
def test_regression_against_the_previous_published_bundle(tiny_build, tmp_path):
    """The previous published bundle (the only version at publish.dest) was (recorded as) 100x faster in output
    tokens/s and in TTFT p95: the gate names each metric and by how much; by default a CPU target reports them
    without failing on them."""
    import re

    root = _copy(tiny_build, tmp_path / "r")
    [bundle] = (root / "published").glob("tiny-qwen3/*/cpu/reference/v*/bundle.json")
    bundle.chmod(0o644)
    doc = json.loads(bundle.read_text())
    for rows in doc["bench"]["workloads"].values():
        for lv in rows:
            for key, (factor, _) in REGRESSIONS.items():
                lv[key] *= factor
    bundle.write_text(json.dumps(doc))
    proc = run_cli("build", *TINY, "force=[bench]", "bench.only=[chat]", "bench.gates.regression_pct=25",
                   "bench.gates.regression_on_cpu=true", root=root)
    assert proc.returncode == 1
    for _, expected in REGRESSIONS.values():
        assert re.search(expected, proc.stderr), (expected, proc.stderr[-2000:])
    proc = run_cli("build", *TINY, "force=[bench]", "bench.only=[chat]", "bench.gates.regression_pct=25", root=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = next(Path(r["output"]) for r in report(root)["stages"] if r["stage"] == "bench")
    gates = json.loads((out / "bench.json").read_text())["gates"]
    assert gates["verdict"] == "pass" and not gates["regressions_gated"]
    for _, expected in REGRESSIONS.values():
        assert any(re.search(expected, x) for x in gates["regressions"]), (expected, gates)
    assert "Slower than the previous bundle (reported only" in (out / "bench.md").read_text()


@pytest.mark.slow  # a server and a bench run of its own
def test_external_launcher_uses_a_running_server_of_this_package_only(tiny_build, tmp_path):
    """serve.launcher=external measures a server only once its models and configs match the packaged repository's:
    the same server is refused, in one line, for a package of the llmapi layout, and a planted difference in one
    tensor of one model is named."""
    from pipeline.stages.bench import packaged_configs
    from pipeline.stages.bench import triton_client as client

    root = _copy(tiny_build, tmp_path / "e")
    repo = next(root.glob("triton_repo/*-package-*/manifest.json")).parent
    with server.local_server(repo, host="127.0.0.1", server_bin=None, work_dir=tmp_path / "w", timeout_s=180) as s:
        proc = run_cli("build", *TINY, "force=[bench]", "until=bench", "bench.only=[chat]",
                       "serve.launcher=external", f"serve.url={s.grpc_url}", root=root)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert statuses(root)["bench"] == "ran"
        out = next(Path(r["output"]) for r in report(root)["stages"] if r["stage"] == "bench")

        packaged = packaged_configs(repo)
        assert client.server_model_mismatches(s.grpc_url, packaged) == []
        inp = next(i for i in packaged["ensemble"].input if i.name == "max_tokens")
        inp.dims[:] = [7]
        assert client.server_model_mismatches(s.grpc_url, packaged) == [
            "model 'ensemble': input 'max_tokens' is TYPE_INT32 dims [1], packaged TYPE_INT32 dims [7]"]

        bad = run_cli("build", *TINY, "serve.layout=llmapi", "until=bench", "serve.launcher=external",
                      f"serve.url={s.grpc_url}", root=root)
        assert bad.returncode == 2, bad.stderr[-2000:]
        line = bad.stderr.strip().splitlines()[-1]
        assert line.startswith(f"error: the server at {s.grpc_url} does not serve this package's repository: "
                               f"model 'tensorrt_llm': "), line
        assert "point serve.url at a server of" in line and "Traceback" not in bad.stderr
    assert json.loads((out / "bench.json").read_text())["launcher"] == "external"


def test_docker_launcher_command_and_its_clear_refusal(tmp_path):
    cmd = server.docker_command(Path("/srv/repo"), image="nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3",
                                mount="/models", host="127.0.0.1", http_port=18000, grpc_port=18001, name="b")
    assert cmd[:2] == ["docker", "run"] and "--gpus" in cmd and "/srv/repo:/models:ro" in cmd
    assert "127.0.0.1:18001:8001" in cmd and "--model-repository=/models" in cmd
    assert not [x for x in cmd if x.endswith(":8002")]  # no metrics port unless asked (the bench's server)
    watched = server.docker_command(Path("/srv/repo"), image="img", mount="/models", host="127.0.0.1", http_port=1,
                                    grpc_port=2, name="b", metrics_port=18002)
    assert "127.0.0.1:18002:8002" in watched  # pipeline serve's: Triton's metrics on loopback
    cfg = hardware.compose(["serve.launcher=docker"])
    if shutil.which("docker") and os.system("docker info >/dev/null 2>&1") == 0:
        pytest.skip("a Docker engine runs here; the refusal path is for machines without one")
    with pytest.raises(UserError, match="serve.launcher=docker"):
        with server.launched(cfg.serve, tmp_path, tmp_path / "w"):
            pass
