"""target=auto / runtime=auto: what NVML and the installed TensorRT-LLM report -> the target and runtime composed.

NVML stands in through ``pipeline.hardware.local_gpu`` (this machine has no GPU); the mapping from what it reports to a
shipped target is what is tested. TensorRT-LLM cannot be installed here: the probe of an installed package is tested on
minimal stand-in ``tensorrt_llm`` packages (a tmp directory on ``sys.path`` holding only the files the probe looks
for), and the composition tests stand in at the probe's result (``hardware.trtllm_probe``)."""
from __future__ import annotations

import sys
import types

import pytest

from pipeline import config, hardware
from pipeline.errors import UserError

H200 = {"name": "NVIDIA H200", "sm": 90, "memory_gb": 150.1, "count": 1}
H100 = {"name": "NVIDIA H100 80GB HBM3", "sm": 90, "memory_gb": 85.0, "count": 8}
B200 = {"name": "NVIDIA B200", "sm": 100, "memory_gb": 191.5, "count": 8}  # nearer gb200 in memory
T4 = {"name": "Tesla T4", "sm": 75, "memory_gb": 16.0, "count": 1}


@pytest.fixture
def no_device_nodes(monkeypatch):
    monkeypatch.setattr(hardware, "gpu_device_nodes", lambda: [])


def test_no_nvml_means_cpu(monkeypatch, no_device_nodes):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    assert hardware.local_gpu() is None
    assert hardware.target_for(hardware.local_gpu(), config.shipped_targets()) == "cpu"


def _nvml(init=lambda: None, **calls):
    import pynvml

    fake = types.SimpleNamespace(nvmlInit=init, nvmlShutdown=lambda: None, NVMLError=pynvml.NVMLError,
                                 **{n: getattr(pynvml, n) for n in hardware.NO_DRIVER}, **calls)
    return fake


def _raise(code: int):
    import pynvml

    def fail(*_):
        raise pynvml.NVMLError(code)
    return fail


def test_nvml_without_a_driver_means_cpu(monkeypatch, no_device_nodes):
    import pynvml

    for code in (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED):
        monkeypatch.setitem(sys.modules, "pynvml", _nvml(init=_raise(code)))
        assert hardware.local_gpu() is None


def test_an_nvml_failure_other_than_no_driver_is_reported_not_taken_for_cpu(monkeypatch, no_device_nodes):
    import pynvml

    monkeypatch.setitem(sys.modules, "pynvml", _nvml(init=_raise(pynvml.NVML_ERROR_NO_PERMISSION)))
    with pytest.raises(UserError, match=r"target=auto: NVML could not start: NVMLError_NoPermission: "
                                        r"Insufficient Permissions; name the target \(target=h200"):
        hardware.local_gpu()
    # the driver starts, but GPU 0 cannot be read (a GPU fallen off the bus)
    monkeypatch.setitem(sys.modules, "pynvml", _nvml(nvmlDeviceGetHandleByIndex=_raise(pynvml.NVML_ERROR_GPU_IS_LOST)))
    with pytest.raises(UserError, match=r"NVML found a driver but could not read GPU 0: NVMLError_GpuIsLost"):
        hardware.local_gpu()
    with pytest.raises(UserError, match="NVML found a driver but could not read GPU 0"):
        hardware.resolve_overrides([], config.shipped_targets())  # target=auto: the same error, not "cpu"


def test_a_host_with_nvidia_devices_is_never_taken_for_cpu(monkeypatch):
    import pynvml

    monkeypatch.setattr(hardware, "gpu_device_nodes", lambda: ["/dev/nvidia0"])
    monkeypatch.setitem(sys.modules, "pynvml", _nvml(init=_raise(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)))
    with pytest.raises(UserError, match=r"NVML could not start although this host has NVIDIA devices \(/dev/nvidia0\)"):
        hardware.local_gpu()
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(UserError, match=r"has NVIDIA devices \(/dev/nvidia0\) but nvidia-ml-py \(pynvml\) is not "
                                        r"installed"):
        hardware.local_gpu()


def test_nvml_reading_is_turned_into_sm_and_memory(monkeypatch, no_device_nodes):
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: "h0", nvmlDeviceGetCudaComputeCapability=lambda h: (10, 0),
        nvmlDeviceGetName=lambda h: b"NVIDIA B200",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=192e9))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert hardware.local_gpu() == {"name": "NVIDIA B200", "sm": 100, "memory_gb": 192.0, "count": 2}


@pytest.mark.parametrize("gpu,target", [(H200, "h200"), (H100, "h100"), (B200, "b200"), (None, "cpu")])
def test_a_given_sm_and_memory_picks_the_right_target(gpu, target):
    assert hardware.target_for(gpu, config.shipped_targets()) == target


