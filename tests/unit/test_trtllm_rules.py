"""TensorRT-LLM's build and load rules (pipeline/upstream/rules.yaml) as the plan applies them: each rule fires on
the combination upstream refuses or changes, and not on its nearest good neighbour (the negative control)."""
from __future__ import annotations

import copy
import functools

import pytest

from pipeline import hardware
from pipeline.errors import UserError
from pipeline.triton import repository
from pipeline.upstream import rules


def _settings(**over) -> dict:
    """Plain settings of the shipped defaults for an engine build of Qwen3-32B on an H100, with overrides
    (``build``/``serve`` merged)."""
    s = copy.deepcopy(_base())
    for k, v in over.items():
        if isinstance(v, dict):
            s[k].update(v)
        else:
            s[k] = v
    return s


@functools.lru_cache(maxsize=None)
def _compose(*overrides: str):
    return hardware.compose(list(overrides))


@functools.lru_cache(maxsize=None)
def _base() -> dict:
    return rules.settings_of(_compose("model=qwen32b", "quant=fp8", "target=h100", "runtime=trtllm_engine"))


def _fired(s: dict) -> dict[str, str]:
    return {f.rule: f.action for f in rules.evaluate(s)}


def test_every_rule_has_a_predicate_and_a_source():
    doc = rules.record()
    assert set(doc["rules"]) == set(rules.PREDICATES)
    for rid, r in doc["rules"].items():
        srcs = r["source"] if isinstance(r["source"], list) else [r["source"]]
        assert all(s.get("repo") for s in srcs) and r["action"] in ("refuse", "adjust"), rid
        assert r["action"] == "adjust" or r.get("fix"), rid  # a refusal names the settings that fix it


def test_the_shipped_fp8_engine_build_passes_every_rule():
    assert rules.evaluate(_settings()) == []


@pytest.mark.parametrize("quant", ["int4_awq", "int8_sq", "none"])
def test_fp8_kv_with_paged_context_fmha_needs_fp8_weights(quant):
    s = _settings(quant=quant)
    assert _fired(s)["fp8_kv_paged_context_fmha"] == "refuse"
    msg = next(f.message for f in rules.evaluate(s) if f.rule == "fp8_kv_paged_context_fmha")
    assert "quant.kv_cache=none" in msg and "build.use_paged_context_fmha=false" in msg
    # negative controls: BF16 KV, or paged context FMHA off with reuse and chunking off too
    assert "fp8_kv_paged_context_fmha" not in _fired(_settings(quant=quant, kv_cache="none"))
    off = _settings(quant=quant, build={"use_paged_context_fmha": False},
                    serve={"enable_chunked_context": False, "enable_kv_cache_reuse": False})
    assert not [f for f in rules.evaluate(off) if f.action == "refuse"]


def test_fp8_kv_paged_context_fmha_needs_sm89():
    assert _fired(_settings(quant="fp8", sm=80))["fp8_kv_paged_context_fmha"] == "refuse"
    assert "fp8_kv_paged_context_fmha" not in _fired(_settings(quant="nvfp4", sm=100))


def test_chunked_context_needs_paged_context_fmha():
    s = _settings(build={"use_paged_context_fmha": False}, serve={"enable_kv_cache_reuse": False})
    assert _fired(s) == {"chunked_context_needs_paged_context_fmha": "refuse"}
    assert _fired(_settings(build={"use_paged_context_fmha": False},
                            serve={"enable_kv_cache_reuse": False, "enable_chunked_context": False})) == {}


def test_kv_reuse_without_paged_context_fmha_is_rendered_off_with_the_reason():
    s = _settings(build={"use_paged_context_fmha": False}, serve={"enable_chunked_context": False})
    (f,) = rules.evaluate(s)
    assert (f.rule, f.action, f.setting, f.value) == ("kv_reuse_needs_paged_context_fmha", "adjust",
                                                      "serve.enable_kv_cache_reuse", False)
    cfg = hardware.compose(["model=qwen32b", "quant=fp8", "target=h100", "runtime=trtllm_engine",
                          "build.use_paged_context_fmha=false", "serve.enable_chunked_context=false"])
    assert repository.rendered_engine_parameters(cfg)["enable_kv_cache_reuse"] == "false"
    default = _compose("model=qwen32b", "quant=fp8", "target=h100", "runtime=trtllm_engine")
    assert repository.rendered_engine_parameters(default)["enable_kv_cache_reuse"] == "true"  # control


def test_fp8_context_fmha_is_adjusted_off_outside_the_fp8_workflows():
    assert _fired(_settings(quant="int4_awq", kv_cache="none")) == {"fp8_context_fmha_needs_fp8_workflow": "adjust"}
    assert "fp8_context_fmha_needs_fp8_workflow" not in _fired(_settings(quant="w4a8_awq"))


def test_max_input_len_beyond_max_seq_len_is_refused():
    assert _fired(_settings(build={"max_input_len": 4096, "max_seq_len": 2048})) == {
        "max_input_len_le_max_seq_len": "refuse"}
    assert _fired(_settings(build={"max_input_len": 2048, "max_seq_len": 2048})) == {}


def test_int4_and_smoothquant_engines_are_refused_on_sm100():
    s = _settings(quant="int4_awq", kv_cache="none", sm=100)
    assert _fired(s)["no_int_quant_on_sm100"] == "refuse"
    assert "no_int_quant_on_sm100" not in _fired(_settings(quant="int4_awq", kv_cache="none", sm=120))


