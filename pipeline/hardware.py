"""What this machine has, and what ``target=auto`` / ``runtime=auto`` resolve to here.

- ``target=auto``: the shipped target (``conf/target/*.yaml``) whose SM matches GPU 0 as NVML reports it: the one
  with NVML's name for it, else the nearest in memory; ``cpu`` when NVML finds no NVIDIA driver and the host has no
  NVIDIA device files. Any other NVML failure (or a host with NVIDIA devices that NVML cannot read) is an error that
  names it and the fix, never a silent ``cpu``.
- ``runtime=auto``: on a GPU target, what the installed TensorRT-LLM carries, found in its package files without
  importing it (``pipeline.runtime.trtllm.detect``): ``trtllm_llmapi`` wherever it has the LLM API on the PyTorch
  backend, else ``trtllm_engine`` where it still has the TensorRT-engine backend; where its files cannot be read,
  the recorded versions (``pipeline/upstream/runtimes.yaml``) decide from its version. ``reference`` on a CPU target
  or where TensorRT-LLM is not installed (the printed reason says what the serving container's TensorRT-LLM would
  get).

Both are resolved before Hydra composes (the defaults are ``auto``), so every job, report and manifest holds the
concrete names.
"""
from __future__ import annotations

import functools
import sys
from typing import Iterable

AUTO = "auto"


# NVML's answers that mean "no NVIDIA driver on this host" (a CPU machine): anything else is an error to report
NO_DRIVER = ("NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED")
DEVICE_NODES = ("/dev/nvidia0", "/proc/driver/nvidia/version")


def gpu_device_nodes() -> list[str]:
    """The NVIDIA driver's device files present here: a GPU host has them whatever NVML says."""
    import os

    return [p for p in DEVICE_NODES if os.path.exists(p)]


def slurm_job(environ: dict[str, str] | None = None) -> dict[str, str] | None:
    """The Slurm job this process runs in, from the variables slurmd sets in a job's environment (sbatch(1), "OUTPUT
    ENVIRONMENT VARIABLES"), or None outside one: ``job`` as squeue and the sweep's summary name it (``ARRAY_TASK``
    for an array task, ``SLURM_ARRAY_JOB_ID``/``SLURM_ARRAY_TASK_ID``; else ``SLURM_JOB_ID``), ``node`` (the node it
    runs on: ``SLURMD_NODENAME``, else ``SLURM_JOB_NODELIST``) and ``gpus``, the GPUs Slurm allocated it
    (``SLURM_JOB_GPUS``, else ``CUDA_VISIBLE_DEVICES`` as the gres plugin sets it; empty when none)."""
    import os
    import socket

    env = os.environ if environ is None else environ
    if not env.get("SLURM_JOB_ID"):
        return None
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    return {"job": f"{array}_{task}" if array and task else env["SLURM_JOB_ID"],
            "node": env.get("SLURMD_NODENAME") or env.get("SLURM_JOB_NODELIST") or socket.gethostname(),
            "gpus": env.get("SLURM_JOB_GPUS") or env.get("CUDA_VISIBLE_DEVICES") or ""}


def _fix() -> str:
    return ("name the target (target=h200, target=cpu, ...) instead of target=auto, or fix the driver "
            "(nvidia-smi shows what NVML sees)")


