"""The serving plan (pipeline/serving_plan.py): settings derived per target, the model's context served, the KV pool,
the upstream rules, the service profile's concurrency, the reference runtime's scope and what the renderers take.
NVIDIA's performance model runs here (the test environment installs it: ``make .venv/.installed-test``);
tests/e2e/test_perfmodel.py holds its figures to aiconfigurator's own CLI."""
from __future__ import annotations

import dataclasses

import pytest

from pipeline import hardware, perfmodel, serving_plan
from pipeline.config import to_plain
from pipeline.errors import UserError
from pipeline.runtime import trtllm
from pipeline.upstream import rules


OTHERS = {
    "h200": ["model=qwen32b", "quant=fp8", "target=h200", "runtime=trtllm_llmapi"],
    "h200_latency": ["model=qwen32b", "quant=fp8", "target=h200", "runtime=trtllm_llmapi",
                     "serve.slo.objective=latency"],
    "h200_reference": ["model=qwen32b", "quant=fp8", "target=h200", "runtime=reference"],
    "h100_bs16": ["model=qwen32b", "quant=fp8", "target=h100", "runtime=trtllm_llmapi", "build.max_batch_size=16"],
    "a10g": ["model=qwen32b", "quant=fp8", "target=a10g", "runtime=trtllm_llmapi"],
    "cpu": ["target=cpu", "runtime=reference"],
}
_COMPOSED: dict = {}


def _plan(name: str, *extra: str):
    """The named config (``OTHERS``; composed together once, under one Hydra initialisation) and its serving plan."""
    if not _COMPOSED:
        _COMPOSED.update(zip(OTHERS, hardware.compose_many(list(OTHERS.values()))))
    cfg = hardware.compose(OTHERS[name] + list(extra)) if extra else _COMPOSED[name]
    return cfg, serving_plan.resolve(cfg)


FLAGSHIP = [(q, t) for q in ("fp8", "nvfp4") for t in ("h100", "h200", "b200")]


@pytest.fixture(scope="module")
def flagship():
    """The flagship on h100/h200/b200 at fp8 and nvfp4, composed under one Hydra initialisation."""
    jobs = [["model=qwen32b", f"quant={q}", f"target={t}", "runtime=trtllm_llmapi"] for q, t in FLAGSHIP]
    return dict(zip(FLAGSHIP, hardware.compose_many(jobs)))


@pytest.mark.parametrize("quant, target", FLAGSHIP)
def test_flagship_serves_the_models_context_and_passes_the_upstream_rules(flagship, quant, target):
    cfg = flagship[(quant, target)]
    p = serving_plan.resolve(cfg)
    s = p.settings
    if (quant, target) != ("nvfp4", "h100"):  # nvfp4 cannot serve on Hopper: the compatibility rules refuse it
        assert all(p.sources[k]["source"] == "derived" for k in serving_plan.DERIVED)
    assert s["max_batch_size"] >= serving_plan.concurrency(cfg) == 32  # the bench's highest level on a GPU
    # the model's context (Qwen3-32B: 40,960), as TensorRT-LLM serves it when max_seq_len is not given; the pool holds
    # one full-length sequence, and need not hold a full batch of them (the capacity scheduler queues)
    assert s["max_seq_len"] == int(cfg.model.shape.max_position_embeddings) == 40960
    assert s["max_seq_len"] <= p.kv_tokens and serving_plan.kv_problems(p) == []
    assert p.summary["full_length_sequences"] == p.kv_tokens // 40960 >= 1
    assert s["kv_cache_free_gpu_mem_fraction"] == serving_plan.DEFAULT_FRACTION == 0.9
    assert s["max_input_len"] == s["max_seq_len"] - 1
    assert max(s["cuda_graph_batch_sizes"]) == s["max_batch_size"]
    built = serving_plan.build_settings(to_plain(cfg.build), s)
    for runtime in ("trtllm_llmapi", "trtllm_engine"):
        findings = rules.evaluate({**rules.settings_of(cfg, built), "runtime": runtime})
        assert [f.message for f in findings if f.action == "refuse"] == []
    # every renderer takes the plan's values; the LLM API gets chunked prefill (its default is off, and a prompt
    # longer than max_num_tokens would be refused)
    opts = trtllm.llmapi_options(built, cfg.quant.kv_cache.value, p.tp, p.pp, chunked_prefill=True)
    assert (opts["max_batch_size"], opts["max_seq_len"], opts["max_num_tokens"]) == (
        s["max_batch_size"], s["max_seq_len"], s["max_num_tokens"])
    assert opts["enable_chunked_prefill"] is True and s["max_num_tokens"] < s["max_seq_len"]
    assert opts["cuda_graph_config"]["batch_sizes"] == s["cuda_graph_batch_sizes"]
    args = trtllm.trtllm_build_args(built, "FP8", "FP8", "/c", "/o", None)
    assert args[args.index("--max_seq_len") + 1] == str(s["max_seq_len"])
    assert args[args.index("--max_input_len") + 1] == str(s["max_input_len"])