def test_engines_are_refused_for_trtllm_without_the_tensorrt_backend():
    for version in ("1.3.0rc24", "1.3.0", "main"):
        assert _fired(_settings(trtllm_version=version))["engine_backend_removed"] == "refuse", version
    assert "engine_backend_removed" not in _fired(_settings(trtllm_version="1.2.1"))
    # the LLM API runtime is not an engine: no such refusal
    assert "engine_backend_removed" not in _fired(_settings(runtime="trtllm_llmapi", trtllm_version="1.3.0rc24"))


def test_llmapi_free_gpu_memory_fraction_validator():
    s = _settings(runtime="trtllm_llmapi", build={"kv_cache_free_gpu_mem_fraction": 1.5})
    assert _fired(s) == {"llmapi_free_gpu_memory_fraction": "refuse"}
    assert _fired(_settings(runtime="trtllm_llmapi")) == {}


def test_a_planted_wrong_container_pair_is_refused_by_plan():
    with pytest.raises(UserError, match="ships TensorRT-LLM 1.1.0"):
        from pipeline.cli.build import cmd_plan

        cmd_plan(hardware.compose(["model=qwen32b", "quant=fp8", "target=h100", "runtime=trtllm_llmapi",
                                 "runtime.container=nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"]), True)
    s = _settings(serve={"image": "nvcr.io/nvidia/tritonserver:26.02-trtllm-python-py3"})
    assert _fired(s) == {"container_pair": "refuse"}


def test_plan_refuses_the_int4_awq_engine_build_trtllm_build_refuses(capsys):
    from pipeline.cli.build import cmd_plan

    with pytest.raises(UserError, match="fp8_kv_paged_context_fmha") as exc:
        cmd_plan(hardware.compose(["model=qwen32b", "quant=int4_awq", "target=h100", "runtime=trtllm_engine"]), True)
    assert "quant.kv_cache=none" in str(exc.value)
    doc = cmd_plan(hardware.compose(["model=qwen32b", "quant=int4_awq", "target=h100", "runtime=trtllm_engine",
                                   "quant.kv_cache=none"]), True)
    assert any("fp8_context_fmha_needs_fp8_workflow" in a for a in doc["adjusted"])


@pytest.mark.parametrize("name,bad,good", [
    ("gpt_model_type", "inflight_fused", "inflight_fused_batching"),
    ("batch_scheduler_policy", "static", "max_utilization"),
    ("kv_cache_free_gpu_mem_fraction", "1.0", "0.9"),
    ("kv_cache_free_gpu_mem_fraction", "0", "0.05"),
    ("kv_cache_free_gpu_mem_fraction", "ninety", "0.5"),
    ("max_tokens_in_paged_kv_cache", "0", "395614"),
    ("max_tokens_in_paged_kv_cache", "1e5", ""),
    ("max_beam_width", "0", "1"),
    ("enable_kv_cache_reuse", "yes", "true"),
    ("enable_chunked_context", "on", "FALSE"),
    ("exclude_input_in_output", "True ", "1"),
])
def test_every_parameter_rule_refuses_what_the_backend_would_not_take(name, bad, good):
    assert rules.check_parameter(name, bad) is not None
    assert rules.check_parameter(name, good) is None


def test_rendered_engine_parameters_pass_and_a_missing_required_one_is_caught():
    cfg = _compose("model=qwen32b", "quant=fp8", "target=h100", "runtime=trtllm_engine")
    params = repository.rendered_engine_parameters(cfg)
    assert params["gpt_model_type"] == "inflight_fused_batching" and int(params["max_tokens_in_paged_kv_cache"]) > 0
    assert rules.parameter_problems(params) == []
    del params["gpt_model_type"]
    assert rules.parameter_problems(params) == ["gpt_model_type: required by the tensorrtllm backend and not rendered"]


def test_rules_verb_prints_every_rule_with_its_source(capsys):
    from pipeline.upstream import refresh

    assert refresh.main(["rules"]) == 0
    out = capsys.readouterr().out
    for rid in rules.PREDICATES:
        assert rid in out
    assert "trtGptModelInflightBatching.cpp" in out and "model_instance_state.cc" in out


def test_fp8_context_fmha_follows_the_kv_cache_with_paged_context_fmha():
    """The builder's adjustments of FP8 context FMHA in the FP8 workflows (FP8, W4A8_AWQ, NVFP4): off without an FP8
    KV cache, on with one; plan names each, and the rendered build flag agrees."""
    for quant in ("fp8", "w4a8_awq"):
        fired = _fired(_settings(quant=quant, kv_cache="none"))
        assert fired.get("fp8_context_fmha_needs_fp8_kv") == "adjust", (quant, fired)
    (f,) = [f for f in rules.evaluate(_settings(quant="fp8", kv_cache="none")) if f.rule == "fp8_context_fmha_needs_fp8_kv"]
    assert (f.setting, f.value) == ("build.use_fp8_context_fmha", False)
    on = _settings(build={"use_fp8_context_fmha": False})  # fp8 weights, fp8 KV cache (the defaults)
    assert _fired(on) == {"fp8_kv_enables_fp8_context_fmha": "adjust"}
    # controls: the defaults fire neither; without paged context FMHA the builder leaves the flag as asked
    assert "fp8_context_fmha_needs_fp8_kv" not in _fired(_settings())
    assert not {"fp8_context_fmha_needs_fp8_kv", "fp8_kv_enables_fp8_context_fmha"} & set(_fired(_settings(
        kv_cache="none", build={"use_paged_context_fmha": False}, serve={"enable_chunked_context": False,
                                                                         "enable_kv_cache_reuse": False})))
    from pipeline.cli.build import cmd_plan

    doc = cmd_plan(hardware.compose(["model=qwen32b", "quant=fp8", "quant.kv_cache=none", "target=h100",
                                   "runtime=trtllm_engine"]), True)
    assert any("fp8_context_fmha_needs_fp8_kv" in a for a in doc["adjusted"])