def test_an_sm_no_target_has_is_refused_with_the_fix():
    with pytest.raises(UserError, match=r"no shipped target has sm75 \(Tesla T4\); add conf/target/<name>.yaml"):
        hardware.target_for(T4, config.shipped_targets())


def _installed(version):
    from pipeline.runtime import trtllm

    return trtllm.TrtllmInfo(version, None, True, "/usr/local/bin/trtllm-build", has_llm_api=True,
                             location="/usr/local/lib/python3.12/dist-packages/tensorrt_llm")


def _fake_package(root, version, files):
    """A stand-in installed ``tensorrt_llm``: ``version.py`` and empty module files, nothing importable behind them."""
    pkg = root / "tensorrt_llm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('a stand-in package: the probe must not import it')\n")
    (pkg / "version.py").write_text(f'__version__ = "{version}"\n')
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("")
    return pkg


LLM_API = ["tensorrt_llm/llmapi/__init__.py", "tensorrt_llm/_torch/__init__.py"]
ENGINES = ["tensorrt_llm/builder.py", "tensorrt_llm/commands/build.py"]


@pytest.mark.parametrize("version,files,runtime,engine", [
    ("1.2.1", LLM_API + ENGINES, "trtllm_llmapi", True),          # the 26.07 container: both backends
    ("1.1.0", LLM_API + ENGINES, "trtllm_llmapi", True),          # 25.12: tensorrt_llm.LLM is already PyTorch's
    ("1.3.0rc30", LLM_API, "trtllm_llmapi", False),               # after the removal: no builder, no trtllm-build
    ("0.20.0", LLM_API + ENGINES, "trtllm_engine", True),         # PyTorch backend only under tensorrt_llm._torch
    ("1.2.1", ENGINES, "trtllm_engine", True),                    # control: the files decide, not the version
    ("1.2.1", [], "reference", False),                            # control: neither backend's files
])
def test_runtime_auto_probes_the_installed_package(tmp_path, monkeypatch, version, files, runtime, engine):
    """The probe reads the installed package's files (without importing it: the stand-in's ``__init__`` raises) and
    picks trtllm_llmapi wherever the LLM API's PyTorch backend is there, else trtllm_engine where the TensorRT-engine
    backend is; the printed reason names the package and what it has."""
    from pipeline.runtime import trtllm

    pkg = _fake_package(tmp_path, version, files)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tensorrt_llm", raising=False)
    info = hardware.trtllm_probe()
    assert (info.version, info.location, info.has_engine_backend) == (version, str(pkg), engine)
    chosen, why = hardware.runtime_choice("cuda", info)
    assert chosen == runtime and f"TensorRT-LLM {version} at {pkg}" in why
    assert "tensorrt_llm" not in sys.modules
    assert hardware.runtime_for("cpu", info) == "reference"
    if not engine:  # trtllm_engine is refused there, with the reason
        with pytest.raises(UserError, match=rf"TensorRT-LLM {version} has no TensorRT-engine backend \(the engine "
                                            r"backend was removed after 1\.2\.x\); use runtime=trtllm_llmapi"):
            trtllm.require("trtllm_engine", None, info)


@pytest.mark.parametrize("version,runtime", [("1.2.1", "trtllm_llmapi"), ("1.1.0", "trtllm_llmapi"),
                                             ("1.0.0rc4", "trtllm_llmapi"), ("0.21.0", "trtllm_engine"),
                                             ("1.3.0rc2", "trtllm_llmapi")])
def test_without_the_package_files_the_recorded_versions_decide(monkeypatch, version, runtime):
    """Package metadata without a package directory (the probe's files unreadable): pipeline/upstream/runtimes.yaml
    decides from the version, and the reason says so."""
    from pipeline.runtime import trtllm

    monkeypatch.setattr(trtllm, "_package_dir", lambda: None)
    monkeypatch.setattr(trtllm, "_dist_version", lambda *names: version if "tensorrt_llm" in names else None)
    chosen, why = hardware.runtime_choice("cuda", hardware.trtllm_probe())
    assert chosen == runtime and "by pipeline/upstream/runtimes.yaml" in why


def test_without_tensorrt_llm_auto_is_the_reference_and_says_what_the_container_would_get(monkeypatch):
    from pipeline.runtime import trtllm

    monkeypatch.setattr(trtllm, "_package_dir", lambda: None)
    monkeypatch.setattr(trtllm, "_dist_version", lambda *names: None)
    assert hardware.trtllm_probe() is None
    chosen, why = hardware.runtime_choice("cuda", None)
    assert chosen == "reference"
    assert why == ("TensorRT-LLM is not installed here; in the serving container's TensorRT-LLM 1.2.1 it would be "
                   "trtllm_llmapi, by pipeline/upstream/runtimes.yaml")