def test_max_seq_len_is_cut_only_where_the_pool_cannot_hold_one_full_length_sequence():
    cfg, p = _plan("h200")
    assert p.settings["max_seq_len"] == 40960 and "the model's context" in p.sources["max_seq_len"]["why"]
    # a context longer than the whole pool: cut to the pool, and the plan says why
    long_ctx = p.kv_tokens * 3
    _, p2 = _plan("h200", f"model.shape.max_position_embeddings={long_ctx}")
    assert p2.settings["max_seq_len"] == p2.kv_tokens < long_ctx
    assert "cut to the KV pool" in p2.sources["max_seq_len"]["why"] and serving_plan.kv_problems(p2) == []
    # negative control: a length set by hand beyond the pool could never be admitted, and is refused
    cfg3, p3 = _plan("h200", f"build.max_seq_len={p.kv_tokens + 1}", "build.max_batch_size=64")
    assert p3.sources["max_seq_len"]["source"] == "set"
    assert serving_plan.kv_problems(p3) and "could never be admitted" in serving_plan.capacity_problems(cfg3, p3)[0]


def test_the_kv_fraction_stays_at_tensorrt_llms_default_whatever_the_batch():
    # a full batch at full length is far beyond the pool: queued by the capacity scheduler, never a raised fraction
    cfg2, p2 = _plan("h200")
    assert p2.settings["kv_cache_free_gpu_mem_fraction"] == 0.9
    assert p2.settings["max_batch_size"] * p2.settings["max_seq_len"] > 3 * p2.kv_tokens
    assert not serving_plan.kv_problems(p2) and "GUARANTEED_NO_EVICT" == p2.summary["scheduler"]
    built = serving_plan.build_settings(to_plain(cfg2.build), p2.settings)
    opts = trtllm.llmapi_options(built, cfg2.quant.kv_cache.value, p2.tp, p2.pp, chunked_prefill=True)
    assert opts["kv_cache_config"]["free_gpu_memory_fraction"] == 0.9
    # a fraction set by hand wins
    _, p3 = _plan("h200", "build.kv_cache_free_gpu_mem_fraction=0.8")
    assert p3.settings["kv_cache_free_gpu_mem_fraction"] == 0.8 and p3.sources[
        "kv_cache_free_gpu_mem_fraction"]["source"] == "set"


def test_the_latency_profile_holds_the_expected_concurrency_or_is_refused():
    _, thr = _plan("h200")
    _, lat = _plan("h200_latency")
    # the bench's highest level on a GPU is 32: the latency profile may not pick a batch that serves fewer
    assert lat.profile["concurrency"] == thr.profile["concurrency"] == 32
    assert lat.settings["max_batch_size"] >= 32 and all(r["batch"] >= 32 for r in [lat.profile["chosen"],
                                                                                  *lat.profile["runners_up"]])
    assert lat.profile["chosen"]["request_latency_ms"] <= thr.profile["chosen"]["request_latency_ms"]
    # a lower expected concurrency lets it choose a smaller batch
    _, lat4 = _plan("h200_latency", "serve.slo.concurrency=4")
    assert 4 <= lat4.settings["max_batch_size"] <= lat.settings["max_batch_size"]
    # negative control: a concurrency no TP x batch holds in the KV pool is refused, naming the setting
    with pytest.raises(UserError, match=r"serve\.slo\.concurrency=60000 .* \(at most \d+\)"):
        _plan("h200_latency", "serve.slo.concurrency=60000")
    # a batch set by hand below the concurrency is kept, with a warning that the rest queue
    _, small = _plan("h200", "build.max_batch_size=8")
    assert small.settings["max_batch_size"] == 8 and any("below the expected concurrency of 32" in w
                                                         for w in small.summary["warnings"])


