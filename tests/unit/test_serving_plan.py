"""The serving plan (pipeline/serving_plan.py): settings derived per target, the KV bound, the upstream rules, and
what the renderers take. The performance model is off here (tests/conftest.py): GPU targets are sized by the KV rule;
tests/e2e/test_perfmodel.py checks the model's figures against aiconfigurator's own CLI."""
from __future__ import annotations

import dataclasses

import pytest

from pipeline import hardware, serving_plan
from pipeline.config import to_plain
from pipeline.runtime import trtllm
from pipeline.upstream import rules


OTHERS = {
    "h200": ["model=qwen32b", "quant=fp8", "target=h200", "runtime=trtllm_llmapi"],
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
def test_flagship_sizes_are_derived_within_the_kv_pool_and_pass_the_upstream_rules(flagship, quant, target):
    cfg = flagship[(quant, target)]
    p = serving_plan.resolve(cfg)
    s = p.settings
    assert all(p.sources[k]["source"] == "derived" for k in serving_plan.DERIVED)
    assert s["max_batch_size"] > serving_plan.CPU_SIZES["max_batch_size"]  # not the CPU smoke's 8
    assert s["max_batch_size"] * s["max_seq_len"] <= p.kv_tokens and serving_plan.kv_problems(p) == []
    assert s["max_input_len"] < s["max_seq_len"] <= int(cfg.model.shape.max_position_embeddings)
    need = max(i + o for i, o in serving_plan.workloads(cfg).values())
    assert s["max_seq_len"] >= need
    assert max(s["cuda_graph_batch_sizes"]) == s["max_batch_size"]
    built = serving_plan.build_settings(to_plain(cfg.build), s)
    for runtime in ("trtllm_llmapi", "trtllm_engine"):
        findings = rules.evaluate({**rules.settings_of(cfg, built), "runtime": runtime})
        assert [f.message for f in findings if f.action == "refuse"] == []
    # every renderer takes the plan's values
    opts = trtllm.llmapi_options(built, cfg.quant.kv_cache.value, p.tp, p.pp)
    assert (opts["max_batch_size"], opts["max_seq_len"], opts["max_num_tokens"]) == (
        s["max_batch_size"], s["max_seq_len"], s["max_num_tokens"])
    assert opts["cuda_graph_config"]["batch_sizes"] == s["cuda_graph_batch_sizes"]
    args = trtllm.trtllm_build_args(built, "FP8", "FP8", "/c", "/o", None)
    assert args[args.index("--max_seq_len") + 1] == str(s["max_seq_len"])
    assert args[args.index("--max_input_len") + 1] == str(s["max_input_len"])


def test_a_planted_oversize_breaks_the_kv_bound_and_the_rules_catch_a_planted_bad_length():
    cfg, p = _plan("h200")
    assert serving_plan.kv_problems(p) == []
    # negative control: a batch and length set by hand beyond the pool
    big = 2 * p.kv_tokens // 1000  # twice the pool: more than raising the KV fraction can hold
    cfg2, p2 = _plan("h200", f"build.max_batch_size={big}", "build.max_seq_len=1000")
    assert serving_plan.kv_problems(p2) and p2.sources["max_batch_size"]["source"] == "set"
    assert any("exceeds the KV pool" in w for w in p2.summary["warnings"])
    # negative control for the rules: an input length beyond the derived sequence length is refused
    built = serving_plan.build_settings(to_plain(cfg.build), {**p.settings, "max_input_len": p.settings[
        "max_seq_len"] + 1})
    found = rules.evaluate({**rules.settings_of(cfg, built), "runtime": "trtllm_engine"})
    assert any("max_input_len" in f.message for f in found)


def test_the_kv_fraction_is_raised_only_as_far_as_a_set_batch_needs():
    cfg, p = _plan("h200")
    assert p.settings["kv_cache_free_gpu_mem_fraction"] == serving_plan.DEFAULT_FRACTION == 0.9
    # a batch set by hand 3% over the pool at 0.9: the fraction rises just enough, and every renderer takes it
    batch = -(-int(p.kv_tokens * 1.03) // 1000)
    cfg2, p2 = _plan("h200", f"build.max_batch_size={batch}", "build.max_seq_len=1000")
    f = p2.settings["kv_cache_free_gpu_mem_fraction"]
    assert 0.9 < f <= 0.95 and p2.sources["kv_cache_free_gpu_mem_fraction"]["source"] == "derived"
    assert serving_plan.kv_problems(p2) == [] and p2.summary["kv_cache_free_gpu_mem_fraction"] == f
    built = serving_plan.build_settings(to_plain(cfg2.build), p2.settings)
    opts = trtllm.llmapi_options(built, cfg2.quant.kv_cache.value, p2.tp, p2.pp)
    assert opts["kv_cache_config"]["free_gpu_memory_fraction"] == f
    # negative control: the same batch with the fraction set by hand at 0.9 does not fit, and the plan says so
    _, p3 = _plan("h200", f"build.max_batch_size={batch}", "build.max_seq_len=1000",
                  "build.kv_cache_free_gpu_mem_fraction=0.9")
    assert p3.sources["kv_cache_free_gpu_mem_fraction"]["source"] == "set" and serving_plan.kv_problems(p3)


def test_a_value_set_by_hand_wins_and_the_cpu_smoke_keeps_its_sizes():
    _, p = _plan("h100_bs16")
    assert p.settings["max_batch_size"] == 16 and p.sources["max_batch_size"] == {"source": "set",
                                                                                 "why": "build.max_batch_size"}
    assert p.sources["max_seq_len"]["source"] == "derived"
    _, cpu = _plan("cpu")
    assert cpu.settings == serving_plan.CPU_SIZES | {"max_input_len": 1024}
    assert cpu.settings["kv_cache_free_gpu_mem_fraction"] == 0.9
    assert {v["source"] for v in cpu.sources.values()} == {"cpu"}
    assert cpu.kv_plan is None and serving_plan.kv_problems(cpu) == []


def test_targets_without_tables_say_so_in_one_line_and_go_on():
    cfg, p = _plan("a10g")
    preds, notes = serving_plan.predictions(cfg, p)
    assert preds is None and len(notes) == 1 and "a10g has no tables" in notes[0] and "\n" not in notes[0]
    cfg, p = _plan("cpu")
    preds, notes = serving_plan.predictions(cfg, p)
    assert preds is None and "is a CPU" in notes[0]
    # the model's environment missing or off: one line too, and the sizes still come from the KV rule
    _, p = _plan("h200")
    assert any("no prediction" in n and "PIPELINE_PERFMODEL=off" in n for n in p.notes)
    assert p.sources["max_batch_size"]["source"] == "derived"


def test_every_gemm_mode_is_one_aiconfigurator_defines_and_formats_without_one_say_so():
    """The format -> GEMMQuantMode map holds names of aiconfigurator's own enum (read in the model's environment,
    where it is installed); a format left out (NVFP4 AWQ, MXFP8, W4A8 ...) gets one line naming those that have one."""
    import subprocess

    from pipeline import perfmodel
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


def test_the_build_checks_the_upstream_rules_on_the_sizes_it_renders(monkeypatch):
    """Preflight holds the resolved plan's settings (the ones the service profile chooses where the performance model
    runs, and the build renders) to the upstream rules: a plan whose KV fraction the LLM API's KvCacheConfig rejects
    is refused before anything runs; the same config with its own plan (the control) is not."""
    from pipeline import planning
    from pipeline.errors import UserError
    from pipeline.runner import executor
    from pipeline.stages import STAGES

    cfg, p = _plan("h200")
    assert executor.preflight(cfg, STAGES, environment=False).capacity.settings == p.settings
    bad = dataclasses.replace(p, settings={**p.settings, "kv_cache_free_gpu_mem_fraction": 1.5})
    monkeypatch.setattr(planning, "resolve", lambda cfg, **kw: bad)  # the planner's result, planted
    with pytest.raises(UserError, match="free_gpu_memory_fraction"):
        executor.preflight(cfg, STAGES, environment=False)