def test_the_recorded_versions_cite_nvidias_pages():
    """runtimes.yaml: every fact names its page or repository; the ranges the rules and ``auto`` read."""
    from pipeline import upstream

    doc = upstream.runtime_support()
    for backend in ("llm_api_pytorch", "tensorrt_engine"):
        assert doc[backend]["modules"]
        for fact in doc[backend]["facts"]:
            sources = fact["source"] if isinstance(fact["source"], list) else [fact["source"]]
            assert fact["says"] and all(src.get("page") or src.get("repo") for src in sources), fact
    assert [upstream.engine_backend_in(v) for v in ("0.16.0", "1.2.1", "1.3.0rc24", "main")] == [True, True, False,
                                                                                                   False]
    assert [upstream.llm_api_default_in(v) for v in ("0.21.0", "1.0.0rc2", "1.2.1", "main")] == [False, True, True,
                                                                                                   True]
    assert [upstream.runtime_by_record(v) for v in ("0.21.0", "1.2.1", "1.3.0rc2")] == ["trtllm_engine",
                                                                                          "trtllm_llmapi",
                                                                                          "trtllm_llmapi"]


def test_defaults_compose_to_cpu_and_reference_without_a_gpu(monkeypatch):
    monkeypatch.setattr(hardware, "local_gpu", lambda: None)
    monkeypatch.setattr(hardware, "trtllm_probe", lambda: None)
    cfg = hardware.compose(["model=tiny-qwen3"])
    assert (cfg.target.name, cfg.target.device.value, cfg.runtime.name.value) == ("cpu", "cpu", "reference")


def test_defaults_compose_to_the_local_gpu_and_its_trtllm_runtime(monkeypatch):
    monkeypatch.setattr(hardware, "local_gpu", lambda: H200)
    monkeypatch.setattr(hardware, "trtllm_probe", lambda: _installed("1.2.1"))
    cfg = hardware.compose(["model=tiny-qwen3"])
    assert (cfg.target.name, cfg.runtime.name.value) == ("h200", "trtllm_llmapi")
    # given values are kept: the defaults resolve, explicit choices do not move
    cfg = hardware.compose(["model=tiny-qwen3", "target=cpu", "runtime=reference"])
    assert (cfg.target.name, cfg.runtime.name.value) == ("cpu", "reference")


def test_swept_auto_is_resolved_in_place_and_prints_what_it_became(monkeypatch, capsys):
    from pipeline.runtime import trtllm

    monkeypatch.setattr(hardware, "local_gpu", lambda: B200)
    monkeypatch.setattr(hardware, "trtllm_probe",
                        lambda: trtllm.TrtllmInfo("0.20.0", None, True, None, has_llm_api=False, location="/pkg"))
    hardware._note.cache_clear()
    out = hardware.resolve_overrides(["quant=fp8,nvfp4", "target=auto,h100"], config.shipped_targets(), say=True)
    assert out == ["quant=fp8,nvfp4", "target=b200,h100", "runtime=trtllm_engine"]
    err = capsys.readouterr().err
    assert "target=auto -> b200 (NVIDIA B200, sm100" in err
    assert ("runtime=auto -> trtllm_engine (TensorRT-LLM 0.20.0 at /pkg has no LLM API on the PyTorch backend, but "
            "the TensorRT-engine backend)") in err
    # a sweep that includes the CPU target keeps the reference runtime for all of it
    assert hardware.resolve_overrides(["target=auto,cpu"], config.shipped_targets())[-1] == "runtime=reference"


def test_the_users_command_on_a_hopper_host_is_refused_with_the_fix(monkeypatch):
    """`python -m pipeline build model=qwen32b quant=nvfp4` on an H200: target=auto is h200, where NVFP4 is not
    served; the refusal names what works there."""
    from pipeline import planning

    monkeypatch.setattr(hardware, "local_gpu", lambda: H200)
    monkeypatch.setattr(hardware, "trtllm_probe", lambda: None)
    cfg = hardware.compose(["model=qwen32b", "quant=nvfp4"])
    assert cfg.target.name == "h200"
    problems = planning.compat_problems(cfg)
    assert problems and problems[0].startswith("nvfp4 needs Blackwell") and "for h200 use fp8 or int4_awq" in \
        problems[0]
    # negative control: the same command on a Blackwell host is not refused by the compatibility rules
    monkeypatch.setattr(hardware, "local_gpu", lambda: B200)
    assert planning.compat_problems(hardware.compose(["model=qwen32b", "quant=nvfp4"])) == []
