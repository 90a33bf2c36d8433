"""Targets, the quant × SM × runtime compatibility rules, the KV-capacity planner, the TRT-LLM adapters' arguments,
and the fan-out launchers."""
from __future__ import annotations

import json
import time

import pytest

from pipeline import capacity, compat, config
from pipeline.errors import UserError
from pipeline.runtime import trtllm
from tests.conftest import TINY, run_cli

TARGETS = {"a100": 80, "a10g": 86, "l40s": 89, "h100": 90, "h200": 90, "b200": 100, "gb200": 100,
           "rtx-pro-6000": 120}
# The support matrix (FACTS §2), written out independently of pipeline/compat.py.
SERVES = {
    "fp8": {89, 90, 100, 120}, "nvfp4": {100, 120}, "int4_awq": {80, 86, 89, 90}, "w4a8_awq": {89, 90},
    "int8_sq": {80, 86, 89, 90}, "none": {80, 86, 89, 90, 100, 120},
}
KV_SERVES = {"none": {80, 86, 89, 90, 100, 120}, "fp8": {80, 86, 89, 90, 100, 120}, "nvfp4": {100, 120}}


def test_every_shipped_target_has_its_sm_memory_and_gpus():
    for name, sm in TARGETS.items():
        cfg = config.compose([f"target={name}"])
        assert cfg.target.sm == sm and cfg.target.memory_gb > 0 and cfg.target.gpus_per_node > 0
        assert cfg.target.device.value == "cuda"
    assert config.compose(["target=cpu"]).target.device.value == "cpu"


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("quant", list(SERVES))
@pytest.mark.parametrize("kv", list(KV_SERVES))
@pytest.mark.parametrize("runtime", ["trtllm_engine", "trtllm_llmapi"])
def test_compatibility_table(target, quant, kv, runtime):
    sm = TARGETS[target]
    found = compat.problems(quant, kv, target, sm, "cuda", runtime)
    ok_quant = sm in SERVES[quant] and not (runtime == "trtllm_llmapi" and quant == "int8_sq")
    ok_kv = sm in KV_SERVES[kv]
    assert (not found) == (ok_quant and ok_kv), found
    for p in found:
        assert "use" in p  # every refusal says what would work


def test_refusal_wording_and_cpu_targets():
    assert compat.problems("nvfp4", "fp8", "h100", 90, "cuda", "trtllm_engine") == [
        "nvfp4 needs Blackwell (sm100/sm120); for h100 use fp8 or int4_awq"]
    assert "quant.kv_cache=nvfp4 needs Blackwell" in compat.problems("fp8", "nvfp4", "h200", 90, "cuda",
                                                                      "trtllm_llmapi")[0]
    assert "needs a GPU target" in compat.problems("fp8", "fp8", "cpu", 0, "cpu", "trtllm_engine")[0]
    assert compat.problems("nvfp4", "nvfp4", "cpu", 0, "cpu", "reference") == []  # dequantized on CPU


def test_plan_refuses_nvfp4_on_h100_within_seconds_and_writes_nothing(tmp_path):
    t0 = time.perf_counter()
    proc = run_cli("plan", "model=qwen32b", "quant=nvfp4", "target=h100", root=tmp_path)
    assert time.perf_counter() - t0 < 10
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: nvfp4 needs Blackwell (sm100/sm120); for h100 use fp8 or int4_awq"
    assert not any(tmp_path.rglob("*"))