def test_a_value_set_by_hand_wins_and_the_cpu_smoke_keeps_its_sizes():
    _, p = _plan("h100_bs16")
    assert p.settings["max_batch_size"] == 16 and p.sources["max_batch_size"] == {"source": "set",
                                                                                 "why": "build.max_batch_size"}
    assert p.sources["max_seq_len"]["source"] == "derived"
    _, cpu = _plan("cpu")
    assert cpu.settings == serving_plan.CPU_SIZES | {"max_input_len": 1024}
    assert {v["source"] for v in cpu.sources.values()} == {"cpu"}
    assert cpu.kv_plan is None and serving_plan.kv_problems(cpu) == []


def test_targets_without_tables_say_so_and_size_by_trtllm_benchs_rule():
    cfg, p = _plan("a10g")
    preds, notes = serving_plan.predictions(cfg, p)
    assert preds is None and len(notes) == 1 and "a10g has no tables" in notes[0] and "\n" not in notes[0]
    # trtllm-bench's max_batch_size: the typical requests the pool holds, rounded up as finetune_setting rounds
    typical = sum(serving_plan.workloads(cfg)["typical"])
    assert p.settings["max_batch_size"] == serving_plan.bench_batch(p.kv_tokens / typical, 1)
    assert "trtllm-bench" in p.sources["max_batch_size"]["why"]
    assert [serving_plan.bench_batch(r, 1) for r in (1, 33, 255.5, 300, 1500, 9000)] == [64, 64, 256, 384, 1536,
                                                                                         4096]
    cfg, p = _plan("cpu")
    preds, notes = serving_plan.predictions(cfg, p)
    assert preds is None and "is a CPU" in notes[0]


def test_the_reference_runtime_gets_no_tensorrt_llm_prediction_and_names_what_applies():
    cfg, p = _plan("h200_reference")
    assert p.predictions is None and p.profile is None and p.model is None
    lines = [n for n in p.notes if "prediction" in n]
    assert len(lines) == 1 and "runtime=reference" in lines[0] and "PyTorch" in lines[0]
    assert p.tp == 1 and p.world == 1  # it runs the model on one GPU: no planner's TP
    assert "not used by the reference runtime" in p.sources["kv_cache_free_gpu_mem_fraction"]["why"]
    # the control: the same model on TensorRT-LLM gets the planner's or the profile's TP and the predictions
    _, trt = _plan("h200")
    assert trt.predictions is not None and trt.model == perfmodel.installed()
    with pytest.raises(UserError, match="runtime=reference runs the model on one GPU"):
        from pipeline import planning

        problems = planning.capacity_problems(hardware.compose(OTHERS["h200_reference"] + ["build.tp_size=2"]))
        raise UserError(problems[0])


def test_predictions_are_at_the_bundles_own_settings():
    cfg, p = _plan("h200")
    pred = p.predictions
    s = p.settings
    assert (pred["ctx_tokens"], pred["max_seq_len"]) == (s["max_num_tokens"], s["max_seq_len"])
    assert pred["fmha"] == "fp8"  # FP8 weights with an FP8 KV cache: FP8 context attention (aiconfigurator's reading)
    chat = pred["workloads"]["chat"]
    assert chat["batch"] == s["max_batch_size"] and set(chat["by_concurrency"]) == {"1", "8", "32"}
    # memory at the full max_seq_len is the batch's worst case, beyond the GPU at this batch; at the request's own
    # length it fits
    fp8 = chat["kv_fp8"]
    assert fp8["memory_gb"] > 141 and fp8["oom"] and fp8["memory_gb_at_request"] < 141
    assert "1.3.0rc20" == pred["trtllm_tables"] != pred["container_trtllm"] == "1.2.1"
    assert any("the tables are TensorRT-LLM 1.3.0rc20's" in n for n in p.notes)