def local_gpu() -> dict | None:
    """Name, SM, memory and count of the NVIDIA GPUs (GPU 0 describes them) via NVML, or None when this host has
    none (NVML finds no driver and no NVIDIA device file exists).

    Raises UserError when NVML fails in any other way (a driver/library mismatch, no permission, a GPU that cannot
    be read), and when a host with NVIDIA device files cannot be read through NVML at all: ``target=auto`` is never
    ``cpu`` on a GPU host because the GPU could not be read."""
    from pipeline.errors import UserError

    nodes = gpu_device_nodes()
    try:
        import pynvml
    except ImportError:
        if nodes:
            raise UserError(f"target=auto: this host has NVIDIA devices ({', '.join(nodes)}) but nvidia-ml-py "
                            f"(pynvml) is not installed; pip install nvidia-ml-py, or {_fix()}") from None
        return None
    no_driver = {getattr(pynvml, n) for n in NO_DRIVER if hasattr(pynvml, n)}
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError and its per-code subclasses
        if getattr(exc, "value", None) in no_driver and not nodes:
            return None
        where = f" although this host has NVIDIA devices ({', '.join(nodes)})" if nodes else ""
        raise UserError(f"target=auto: NVML could not start{where}: {type(exc).__name__}: {exc}; {_fix()}") from exc
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
        name = pynvml.nvmlDeviceGetName(h)
        return {"name": name.decode() if isinstance(name, bytes) else name, "sm": major * 10 + minor,
                "memory_gb": pynvml.nvmlDeviceGetMemoryInfo(h).total / 1e9,
                "count": pynvml.nvmlDeviceGetCount()}
    except Exception as exc:
        raise UserError(f"target=auto: NVML found a driver but could not read GPU 0: {type(exc).__name__}: {exc}; "
                        f"{_fix()}") from exc
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - the reading above is complete; a failed shutdown changes nothing
            pass


def target_for(gpu: dict | None, targets: dict[str, dict]) -> str:
    """The target name for ``gpu`` among ``targets`` (name -> its yaml): same SM; the one NVML names exactly
    (``gpu_name``), else the nearest in memory; ``cpu`` for no GPU.

    Raises UserError when no shipped target has the GPU's SM."""
    from pipeline.errors import UserError

    if gpu is None:
        return "cpu"
    candidates = [(str(t.get("gpu_name", "")) != gpu["name"],
                   abs(float(t.get("memory_gb", 0)) - float(gpu["memory_gb"])), name)
                  for name, t in targets.items()
                  if name not in (AUTO, "cpu") and int(t.get("sm", 0)) == int(gpu["sm"])]
    if not candidates:
        raise UserError(f"target=auto: no shipped target has sm{gpu['sm']} ({gpu['name']}); add "
                        f"conf/target/<name>.yaml, or name a target (target=cpu for the reference runtime on CPU)")
    return min(candidates)[-1]


def detect_target(targets: dict[str, dict]) -> str:
    """``target=auto`` on this machine, among ``targets`` (``pipeline.config.shipped_targets()``)."""
    return target_for(local_gpu(), targets)


def trtllm_probe():
    """The installed TensorRT-LLM (``pipeline.runtime.trtllm.TrtllmInfo``: version and backends, read from its
    package without importing it), or None when it is not installed."""
    from pipeline.runtime import trtllm

    info = trtllm.detect()
    return None if info.version is None else info


def runtime_choice(target_device: str, info) -> tuple[str, str]:
    """``runtime=auto`` for a target of ``target_device`` with TensorRT-LLM ``info`` installed (a ``TrtllmInfo``,
    or None: not installed) -> (runtime, why)."""
    from pipeline import upstream

    if target_device != "cuda":
        return "reference", f"a {target_device} target"
    if info is None:
        line = upstream.DEFAULT_LINE
        would = upstream.runtime_by_record(line)
        return "reference", (f"TensorRT-LLM is not installed here; in the serving container's TensorRT-LLM {line} "
                             f"it would be {would}, by pipeline/upstream/runtimes.yaml")
    where = (f"TensorRT-LLM {info.version} at {info.location}" if info.location
             else f"TensorRT-LLM {info.version}, its package files not found: by pipeline/upstream/runtimes.yaml")
    if info.has_llm_api:
        return "trtllm_llmapi", f"{where} has the LLM API on the PyTorch backend"
    if info.has_engine_backend:
        return "trtllm_engine", f"{where} has no LLM API on the PyTorch backend, but the TensorRT-engine backend"
    return "reference", f"{where} has neither the LLM API's PyTorch backend nor the TensorRT-engine backend"


def runtime_for(target_device: str, info) -> str:
    """``runtime=auto`` for a target of ``target_device`` with TensorRT-LLM ``info`` installed (None: not)."""
    return runtime_choice(target_device, info)[0]