def test_plan_json_shows_chosen_tp_and_kv_capacity_table(tmp_path):
    proc = run_cli("plan", "--json", "model=qwen32b", "quant=fp8", "target=h100", "runtime=trtllm_engine",
                   root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    cap = doc["capacity"]
    assert doc["tp"] == cap["tp"] == 1 and cap["tp_chosen_by_planner"]
    rows = {r["kv_dtype"]: r for r in cap["table"]}
    assert rows["bf16"]["kv_kib_per_token_per_gpu"] == 256.0  # 64 layers × 8 KV heads × 128 × 2 × 2 B
    assert rows["fp8"]["kv_kib_per_token_per_gpu"] == 128.0
    assert rows["fp8"]["max_tokens"] == 2 * rows["bf16"]["max_tokens"] or \
        abs(rows["fp8"]["max_tokens"] - 2 * rows["bf16"]["max_tokens"]) <= 1
    assert any("needs its GPU" in p for p in doc["not_buildable_here"])


LLAMA31_8B = capacity.Shape(params=8.03e9, num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32,
                            num_kv_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False)


def test_kv_bytes_per_token_hand_computed():
    assert capacity.kv_bytes_per_token(LLAMA31_8B, "bf16") == 128 * 1024
    assert capacity.kv_bytes_per_token(LLAMA31_8B, "fp8") == 64 * 1024
    assert capacity.kv_bytes_per_token(LLAMA31_8B, "bf16", tp=2) == 64 * 1024  # 4 KV heads per rank
    assert capacity.kv_bytes_per_token(LLAMA31_8B, "bf16", tp=16) == 16 * 1024  # 8 heads over 16 ranks: replicated
    assert capacity.kv_bytes_per_token(LLAMA31_8B, "bf16", pp=2) == 64 * 1024  # half the layers per stage


def test_pool_tokens_and_sequences_hand_computed():
    p = capacity.plan(LLAMA31_8B, "fp8", "fp8", 80, 8, tp=1, fraction=0.9, max_num_tokens=8192,
                      input_len=1024, output_len=256)
    embed = 128256 * 4096 * 2
    weights = embed * 2 + (8.03e9 - embed) * 1.0
    act = 1.5e9 + 8192 * (4 * 4096 + 2 * 14336) * 2
    pool = (80e9 - weights - act) * 0.9
    fp8 = p.row("fp8")
    assert abs(p.weights_bytes_per_gpu - weights) < 1 and abs(fp8.pool_bytes - pool) < 1
    assert fp8.max_tokens == int(pool // (64 * 1024)) and fp8.max_sequences == fp8.max_tokens // 1280
    assert p.row("bf16").max_tokens == int(pool // (128 * 1024))


def test_planner_picks_the_smallest_tp_that_fits_and_warns_on_worst_case_demand():
    qwen32b = capacity.shape_from(dict(config.compose(["model=qwen32b"]).model.shape))
    small = capacity.plan(qwen32b, "none", "fp8", 24, 8, max_seq_len=2048)  # 65 GB of bf16 weights on 24 GB GPUs
    assert small.fits and small.tp == 4
    none = capacity.plan(qwen32b, "none", "fp8", 24, 2, max_seq_len=2048)
    assert not none.fits
    crowded = capacity.plan(qwen32b, "fp8", "fp8", 80, 8, max_batch_size=512, max_seq_len=32768)
    assert crowded.warnings and "exceeds the KV pool" in crowded.warnings[0]


def test_plan_refuses_a_model_that_does_not_fit_the_target(tmp_path):
    proc = run_cli("plan", "model=qwen32b", "quant=none", "target=a10g", "build.tp_size=1", root=tmp_path)
    assert proc.returncode == 2 and "does not fit on a10g" in proc.stderr


def test_target_auto_maps_the_local_gpu(monkeypatch):
    """NVML stands in: there is no GPU here. The mapping from what NVML reports to a shipped target is tested."""
    monkeypatch.setattr(config, "local_gpu", lambda: {"name": "NVIDIA H200", "sm": 90, "memory_gb": 150.7})
    assert config.detect_target() == "h200"
    monkeypatch.setattr(config, "local_gpu", lambda: {"name": "NVIDIA H100 80GB HBM3", "sm": 90, "memory_gb": 85.0})
    assert config.detect_target() == "h100"
    monkeypatch.setattr(config, "local_gpu", lambda: None)
    assert config.compose(["target=auto"]).target.name == "cpu"
    monkeypatch.setattr(config, "local_gpu", lambda: {"name": "Tesla T4", "sm": 75, "memory_gb": 16.0})
    with pytest.raises(UserError, match="no shipped target has sm75"):
        config.detect_target()


def test_trtllm_runtime_refused_clearly_without_tensorrt_llm(tmp_path):
    proc = run_cli("build", "model=tiny-qwen3", "target=h100", "runtime=trtllm_llmapi", root=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "needs its GPU" in proc.stderr and "TensorRT-LLM, which is not installed here" in proc.stderr
    assert not any(tmp_path.rglob("*.safetensors"))


def test_trtllm_version_and_engine_backend_checks():
    new = trtllm.TrtllmInfo("1.3.0", "10.13", has_engine_backend=False, trtllm_build=None)
    with pytest.raises(UserError, match="has no TensorRT-engine backend"):
        trtllm.require("trtllm_engine", None, new)
    assert trtllm.require("trtllm_llmapi", None, new) is new
    with pytest.raises(UserError, match="runtime.trtllm_version=1.2.1"):
        trtllm.require("trtllm_llmapi", "1.2.1", new)
    assert trtllm.detect().version is None  # not installable here; the adapters say so


# Upstream names (TensorRT-LLM 1.2: tensorrt_llm/commands/build.py + plugin/plugin.py for trtllm-build flags;
# builder.py BuildConfig and plugin.py PluginConfig fields; llmapi/llm_args.py for the LLM API).
TRTLLM_BUILD_FLAGS = {"--checkpoint_dir", "--output_dir", "--max_batch_size", "--max_input_len", "--max_seq_len",
                      "--max_num_tokens", "--max_beam_width", "--kv_cache_type", "--gemm_plugin",
                      "--use_paged_context_fmha", "--use_fp8_context_fmha", "--multiple_profiles", "--workers",
                      "--input_timing_cache", "--output_timing_cache", "--strip_plan"}
BUILD_CONFIG_FIELDS = {"max_input_len", "max_seq_len", "max_batch_size", "max_beam_width", "max_num_tokens",
                       "opt_num_tokens", "kv_cache_type", "input_timing_cache", "output_timing_cache",
                       "plugin_config", "use_strip_plan"}
PLUGIN_FIELDS = {"gemm_plugin", "use_fp8_context_fmha", "use_paged_context_fmha", "multiple_profiles"}
LLM_ARGS = {"tensor_parallel_size", "pipeline_parallel_size", "max_batch_size", "max_num_tokens", "max_seq_len",
            "kv_cache_config", "cuda_graph_config"}
KV_CACHE_CONFIG = {"free_gpu_memory_fraction", "dtype", "enable_block_reuse", "max_tokens"}
CUDA_GRAPH_CONFIG = {"batch_sizes", "max_batch_size", "enable_padding"}


def _build(*extra):
    return config.to_plain(config.compose(["model=qwen32b", "target=h100", "runtime=trtllm_engine", *extra]).build)


def test_trtllm_build_args_use_upstream_flags():
    args = trtllm.trtllm_build_args(_build(), "FP8", "/ckpt", "/out", "/cache/sm90.cache")
    flags = {a for a in args if a.startswith("--")}
    assert flags <= TRTLLM_BUILD_FLAGS
    assert args[args.index("--use_fp8_context_fmha") + 1] == "enable"
    assert args[args.index("--input_timing_cache") + 1] == "/cache/sm90.cache"
    awq = trtllm.trtllm_build_args(_build(), "W4A16_AWQ", "/c", "/o", None)
    assert awq[awq.index("--use_fp8_context_fmha") + 1] == "disable"  # FP8 context FMHA: FP8/W4A8/NVFP4 only
    assert "--input_timing_cache" not in awq
    bc = trtllm.build_config_kwargs(_build(), "NVFP4", "/t.cache")
    assert set(bc) <= BUILD_CONFIG_FIELDS and set(bc["plugin_config"]) <= PLUGIN_FIELDS
    assert bc["max_batch_size"] == 8 and bc["kv_cache_type"] == "paged"


def test_llmapi_options_use_upstream_names():
    opts = trtllm.llmapi_options(_build("build.max_batch_size=16"), "fp8", tp=2, pp=1)
    assert set(opts) <= LLM_ARGS
    assert set(opts["kv_cache_config"]) <= KV_CACHE_CONFIG and set(opts["cuda_graph_config"]) <= CUDA_GRAPH_CONFIG
    assert opts["kv_cache_config"]["dtype"] == "fp8" and opts["tensor_parallel_size"] == 2
    assert max(opts["cuda_graph_config"]["batch_sizes"]) <= 16


def _needs_trtllm_and_gpu() -> None:
    import torch

    if trtllm.detect().version is None:
        pytest.skip("tensorrt_llm is not installed (NVIDIA's TRT-LLM container and a GPU are needed)")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none visible)")


@pytest.mark.trtllm
@pytest.mark.gpu
@pytest.mark.parametrize("runtime", ["trtllm_engine", "trtllm_llmapi"])
def test_trtllm_runtime_builds_loads_and_generates_on_this_gpu(tmp_path, runtime):
    """On a TRT-LLM container with a GPU: the engine build (or the LLM-API load) and its generate check pass."""
    _needs_trtllm_and_gpu()
    proc = run_cli("build", "model=tiny-qwen3", "quant.gate=warn", "target=auto", f"runtime={runtime}",
                   "until=build", root=tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_multirun_with_submitit_local_shares_one_quantize(tmp_path):
    root = tmp_path / "sweep"
    proc = run_cli("build", "-m", *TINY, "build.max_batch_size=4,8", "until=package",
                   "hydra/launcher=submitit_local", root=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = "".join(p.read_text() for p in (root / ".store" / "logs").glob("*.log"))
    assert logs.count("stage quantize: ran") == 1
    assert logs.count("stage quantize: cached") == 1
    assert logs.count("stage package: ran") == 2  # one per job: the batch size differs
    assert len(list(root.glob(".store/*-quantize-*/manifest.json"))) == 1


def test_pipeline_slurm_launcher_asks_for_each_targets_resources():
    from hydra_plugins.pipeline_launcher.launcher import job_resources

    h100 = job_resources(["model=qwen32b", "quant=fp8", "target=h100"])
    a10g = job_resources(["model=qwen32b", "quant=fp8", "target=a10g"])
    assert (h100["partition"], h100["constraint"], h100["gpus_per_node"]) == ("gpu", "h100", 1)
    assert a10g["constraint"] == "a10g" and a10g["gpus_per_node"] == 2  # 34 GB of FP8 weights on 24 GB GPUs


def test_engine_runtime_gets_a_trtllm_checkpoint_with_the_build_mapping(tmp_path):
    proc = run_cli("build", *TINY, "target=h100", "runtime=trtllm_engine", "build.tp_size=2", "until=quantize",
                   root=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = next(tmp_path.glob(".store/*-quantize-*/manifest.json")).parent
    trt = json.loads((out / "trtllm_checkpoint" / "config.json").read_text())
    assert trt["mapping"]["tp_size"] == 2 and trt["mapping"]["world_size"] == 2
    assert trt["quantization"]["quant_algo"] == "FP8" and trt["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert sorted(p.name for p in (out / "trtllm_checkpoint").glob("rank*.safetensors")) == \
        ["rank0.safetensors", "rank1.safetensors"]
    assert (out / "checkpoint" / "hf_quant_config.json").is_file()  # the unified checkpoint, always
    # the reference runtime's quantize output does not carry it, and is a different (shared) output
    proc = run_cli("plan", "--json", *TINY, root=tmp_path)
    q = next(s for s in json.loads(proc.stdout)["stages"] if s["stage"] == "quantize")
    assert q["output"] != str(out)


class SlurmStandIn:
    """Stands in for Slurm: replaces ``submitit.AutoExecutor`` so the pipeline_slurm launcher can submit from a
    machine without Slurm. It records every array submitted (its parameters, each job's overrides and number) and
    when each job's result is awaited; it runs nothing, and each job's result says so."""

    events: list[tuple] = []

    def __init__(self, cluster: str, folder: str, **kwargs):
        assert cluster == "slurm"
        self.params: dict = {}

    def update_parameters(self, **params):
        self.params.update(params)

    def map_array(self, fn, *iterables):
        jobs = list(zip(*iterables))  # (overrides, job_dir_key, job_num, job_id, singleton_state)
        self.events.append(("submit", dict(self.params), [(j[2], list(j[0])) for j in jobs]))
        return [SlurmStandIn._Job(j[2], list(j[0])) for j in jobs]

    class _Job:
        def __init__(self, num: int, overrides: list[str]):
            self.num, self.overrides = num, overrides

        def results(self):
            from hydra.core.utils import JobReturn, JobStatus

            SlurmStandIn.events.append(("wait", self.num))
            return [JobReturn(overrides=self.overrides, status=JobStatus.COMPLETED,
                              _return_value="submitted to the Slurm stand-in; not run")]


@pytest.mark.parametrize("verb", ["build", "plan"])
def test_slurm_sweep_from_a_gpu_less_machine_submits_every_possible_job(tmp_path, monkeypatch, capsys, verb):
    """No GPU and no TensorRT-LLM here: the machine checks belong to each job where Slurm runs it. nvfp4 × h100 is
    refused by the compatibility rules, listed, and left out; the other three jobs are submitted, one array per
    target with that target's partition, constraint and GPU count, both arrays before waiting on either."""
    import submitit

    from pipeline import cli

    assert config.local_gpu() is None and trtllm.detect().version is None
    monkeypatch.setattr(submitit, "AutoExecutor", SlurmStandIn)
    monkeypatch.setattr(SlurmStandIn, "events", [])
    monkeypatch.setattr("sys.argv", ["pipeline"])
    monkeypatch.chdir(tmp_path)
    cli.main([verb, "-m", "model=qwen32b", "target=h100,b200", "quant=fp8,nvfp4", "runtime=trtllm_engine",
              "hydra/launcher=pipeline_slurm", f"paths.root={tmp_path}"])
    err = capsys.readouterr().err
    assert "skipped target=h100 quant=nvfp4: nvfp4 needs Blackwell (sm100/sm120); for h100 use fp8 or int4_awq" \
        in err.splitlines()
    events = SlurmStandIn.events
    submits = [e for e in events if e[0] == "submit"]
    assert [e[0] for e in events] == ["submit", "submit", "wait", "wait", "wait"]
    arrays = {(p["slurm_partition"], p["slurm_constraint"], p["gpus_per_node"]):
              [(num, [o for o in ov if o.startswith(("target=", "quant="))]) for num, ov in jobs]
              for _, p, jobs in submits}
    assert arrays == {("gpu", "h100", 1): [(0, ["target=h100", "quant=fp8"])],
                      ("gpu", "b200", 1): [(1, ["target=b200", "quant=fp8"]), (2, ["target=b200", "quant=nvfp4"])]}
    assert not any(tmp_path.glob("engines/*")) and not any(tmp_path.glob(".store/*-quantize-*"))


def test_sweep_with_every_job_refused_exits_2_naming_them(tmp_path):
    proc = run_cli("plan", "-m", "model=qwen32b", "target=h100,h200", "quant=nvfp4", root=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error: 2 problems: ") and proc.stderr.count("nvfp4 needs Blackwell") == 2


def test_local_sweep_skips_the_jobs_this_machine_cannot_build(tmp_path):
    """The basic launcher runs every job here, so this machine's checks (a GPU of the target's SM) apply before
    launch: the h100 job is listed and left out, the cpu job runs."""
    proc = run_cli("build", "-m", *TINY, "target=cpu,h100", "until=build", root=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped target=h100: target h100 (sm90) needs its GPU to build" in proc.stderr
    assert "hydra/launcher=pipeline_slurm" in proc.stderr
    assert [p.name for p in (tmp_path / "reports").glob("*.json")] == ["tiny-qwen3.fp8-kvfp8.cpu.reference.json"]


def test_target_auto_under_multirun_reaches_each_job_resolved(tmp_path):
    proc = run_cli("plan", "-m", "--json", *TINY, "target=auto", "quant=fp8,none", root=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dec, text, docs = json.JSONDecoder(), proc.stdout.strip(), []
    while text:
        doc, end = dec.raw_decode(text)
        docs.append(doc)
        text = text[end:].strip()
    expected = config.detect_target()  # cpu on a machine without an NVIDIA GPU
    assert [(d["quant"], d["target"]) for d in docs] == [("fp8", expected), ("none", expected)]


def test_build_json_prints_the_build_report_on_stdout(tmp_path):
    proc = run_cli("build", "--json", *TINY, "until=fetch", root=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc == json.loads((tmp_path / "reports" / "tiny-qwen3.fp8-kvfp8.cpu.reference.json").read_text())
    assert [r["stage"] for r in doc["stages"]] == ["fetch"] and doc["stages"][0]["status"] == "ran"
    assert "total" in proc.stderr and "report:" in proc.stderr  # the human summary stays on stderr


def _engine_ctx(tmp_path, shared_content: bytes | None):
    from pipeline.runner import Context
    from pipeline.stages import build

    cfg = config.compose(["model=qwen32b", "target=h100", "runtime=trtllm_engine"])
    quantize = tmp_path / "quantize"
    (quantize / "checkpoint").mkdir(parents=True)
    (quantize / "checkpoint" / "tokenizer.json").write_text("{}")
    (quantize / "checkpoint" / "model.safetensors").write_bytes(b"weights")
    out = tmp_path / "engines" / ".build.tmp-1"
    (out / "engine").mkdir(parents=True)
    shared = build.timing_cache_path(tmp_path / "store", 90, "10.13")
    if shared_content is not None:
        shared.parent.mkdir(parents=True)
        shared.write_bytes(shared_content)
    ctx = Context(cfg=cfg, stage=build.STAGE, out=out, final=tmp_path / "engines" / "build", inputs={"quantize":
                  quantize}, manifests={"quantize": {}}, paths={"store": tmp_path / "store"})
    return ctx, shared


def test_engine_build_reads_and_writes_its_own_copy_of_the_timing_cache(tmp_path):
    from pipeline.stages import build

    ctx, shared = _engine_ctx(tmp_path, b"shared cache")
    spec = build.engine_build_spec(ctx, "FP8", "10.13")
    args = spec["trtllm_build_args"]
    own = ctx.out / build.TIMING_CACHE
    assert args[args.index("--input_timing_cache") + 1] == args[args.index("--output_timing_cache") + 1] == str(own)
    assert own.read_bytes() == b"shared cache" and shared.name == "sm90-trt10.13.cache"
    assert (ctx.out / "engine" / "tokenizer.json").is_file() and not (ctx.out / "engine" / "model.safetensors").exists()
    own.write_bytes(b"shared cache + this build's timings")  # what trtllm-build's --output_timing_cache does
    build.publish_timing_cache(own, shared)
    assert shared.read_bytes() == b"shared cache + this build's timings"
    assert not own.exists() and [p.name for p in shared.parent.iterdir()] == [shared.name]

    first, _ = _engine_ctx(tmp_path / "first", None)  # no shared cache yet: the build starts without one
    build.engine_build_spec(first, "FP8", "10.13")
    assert not (first.out / build.TIMING_CACHE).exists()


def test_concurrent_timing_cache_publishes_are_never_seen_half_written(tmp_path):
    """Builds finishing together each replace the shared cache; a build starting meanwhile copies one of them
    whole (each cache is 4 MB of one repeated byte, so a torn file would mix bytes or be short)."""
    import threading

    from pipeline.stages import build

    shared = build.timing_cache_path(tmp_path / "store", 100, "10.13")
    size, writers, done = 4 << 20, 4, threading.Event()

    def publisher(k: int):
        for n in range(10):
            own = tmp_path / f"own-{k}-{n}.cache"
            own.write_bytes(bytes([k]) * size)
            build.publish_timing_cache(own, shared)

    seen: list[bytes] = []

    def starter():
        while not done.is_set():
            own = tmp_path / "starting.cache"
            build.seed_timing_cache(shared, own)
            if own.exists():
                data = own.read_bytes()
                seen.append(data[:1] if len(data) == size and data.count(data[:1]) == size else b"torn")

    threads = [threading.Thread(target=publisher, args=(k,)) for k in range(1, writers + 1)]
    reader = threading.Thread(target=starter)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    reader.join()
    assert seen and b"torn" not in seen
    assert shared.read_bytes() in {bytes([k]) * size for k in range(1, writers + 1)}
    assert [p.name for p in shared.parent.iterdir()] == [shared.name]  # no temp file left behind