def test_a_host_without_the_performance_model_refuses_what_it_would_choose(monkeypatch, tmp_path):
    """Where the model chooses the settings (a TensorRT-LLM runtime on a GPU with tables), a host without it refuses
    in one line naming the fix, never sizing the bundle another way; where it chooses nothing (the reference runtime,
    a GPU without tables, a CPU) the plan is the same with or without it."""
    with_model = {name: _plan(name)[1] for name in ("h200_reference", "a10g", "cpu")}
    monkeypatch.setenv("PIPELINE_PERFMODEL_ENV", str(tmp_path / "no-such-env"))
    monkeypatch.setattr(perfmodel, "_WORKERS", {})
    assert perfmodel.available() and "make perfmodel-env" in perfmodel.available()
    with pytest.raises(UserError, match=r"serving settings are chosen with NVIDIA's performance model .* not "
                                        r"installed here: run `make perfmodel-env`") as exc:
        _plan("h200")
    assert "\n" not in str(exc.value)
    for name, plan in with_model.items():
        again = _plan(name)[1]
        assert again.settings == plan.settings and again.summary == plan.summary, name


def test_every_gemm_mode_is_one_aiconfigurator_defines_and_formats_without_one_say_so():
    """The format -> GEMMQuantMode map holds names of aiconfigurator's own enum (read in the model's environment,
    where it is installed); a format left out (NVFP4 AWQ, MXFP8, W4A8 ...) gets one line naming those that have one."""
    import subprocess

    from pipeline.formats import FORMATS

    assert set(perfmodel.GEMM_MODES) <= set(FORMATS)
    for fmt in ("nvfp4_awq", "mxfp8", "w4a8_awq", "w4a8_nvfp4_fp8"):
        why = perfmodel.no_data("b200", "cuda", fmt, "fp8")
        assert why and f"quant {fmt} has no GEMM mode" in why and "w4a16_nvfp4" in why and "\n" not in why
    assert perfmodel.no_data("b200", "cuda", "w4a16_nvfp4", "fp8") is None
    if not perfmodel.env_python().is_file():
        pytest.skip(f"{perfmodel.PINNED} is not installed here (`{perfmodel.ENV_HINT}`): the enum is not readable")
    names = subprocess.run([str(perfmodel.env_python()), "-c", "from aiconfigurator_core.sdk.common import "
                            "GEMMQuantMode as G; print(' '.join(m.name for m in G))"],
                           capture_output=True, text=True, timeout=60, check=True).stdout.split()

    def unknown(modes: dict[str, str]) -> set[str]:
        return set(modes.values()) - set(names)

    assert unknown(perfmodel.GEMM_MODES) == set()
    assert unknown({**perfmodel.GEMM_MODES, "fp8": "fp8_per_tensor"}) == {"fp8_per_tensor"}  # a planted wrong name


def test_the_installed_version_is_read_from_the_package_not_the_pin(monkeypatch, tmp_path):
    env = tmp_path / "perfmodel"
    site = env / "lib" / "python3.12" / "site-packages"
    (site / "aiconfigurator_core-0.13.1.dist-info").mkdir(parents=True)
    monkeypatch.setenv("PIPELINE_PERFMODEL_ENV", str(env))
    assert perfmodel.installed_version() == "0.13.1" != perfmodel.CORE_VERSION
    assert perfmodel.installed() == "aiconfigurator-core==0.13.1"
    assert perfmodel.cache_dir().name == "0.13.1"  # answers of another version are never reused


