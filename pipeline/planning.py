"""Plan-time decisions from the config alone (no download, no GPU work): compatibility and capacity."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from pipeline import capacity, compat, hardware
from pipeline.config import to_plain


def compat_problems(cfg: DictConfig) -> list[str]:
    t = cfg.target
    return compat.problems(cfg.quant.format.value, cfg.quant.kv_cache.value, t.name, int(t.sm), t.device.value,
                           cfg.runtime.name.value)


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


def kv_plan(cfg: DictConfig) -> capacity.KVPlan | None:
    """The KV-capacity plan for a GPU target, or None (CPU target, or a model without a known shape)."""
    t, b = cfg.target, cfg.build
    shape = capacity.shape_from(to_plain(cfg.model.shape))
    if t.device.value != "cuda" or shape is None or not t.memory_gb:
        return None
    return capacity.plan(shape, cfg.quant.format.value, cfg.quant.kv_cache.value, float(t.memory_gb),
                         int(t.gpus_per_node), tp=int(b.tp_size), pp=int(b.pp_size),
                         fraction=float(b.kv_cache_free_gpu_mem_fraction), max_num_tokens=int(b.max_num_tokens),
                         max_batch_size=int(b.max_batch_size), max_seq_len=int(b.max_seq_len),
                         input_len=int(b.expected_input_len), output_len=int(b.expected_output_len))


@dataclass(frozen=True)
class Capacity:
    """The capacity plan of one config, resolved once (``runner.preflight``) and handed to the stages that declare
    what they take from it (``Stage.capacity``, ``Context.capacity``)."""

    tp: int  # what the build uses: build.tp_size, or the planner's choice (1 on CPU and without a plan)
    pp: int  # build.pp_size
    world: int  # GPUs one model instance spans: max(1, tp) x pp on a GPU target, 1 on CPU
    kv_tokens: int  # tokens the KV pool of one GPU holds at the chosen KV dtype (0 without a plan)
    summary: dict[str, Any] | None  # the plan as build.json and bundle.json record it; None without a plan
    kv_plan: capacity.KVPlan | None = field(default=None, compare=False, repr=False)

    FIELDS = ("tp", "pp", "world", "kv_tokens", "summary")  # what a stage may declare (JSON values)

    def values(self, fields: tuple[str, ...] | list[str]) -> dict[str, Any]:
        """The named fields as JSON values (what enters a stage's fingerprint)."""
        unknown = [f for f in fields if f not in self.FIELDS]
        if unknown:
            raise KeyError(f"no capacity field {unknown[0]!r}; choose from {', '.join(self.FIELDS)}")
        return {f: copy.deepcopy(getattr(self, f)) for f in fields}


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


def resolve(cfg: DictConfig) -> Capacity:
    """The capacity plan of ``cfg`` with everything derived from it: TP (the configured one, or the planner's choice),
    PP, the world size, the KV pool and the summary the build records."""
    p = kv_plan(cfg)
    tp = int(cfg.build.tp_size) or (p.tp if p is not None else 1)
    pp = int(cfg.build.pp_size)
    world = max(1, tp) * pp if cfg.target.device.value == "cuda" else 1
    return Capacity(tp=tp, pp=pp, world=world, kv_tokens=p.row(p.chosen_kv).max_tokens if p is not None else 0,
                    summary=_summary(p, float(cfg.build.kv_cache_free_gpu_mem_fraction)), kv_plan=p)


def capacity_problems(cfg: DictConfig) -> list[str]:
    p = kv_plan(cfg)
    if p is None or p.fits:
        return []
    t = cfg.target
    row = p.row(p.chosen_kv)
    return [f"{cfg.model.name} with {cfg.quant.format.value} weights does not fit on {t.name}: at TP={p.tp} "
            f"(at most {t.gpus_per_node} GPUs per node) the KV pool holds {row.max_tokens:,} tokens, fewer than "
            f"build.max_seq_len={cfg.build.max_seq_len}; use a smaller quant, more GPUs (build.pp_size), or a "
            f"larger GPU"]


def local_sm_problems(cfg: DictConfig) -> list[str]:
    """Engines are tied to one compute capability: a TRT-LLM runtime builds only for the local GPU's SM.

    The reference runtime is plain PyTorch: it builds and serves on any CUDA GPU (e.g. NVFP4 calibrated and checked on
    Hopper for a Blackwell target); the host GPU it ran on is recorded in every manifest.
    """
    if cfg.target.device.value != "cuda":
        return []
    gpu = hardware.local_gpu()
    fanout = (f"build each target on its own GPU type, e.g. python -m pipeline build -m target={cfg.target.name} "
              f"hydra/launcher=pipeline_slurm (each job gets its target's Slurm partition and constraint)")
    if gpu is None:
        return [f"target {cfg.target.name} (sm{cfg.target.sm}) needs its GPU to build, and this machine has none; "
                f"{fanout}"]
    if cfg.runtime.name.value == "reference":
        return []
    if gpu["sm"] != int(cfg.target.sm):
        return [f"target {cfg.target.name} is sm{cfg.target.sm} but this machine's GPU is {gpu['name']} "
                f"(sm{gpu['sm']}): engines run only on the SM they were built on; {fanout}"]
    return []


def _summary(p: capacity.KVPlan | None, fraction: float) -> dict[str, Any] | None:
    if p is None:
        return None
    return {"tp": p.tp, "pp": p.pp, "gpus": p.gpus, "tp_chosen_by_planner": p.tp_chosen_by_planner, "fits": p.fits,
            "weights_gb_per_gpu": round(p.weights_bytes_per_gpu / 1e9, 2),
            "activation_reserve_gb": round(p.activation_reserve_bytes / 1e9, 2), "gpu_gb": p.gpu_bytes / 1e9,
            "kv_cache_free_gpu_mem_fraction": fraction,
            "chosen_kv": p.chosen_kv, "table": capacity.table(p), "warnings": p.warnings}
