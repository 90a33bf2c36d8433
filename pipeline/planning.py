"""Plan-time decisions from the config alone (no download, no GPU work): compatibility, the local GPU, and the
serving plan's capacity check (:mod:`pipeline.serving_plan` holds the plan itself)."""
from __future__ import annotations

import copy
from typing import Any

from omegaconf import DictConfig

from pipeline import compat, hardware, serving_plan, upstream


def compat_problems(cfg: DictConfig) -> list[str]:
    t = cfg.target
    return compat.problems(cfg.quant.format.value, cfg.quant.kv_cache.value, t.name, int(t.sm), t.device.value,
                           cfg.runtime.name.value, upstream.line_for(cfg.runtime.get("trtllm_version")))


def model_type(cfg: DictConfig) -> str | None:
    """The model's ``config.json`` ``model_type`` as known at plan time: ``model.shape.model_type`` (a shipped model's
    config, or a checkpoint of one's own read by :mod:`pipeline.own_model`), else a synthetic model's own; None
    when only fetch will know it."""
    given = str(cfg.model.shape.get("model_type") or "")
    if given:
        return given
    if str(cfg.model.source) == "synthetic" and cfg.model.get("synthetic") is not None:
        return str(cfg.model.synthetic.model_type)
    return None


# The serving plan (settings, KV capacity, profile, predictions) lives in pipeline.serving_plan; these names are the
# ones the runner and the stages use.
Capacity = serving_plan.ServingPlan
resolve = serving_plan.resolve


def capacity_problems(cfg: DictConfig) -> list[str]:
    """Whether the model fits the target at all, and the serving plan's own limits (no predictions)."""
    return serving_plan.capacity_problems(cfg)


class CapacityView:
    """What one stage sees of the resolved capacity: the fields it declares (``Stage.capacity``), read-only. Reading
    another raises, since its value is not in the stage's fingerprint."""

    __slots__ = ("_values",)

    def __init__(self, values: dict[str, Any]):
        object.__setattr__(self, "_values", copy.deepcopy(dict(values)))

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return copy.deepcopy(values[name])
        raise AttributeError(f"capacity field {name!r} is not declared by this stage (Stage.capacity: "
                             f"{', '.join(values) or 'none'}); an undeclared value would not enter its fingerprint")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("the resolved capacity plan is read-only")

    def __repr__(self) -> str:
        return f"CapacityView({object.__getattribute__(self, '_values')!r})"


def local_sm_problems(cfg: DictConfig) -> list[str]:
    """Engines are tied to one compute capability: a TRT-LLM runtime builds only for the local GPU's SM.

    The reference runtime is plain PyTorch: it builds and serves on any CUDA GPU (e.g. NVFP4 calibrated and checked on
    Hopper for a Blackwell target); the host GPU it ran on is recorded in every manifest.

    In a Slurm job (:func:`pipeline.hardware.slurm_job`) the refusal names the node, the job and what the node lacks,
    and the fix is the target's Slurm placement (``target.slurm``): the job was already submitted the way the fan-out
    advice says, so repeating that advice would send it to the same node again.
    """
    if cfg.target.device.value != "cuda":
        return []
    t = cfg.target
    gpu = hardware.local_gpu()
    job = hardware.slurm_job()
    if job is None:
        here, whose, lacks = "this machine", "this machine's GPU", ""
        fix = (f"build each target on its own GPU type, e.g. python -m pipeline build -m target={t.name} "
               f"hydra/launcher=pipeline_slurm (each job gets its target's Slurm partition and constraint)")
    else:
        here = f"node {job['node']} (Slurm job {job['job']})"
        whose = f"the GPU of {here}"
        placed = " ".join(f"{k}={v}" for k, v in (("partition", t.slurm.partition), ("constraint", t.slurm.constraint))
                          if v) or "none: the cluster's default partition"
        lacks = f": the node lacks an sm{t.sm} GPU"
        fix = (f"make target.slurm ({placed}) select only nodes with an sm{t.sm} GPU and its driver (sinfo -N -o "
               f"'%N %P %f %G' lists each node's partitions, features and GPUs), or report {job['node']} to the "
               f"cluster's admins")
    if gpu is None:
        seen = ""
        if job is not None:
            given = f", although Slurm allocated it GPU {job['gpus']}" if job["gpus"] else ""
            seen = f" that NVML can see{given}{lacks} with a working NVIDIA driver"
        return [f"target {t.name} (sm{t.sm}) needs its GPU to build, and {here} has none{seen}; {fix}"]
    if cfg.runtime.name.value == "reference":
        return []
    if gpu["sm"] != int(t.sm):
        return [f"target {t.name} is sm{t.sm} but {whose} is {gpu['name']} (sm{gpu['sm']}): engines run only on the "
                f"SM they were built on{lacks}; {fix}"]
    return []