def test_the_build_checks_the_upstream_rules_on_the_sizes_it_renders(monkeypatch):
    """Preflight holds the resolved plan's settings (the ones the service profile chooses and the build renders) to
    the upstream rules: a plan whose KV fraction the LLM API's KvCacheConfig rejects is refused before anything
    runs; the same config with its own plan (the control) is not."""
    from pipeline import planning
    from pipeline.runner import executor
    from pipeline.stages import STAGES

    cfg, p = _plan("h200")
    assert executor.preflight(cfg, STAGES, environment=False).capacity.settings == p.settings
    bad = dataclasses.replace(p, settings={**p.settings, "kv_cache_free_gpu_mem_fraction": 1.5})
    monkeypatch.setattr(planning, "resolve", lambda cfg, **kw: bad)  # the planner's result, planted
    with pytest.raises(UserError, match="free_gpu_memory_fraction"):
        executor.preflight(cfg, STAGES, environment=False)


def test_the_performance_models_dependencies_are_pinned_for_every_host():
    """Every dependency aiconfigurator-core declares (its package metadata, read in the model's environment) has one
    pinned version in pipeline/data/perfmodel-constraints.txt, the version installed here, so that every host computes
    the plan with the same libraries; a planted missing pin is found."""
    import subprocess

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    if perfmodel.available():
        pytest.skip(perfmodel.available())
    code = ("import importlib.metadata as m, json; r = m.requires('aiconfigurator-core') or []; "
            "print(json.dumps({x: m.version(x.split(';')[0].split('<')[0].split('>')[0].split('=')[0].split('[')[0]"
            ".strip()) for x in r if 'extra ==' not in x}))")
    import json

    declared = json.loads(subprocess.run([str(perfmodel.env_python()), "-c", code], capture_output=True, text=True,
                                         check=True, timeout=60).stdout)
    pins = {canonicalize_name(Requirement(line).name): str(Requirement(line).specifier)
            for line in perfmodel.CONSTRAINTS.read_text().splitlines() if line.strip() and not line.startswith("#")}

    def unpinned(pins: dict[str, str]) -> list[str]:
        out = []
        for req, have in declared.items():
            name = canonicalize_name(Requirement(req).name)
            if pins.get(name) != f"=={have}":
                out.append(name)
        return out

    assert unpinned(pins) == []
    assert unpinned({k: v for k, v in pins.items() if k != "numpy"}) == ["numpy"]  # planted: one pin removed


_PEER = '''import json, sys, time
warm = sys.stdin.readline()
ask = sys.stdin.readline()
time.sleep(0.2)  # both answers leave in one write, after the parent is already waiting for the first
sys.stdout.write(json.dumps({"warm": 1}) + "\\n" + json.dumps({"results": [{"ttft_ms": 1.0}]}) + "\\n")
sys.stdout.flush()
sys.stdin.read()
'''


def test_answers_that_arrive_together_are_all_read(monkeypatch, tmp_path):
    """The parent reads the model's answers line by line: a warm-up's answer and a query's answer that reach the pipe
    in one write are both read (a select() on the buffered pipe waited forever for the second). The peer is a
    stand-in for the model's process that only writes that way; the component under test is the parent's reader."""
    import sys

    env = tmp_path / "perfmodel"
    (env / "lib" / "python3.12" / "site-packages" / "aiconfigurator_core-0.12.0.dist-info").mkdir(parents=True)
    (env / "bin").mkdir()
    (tmp_path / "peer.py").write_text(_PEER)
    (env / "bin" / "python").write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'peer.py'}\n")
    (env / "bin" / "python").chmod(0o755)
    monkeypatch.setenv("PIPELINE_PERFMODEL_ENV", str(env))
    monkeypatch.setattr(perfmodel, "_WORKERS", {})
    q = perfmodel.Query("org/m", "{}", "h200_sxm", "fp8", "fp8", 1, 1, 8, 8)
    worker = perfmodel._worker("SILICON", timeout_s=5)
    try:
        worker.warm([q])
        assert worker.ask([q]) == [{"ttft_ms": 1.0}]
    finally:
        worker.close()