def _device_of(target: str, targets: dict[str, dict]) -> str:
    return "cpu" if target == "cpu" else str(targets.get(target, {}).get("device", "cuda"))


@functools.lru_cache(maxsize=None)
def _note(text: str) -> None:
    """Say once per process what ``auto`` became (stderr: ``--json`` output stays clean)."""
    print(text, file=sys.stderr)


RESOLVED: dict[str, str] = {}  # "target"/"runtime" -> what ``auto`` became here and why (given or the default)


def _why_target(target: str) -> str:
    gpu = local_gpu()
    if gpu is None:
        return f"target=auto -> {target} (NVML reports no NVIDIA GPU)"
    return f"target=auto -> {target} ({gpu['name']}, sm{gpu['sm']}, {gpu['memory_gb']:.0f} GB, via NVML)"


def _split(override: str) -> tuple[str, list[str]]:
    key, _, value = override.partition("=")
    return key.strip(), [v.strip() for v in value.split(",")]


def resolve_overrides(overrides: Iterable[str], targets: dict[str, dict], *, say: bool = False) -> list[str]:
    """``overrides`` with ``target``/``runtime`` made concrete: ``auto`` (given, swept as ``target=auto,h100``, or
    left to the config's default) replaced by what it resolves to here among ``targets`` (name -> its yaml,
    ``pipeline.config.shipped_targets()``). ``say``: print what ``auto`` became and why when it names a GPU or
    a GPU target's runtime, or when ``auto`` was asked for explicitly. :data:`RESOLVED` keeps it either way (``plan``
    always shows it)."""
    out = list(overrides)
    for k in ("target", "runtime"):
        RESOLVED.pop(k, None)
    keys = {_split(o)[0]: i for i, o in enumerate(out) if "=" in o}
    t_given = "target" in keys
    t_values = _split(out[keys["target"]])[1] if t_given else [AUTO]
    if AUTO in t_values:
        detected = detect_target(targets)
        t_values = list(dict.fromkeys(detected if v == AUTO else v for v in t_values))
        RESOLVED["target"] = _why_target(detected) + ("" if t_given else "; target not given, auto is its default")
        if say and (t_given or detected != "cpu"):
            _note(RESOLVED["target"])
    t_override = "target=" + ",".join(t_values)
    if t_given:
        out[keys["target"]] = t_override
    else:
        out.append(t_override)
    r_given = "runtime" in keys
    r_values = _split(out[keys["runtime"]])[1] if r_given else [AUTO]
    if AUTO in r_values:
        # one runtime for the whole sweep: a GPU one only when every swept target is a GPU
        device = "cuda" if all(_device_of(t, targets) == "cuda" for t in t_values) else "cpu"
        runtime, why = runtime_choice(device, trtllm_probe() if device == "cuda" else None)
        r_values = list(dict.fromkeys(runtime if v == AUTO else v for v in r_values))
        RESOLVED["runtime"] = (f"runtime=auto -> {runtime} ({why})"
                               + ("" if r_given else "; runtime not given, auto is its default"))
        if say and (r_given or runtime != "reference"):  # the CPU default needs no word (errors stay one line)
            _note(RESOLVED["runtime"])
    r_override = "runtime=" + ",".join(r_values)
    if r_given:
        out[keys["runtime"]] = r_override
    else:
        out.append(r_override)
    return out



def compose(overrides: Iterable[str] = (), *, say: bool = True):
    """The config this machine builds: :func:`pipeline.config.compose` after :func:`resolve_overrides` has made
    ``target``/``runtime`` ``auto`` concrete (what they became is printed when it names a GPU)."""
    from pipeline import config

    return config.compose(resolve_overrides(overrides, config.shipped_targets(), say=say))


def compose_many(jobs: list[list[str]], *, say: bool = False):
    """:func:`pipeline.config.compose_many` of each job with ``auto`` made concrete for this machine."""
    from pipeline import config

    targets = config.shipped_targets()
    return config.compose_many([resolve_overrides(job, targets, say=say) for job in jobs])
