"""The serving plan of one config: the serving settings per target, where each came from, the KV-capacity table, the
service-level profile and NVIDIA's performance model's predictions, as one typed result (:class:`ServingPlan`) that
``plan``, the renderers (``pipeline/runtime/trtllm.py``, the layouts' ``placeholders.py``), the build and the bundle
read. It calls down into the KV arithmetic (:mod:`pipeline.capacity`) and the performance model
(:mod:`pipeline.perfmodel`), never back up.

How each setting is derived (a value set in ``build`` wins, and is marked ``set``):

- CPU target: the CPU smoke's sizes (:data:`CPU_SIZES`), because the target is a CPU.
- ``tp_size``: the smallest TP whose KV pool holds a full-length sequence (the capacity planner), or the service
  profile's TP.
- ``max_batch_size``: the service profile's batch (below), else as many of the longest workload's requests as the
  KV pool holds, at most TensorRT-LLM's own default of 2048 (``BaseLlmArgs.max_batch_size``).
- ``max_seq_len``: the model's context (``model.shape.max_position_embeddings``), cut so that ``max_batch_size x
  max_seq_len`` stays within the KV pool (a full batch of full-length sequences fits), and never below the longest
  workload (``build.expected_*_len`` and each bench workload); ``max_input_len`` = ``max_seq_len`` - 1.
- ``max_num_tokens``: one typical prompt plus one decode token per sequence of a full batch (what one in-flight
  batching step schedules, aiconfigurator's context-token budget); with chunked context off, the longest prompt.
- ``cuda_graph_batch_sizes``: powers of two below ``max_batch_size``, and ``max_batch_size``.
- ``kv_cache_free_gpu_mem_fraction``: TensorRT-LLM's default 0.9 (``KvCacheConfig.free_gpu_memory_fraction``,
  "Default is 90%") where the pool at 0.9 holds ``max_batch_size x max_seq_len``; else the smallest fraction that
  holds them, at most :data:`MAX_FRACTION` (beyond it the plan warns that a full batch at full length does not fit).

Service profile (``serve.slo``): among TP x batch at the typical request, the configurations the performance model
predicts within ``ttft_ms`` and ``tpot_ms``; ``objective`` throughput takes the most output tokens/s per GPU,
latency the shortest request. None within the limits: refused, naming the closest. Without the model's data (a CPU,
a GPU without tables, a head size they lack) the profile is skipped with one line and the KV rule above sizes it.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from pipeline import capacity, perfmodel
from pipeline.config import to_plain
from pipeline.errors import UserError

# The CPU smoke's sizes: a target=cpu build serves a small model on a few cores.
CPU_SIZES = {"max_batch_size": 8, "max_seq_len": 2048, "max_input_len": 1024, "max_num_tokens": 8192,
             "cuda_graph_batch_sizes": [1, 2, 4, 8], "kv_cache_free_gpu_mem_fraction": 0.9}
# TensorRT-LLM's default max_batch_size (tensorrt_llm/llmapi/llm_args.py BaseLlmArgs.max_batch_size, 1.2).
TRTLLM_MAX_BATCH = 2048
DERIVED = ("max_batch_size", "max_seq_len", "max_input_len", "max_num_tokens", "cuda_graph_batch_sizes",
           "kv_cache_free_gpu_mem_fraction")
# TensorRT-LLM's KV fraction default (tensorrt_llm/llmapi/llm_args.py KvCacheConfig.free_gpu_memory_fraction, 1.2) and
# the most the plan raises it to: the rest of the free memory stays for what the activation estimate misses
DEFAULT_FRACTION, MAX_FRACTION = 0.9, 0.95
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
WORDS_PER_TOKEN = 0.75  # an English BPE token is about 3/4 of a word: a bench workload's prompt words -> tokens


@dataclass(frozen=True)
class ServingPlan:
    """The serving plan of one config, resolved once (``runner.preflight``). A stage declares the JSON fields it takes
    (``Stage.capacity``, :data:`FIELDS`); the predictions and profile are for ``plan`` and the bundle, never part of
    a fingerprint (they depend on whether the performance model is installed)."""

    tp: int  # what the build uses: build.tp_size, or the planner's choice (1 on CPU and without a plan)
    pp: int  # build.pp_size
    world: int  # GPUs one model instance spans: max(1, tp) x pp on a GPU target, 1 on CPU
    kv_tokens: int  # tokens the KV pool of one GPU holds at the chosen KV dtype (0 without a plan)
    summary: dict[str, Any] | None  # the KV plan as build.json and bundle.json record it; None without a plan
    settings: dict[str, Any] = field(default_factory=dict)  # the serving settings every renderer uses (DERIVED)
    sources: dict[str, dict[str, str]] = field(default_factory=dict, compare=False)  # name -> {source, why}
    profile: dict[str, Any] | None = field(default=None, compare=False)  # the chosen profile and runners-up
    predictions: dict[str, Any] | None = field(default=None, compare=False)  # per workload, KV dtypes side by side
    notes: tuple[str, ...] = field(default=(), compare=False)  # one line each: what could not be predicted and why
    kv_plan: capacity.KVPlan | None = field(default=None, compare=False, repr=False)

    FIELDS = ("tp", "pp", "world", "kv_tokens", "summary", "settings")  # what a stage may declare (JSON values)

    def values(self, fields: tuple[str, ...] | list[str]) -> dict[str, Any]:
        """The named fields as JSON values (what enters a stage's fingerprint)."""
        unknown = [f for f in fields if f not in self.FIELDS]
        if unknown:
            raise KeyError(f"no capacity field {unknown[0]!r}; choose from {', '.join(self.FIELDS)}")
        return {f: copy.deepcopy(getattr(self, f)) for f in fields}

    def record(self) -> dict[str, Any]:
        """What bundle.json records: the settings with their sources, the profile, the predictions and the model."""
        return {"settings": {k: {"value": v, **self.sources.get(k, {})} for k, v in self.settings.items()},
                "profile": self.profile, "predictions": self.predictions, "notes": list(self.notes),
                "model": perfmodel.PINNED}


def build_settings(build: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """``build`` (the config's plain ``build`` section) with the serving plan's settings in place of its 0s: what the
    renderers take."""
    return {**build, **settings}


# ----------------------------------------------------------------------------------------------------- workloads
def workloads(cfg: DictConfig) -> dict[str, tuple[int, int]]:
    """The requests the plan sizes for, as (input tokens, output tokens): the typical request
    (``build.expected_*_len``) and each bench workload (its prompt words / WORDS_PER_TOKEN, its max_tokens)."""
    b = cfg.build
    out = {"typical": (int(b.expected_input_len), int(b.expected_output_len))}
    for name in cfg.bench.workloads:
        try:
            w = cfg.bench.workloads[name]
            out[str(name)] = (max(1, math.ceil(int(w.prompt_words) / WORDS_PER_TOKEN)), int(w.max_tokens))
        except Exception:  # sizes not set for this device: config validation names it
            continue
    return out


# ----------------------------------------------------------------------------------------------------- derivation
def _kv_plan(cfg: DictConfig, shape: capacity.Shape, *, tp: int, max_num_tokens: int, need: int,
             fraction: float | None = None) -> capacity.KVPlan:
    t, b = cfg.target, cfg.build
    return capacity.plan(shape, cfg.quant.format.value, cfg.quant.kv_cache.value, float(t.memory_gb),
                         int(t.gpus_per_node), tp=tp, pp=int(b.pp_size),
                         fraction=fraction or float(b.kv_cache_free_gpu_mem_fraction) or DEFAULT_FRACTION,
                         max_num_tokens=max_num_tokens,
                         max_batch_size=1, max_seq_len=need, input_len=int(b.expected_input_len),
                         output_len=int(b.expected_output_len))


def _graphs(batch: int) -> list[int]:
    return sorted({2 ** i for i in range(0, 12) if 2 ** i < batch} | {batch})


def _summary(p: capacity.KVPlan, fraction: float) -> dict[str, Any]:
    return {"tp": p.tp, "pp": p.pp, "gpus": p.gpus, "tp_chosen_by_planner": p.tp_chosen_by_planner, "fits": p.fits,
            "weights_gb_per_gpu": round(p.weights_bytes_per_gpu / 1e9, 2),
            "activation_reserve_gb": round(p.activation_reserve_bytes / 1e9, 2), "gpu_gb": p.gpu_bytes / 1e9,
            "kv_cache_free_gpu_mem_fraction": fraction,
            "chosen_kv": p.chosen_kv, "table": capacity.table(p), "warnings": p.warnings}


def _query(cfg: DictConfig, *, tp: int, batch: int, isl: int, osl: int, kv: str | None = None,
           mode: str = "SILICON") -> perfmodel.Query:
    shape = to_plain(cfg.model.shape)
    src = str(cfg.model.source)
    hub = src[len("hf://"):].split("@")[0] if src.startswith("hf://") else ""
    conf = perfmodel.model_config(shape, str(shape.get("model_type") or ""))
    return perfmodel.Query(hub, json.dumps(conf, sort_keys=True), perfmodel.SYSTEMS[cfg.target.name],
                           perfmodel.GEMM_MODES[cfg.quant.format.value],
                           perfmodel.KV_MODES[kv or cfg.quant.kv_cache.value], tp, batch, isl, osl, mode)


def _figures(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("ttft_ms", "tpot_ms", "tokens_per_s_per_gpu", "tokens_per_s_per_user", "request_latency_ms", "memory_gb")
    return {k: round(float(r[k]), 2) for k in keys if k in r}


def _profile(cfg: DictConfig, shape: capacity.Shape, tps: list[int], typical: tuple[int, int], fixed_batch: int,
             mnt: int, need: int) -> tuple[dict[str, Any], str]:
    """The service profile: every TP x batch the model predicts at the typical request, the chosen one and the
    runners-up. Raises :class:`perfmodel.Unavailable` where the model cannot run; a table gap is an ``error``."""
    slo = cfg.serve.slo
    cands: list[tuple[int, int]] = []
    for tp in tps:
        pool = _kv_plan(cfg, shape, tp=tp, max_num_tokens=mnt, need=need).row(
            "bf16" if cfg.quant.kv_cache.value == "none" else cfg.quant.kv_cache.value).max_tokens
        fit = pool // max(need, sum(typical))
        batches = [fixed_batch] if fixed_batch else [b for b in BATCHES if b <= min(fit, TRTLLM_MAX_BATCH)]
        cands += [(tp, b) for b in batches]
    if not cands:
        raise UserError(f"{cfg.model.name} on {cfg.target.name}: no TP of {tps} leaves room in the KV pool for one "
                        f"{need}-token request")
    res = perfmodel.estimate([_query(cfg, tp=t, batch=b, isl=typical[0], osl=typical[1]) for t, b in cands])
    rows = []
    for (t, b), r in zip(cands, res):
        if "error" in r:
            return {"error": r["error"]}, ""
        rows.append({"tp": t, "batch": b, **_figures(r), "version": r["version"],
                     "within": r["ttft_ms"] <= slo.ttft_ms and r["tpot_ms"] <= slo.tpot_ms})
    throughput = slo.objective.value == "throughput"

    def rank(r: dict[str, Any]) -> tuple:
        return (-r["tokens_per_s_per_gpu"], r["request_latency_ms"]) if throughput else \
            (r["request_latency_ms"], -r["tokens_per_s_per_gpu"])

    ok = sorted((r for r in rows if r["within"]), key=rank)
    limits = f"TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms"
    if not ok:
        closest = min(rows, key=lambda r: max(r["ttft_ms"] / slo.ttft_ms, r["tpot_ms"] / slo.tpot_ms))
        raise UserError(f"{cfg.model.name} {cfg.quant.format.value} on {cfg.target.name}: no TP x batch meets "
                        f"serve.slo ({limits}) at {typical[0]} in / {typical[1]} out tokens; the closest is TP="
                        f"{closest['tp']} batch {closest['batch']} (TTFT {closest['ttft_ms']:.0f} ms, TPOT "
                        f"{closest['tpot_ms']:.1f} ms); raise serve.slo.ttft_ms / serve.slo.tpot_ms, or use a "
                        f"faster format or GPU")
    best = ok[0]
    why = (f"{'most output tokens/s/GPU' if throughput else 'shortest request'} among {len(ok)} of {len(rows)} "
           f"TP x batch configurations within {limits} (typical request {typical[0]} in / {typical[1]} out)")
    return {"objective": slo.objective.value, "ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "chosen": best,
            "runners_up": ok[1:3], "why": why, "swept": len(rows)}, why


def _derive(cfg: DictConfig, use_model: bool = True) -> tuple[dict[str, Any], dict[str, dict[str, str]], capacity.KVPlan | None,
                                       dict[str, Any] | None, list[str]]:
    """(settings, sources, KV plan, profile, notes)."""
    b, t = cfg.build, cfg.target
    set_ = {k: to_plain(b)[k] for k in DERIVED if b[k]}
    sources = {k: {"source": "set", "why": f"build.{k}"} for k in set_}
    notes: list[str] = []
    if t.device.value != "cuda":
        out = {**CPU_SIZES, **set_}
        sources.update({k: {"source": "cpu", "why": "the CPU smoke's size (target is a CPU)"}
                        for k in DERIVED if k not in set_})
        return _fix_input(out, set_, sources), sources, None, None, notes
    shape = capacity.shape_from(to_plain(cfg.model.shape))
    loads = workloads(cfg)
    need = max(i + o for i, o in loads.values())
    longest_in = max(i for i, _ in loads.values())
    typical = loads["typical"]
    context = int(cfg.model.shape.get("max_position_embeddings") or 0)
    if shape is None or not t.memory_gb:
        out = {**CPU_SIZES, **set_}
        why = "no model shape before fetch: the CPU smoke's size, not derived"
        sources.update({k: {"source": "fallback", "why": why} for k in DERIVED if k not in set_})
        notes.append(f"{cfg.model.name} has no known shape at plan time: serving sizes are not derived for "
                     f"{t.name}; set build.max_batch_size/max_seq_len, or give model.shape")
        return _fix_input(out, set_, sources), sources, None, None, notes
    mnt0 = int(set_.get("max_num_tokens") or 8192)  # provisional: the activation reserve before the budget is known
    first = _kv_plan(cfg, shape, tp=int(b.tp_size), max_num_tokens=mnt0, need=max(need, int(set_.get(
        "max_seq_len") or 0)))
    tp_min = first.tp
    if int(b.tp_size):
        tps = [int(b.tp_size)]
    else:
        tps = [x for x in (1, 2, 4, 8, 16) if x >= tp_min and x * int(b.pp_size) <= max(1, int(t.gpus_per_node))
               and shape.num_heads % x == 0][:3] or [tp_min]
    profile = None
    gap = perfmodel.no_data(t.name, t.device.value, cfg.quant.format.value, cfg.quant.kv_cache.value)
    tp = tp_min
    batch = int(set_.get("max_batch_size") or 0)
    batch_why = ""
    if gap:
        notes.append(f"no prediction: {gap}")
    elif not use_model:
        notes.append("no prediction: the KV rule alone (a plan-time check)")
    else:
        try:
            prof, why = _profile(cfg, shape, tps, typical, batch, mnt0, need)
            if "error" in prof:
                notes.append(f"no prediction for {cfg.model.name} on {t.name}: the tables have no data for it "
                             f"({prof['error']})")
            else:
                profile = prof
                tp, batch_why = prof["chosen"]["tp"], why
                if not batch:
                    batch = prof["chosen"]["batch"]
        except perfmodel.Unavailable as exc:
            notes.append(f"no prediction: {exc}")
    # the token budget, the KV pool it leaves, then the batch and length that pool holds
    kv = "bf16" if cfg.quant.kv_cache.value == "none" else cfg.quant.kv_cache.value
    chunked = bool(cfg.serve.enable_chunked_context)
    for _ in range(2):
        pool0 = _kv_plan(cfg, shape, tp=tp, max_num_tokens=mnt0, need=need).row(kv).max_tokens
        if not batch:
            batch = max(1, min(TRTLLM_MAX_BATCH, pool0 // need))
            batch_why = (f"as many {need}-token requests (the longest workload) as the KV pool of "
                         f"{pool0:,} tokens holds, at most {TRTLLM_MAX_BATCH}")
        seq0 = int(set_.get("max_seq_len") or 0) or min(context or need, max(need, pool0 // batch))
        mnt = int(set_.get("max_num_tokens") or 0) or _round_up(
            (typical[0] if chunked else max(longest_in, seq0 - 1)) + batch, 64)
        mnt0 = mnt
    p = _kv_plan(cfg, shape, tp=tp, max_num_tokens=mnt0, need=need)
    pool = p.row(kv).max_tokens
    if "max_batch_size" not in set_ and batch * need > pool:
        batch = max(1, pool // need)
    fraction = float(set_.get("kv_cache_free_gpu_mem_fraction") or 0)
    if "max_seq_len" in set_:
        seq = int(set_["max_seq_len"])
        seq_why = "build.max_seq_len"
    else:
        room = pool // batch if batch else pool
        seq = max(2, min(context or need, room))
        seq_why = (f"the model's context of {context:,} tokens" if context and seq == context else
                   f"the KV pool of {pool:,} tokens / {batch} sequences" if room < (context or need) else
                   f"the longest workload ({need} tokens; the model's context is not known)")
    if not fraction:  # the default, or the smallest fraction whose pool holds a full batch at full length
        row = p.row(kv)
        free = row.pool_bytes / DEFAULT_FRACTION  # the memory the fraction is taken of
        needed = batch * seq * row.kv_bytes_per_token / free if free else 0.0
        fraction = DEFAULT_FRACTION if needed <= DEFAULT_FRACTION else min(MAX_FRACTION, math.ceil(needed * 100) / 100)
        sources["kv_cache_free_gpu_mem_fraction"] = {"source": "derived", "why": (
            f"TensorRT-LLM's default: its pool holds {batch} × {seq:,} tokens" if fraction == DEFAULT_FRACTION else
            f"raised from {DEFAULT_FRACTION} so the pool holds {batch} × {seq:,} tokens" if needed <= MAX_FRACTION
            else f"raised from {DEFAULT_FRACTION} to the most the plan allows ({MAX_FRACTION}); {batch} × {seq:,} "
                 f"tokens need {needed:.2f}")}
        if fraction != DEFAULT_FRACTION:
            p = _kv_plan(cfg, shape, tp=tp, max_num_tokens=mnt0, need=need, fraction=fraction)
            pool = p.row(kv).max_tokens
    out = {"max_batch_size": batch, "max_seq_len": seq, "max_num_tokens": mnt0,
           "cuda_graph_batch_sizes": _graphs(batch), "kv_cache_free_gpu_mem_fraction": fraction, **set_}
    if "max_batch_size" not in set_:
        sources["max_batch_size"] = {"source": "derived", "why": batch_why}
    if "max_seq_len" not in set_:
        sources["max_seq_len"] = {"source": "derived", "why": seq_why}
    if "max_num_tokens" not in set_:
        sources["max_num_tokens"] = {"source": "derived", "why": (
            f"one typical prompt ({typical[0]} tokens) + one token per sequence of the batch" if chunked else
            "the longest prompt + one token per sequence (chunked context is off)")}
    if "cuda_graph_batch_sizes" not in set_:
        sources["cuda_graph_batch_sizes"] = {"source": "derived",
                                             "why": "powers of two below max_batch_size, and max_batch_size"}
    p.tp_chosen_by_planner = not int(b.tp_size)
    demand = int(out["max_batch_size"]) * int(out["max_seq_len"])
    if p.fits and demand > pool:
        p.warnings.append(
            f"max_batch_size × max_seq_len = {out['max_batch_size']} × {out['max_seq_len']} = {demand:,} tokens "
            f"exceeds the KV pool of {pool:,} tokens: at full length only {pool // int(out['max_seq_len'])} "
            f"sequences fit; lower build.max_seq_len or build.max_batch_size, or use more GPUs")
    return _fix_input(out, set_, sources), sources, p, profile, notes


def _round_up(n: int, step: int) -> int:
    return -(-int(n) // step) * step


def _fix_input(out: dict[str, Any], set_: dict[str, Any], sources: dict[str, dict[str, str]]) -> dict[str, Any]:
    """``max_input_len``: as set, the CPU smoke's, or ``max_seq_len`` - 1; the settings in :data:`DERIVED` order."""
    if "max_input_len" not in set_ and (sources.get("max_input_len", {}).get("source") not in ("cpu", "fallback")
                                        or "max_seq_len" in set_):
        out["max_input_len"] = int(out["max_seq_len"]) - 1
        sources["max_input_len"] = {"source": "derived", "why": "max_seq_len - 1 (room for one generated token)"}
    return {k: out[k] for k in DERIVED}


# ----------------------------------------------------------------------------------------------------- predictions
def predictions(cfg: DictConfig, plan: ServingPlan) -> tuple[dict[str, Any] | None, list[str]]:
    """The performance model's figures per workload at the plan's TP and batch: the chosen KV dtype, bf16 KV beside
    it (when the chosen one is not bf16) and the speed-of-light floor; None with one line where it cannot say."""
    t = cfg.target
    gap = perfmodel.no_data(t.name, t.device.value, cfg.quant.format.value, cfg.quant.kv_cache.value)
    if gap:
        return None, [f"no prediction: {gap}"]
    if plan.kv_plan is None:
        return None, []
    batch = int(plan.settings["max_batch_size"])
    loads = workloads(cfg)
    kvs = list(dict.fromkeys([cfg.quant.kv_cache.value, "none"]))
    levels = sorted({int(c) for c in cfg.bench.concurrency if 0 < int(c) <= batch})  # the bench's, to hold it against
    qs = []
    for name, (i, o) in loads.items():
        qs += [_query(cfg, tp=plan.tp, batch=batch, isl=i, osl=o, kv=kv) for kv in kvs]
        qs.append(_query(cfg, tp=plan.tp, batch=batch, isl=i, osl=o, mode="SOL"))
        if name != "typical":
            qs += [_query(cfg, tp=plan.tp, batch=c, isl=i, osl=o) for c in levels]
    try:
        res = perfmodel.estimate(qs)
    except perfmodel.Unavailable as exc:
        return None, [f"no prediction: {exc}"]
    out: dict[str, Any] = {}
    version = None
    it = iter(res)
    for name, (i, o) in loads.items():
        row: dict[str, Any] = {"isl": i, "osl": o, "batch": batch, "tp": plan.tp}
        for kv in kvs:
            r = next(it)
            row["kv_" + ("bf16" if kv == "none" else kv)] = {"error": r["error"]} if "error" in r else _figures(r)
            version = version or r.get("version")
        r = next(it)
        row["speed_of_light"] = {"error": r["error"]} if "error" in r else _figures(r)
        if name != "typical":  # the chosen KV dtype at each bench concurrency (the bench compares at the same one)
            row["by_concurrency"] = {}
            for c in levels:
                r = next(it)
                row["by_concurrency"][str(c)] = {"error": r["error"]} if "error" in r else _figures(r)
        out[name] = row
    first_err = next((v["error"] for row in out.values() for k, v in row.items()
                      if k.startswith("kv_") and "error" in v), None)
    if first_err and all("error" in row.get("kv_" + ("bf16" if kvs[0] == "none" else kvs[0]), {})
                         for row in out.values()):
        return None, [f"no prediction for {cfg.model.name} on {t.name}: the tables have no data for it ({first_err})"]
    return {"trtllm_tables": version, "system": perfmodel.SYSTEMS[t.name], "model": perfmodel.PINNED,
            "gemm": perfmodel.GEMM_MODES[cfg.quant.format.value], "workloads": out}, []


# ----------------------------------------------------------------------------------------------------- resolve
def resolve(cfg: DictConfig, *, predict: bool = False, use_model: bool = True) -> ServingPlan:
    """The serving plan of ``cfg``: TP (the configured one, the profile's or the planner's choice), PP, the world size,
    the KV pool, the settings and their sources, and the performance model's figures where it answered for the
    profile (``predict``: ask for them in any case). The summary (what build.json and bundle.json record as
    ``capacity``) carries :meth:`ServingPlan.record` under ``serving``. ``use_model`` False: the KV rule alone, no
    performance model (the plan-time checks of many configs: ``validate``, sweeps)."""
    settings, sources, p, profile, notes = _derive(cfg, use_model)
    tp = int(cfg.build.tp_size) or (p.tp if p is not None else 1)
    pp = int(cfg.build.pp_size)
    world = max(1, tp) * pp if cfg.target.device.value == "cuda" else 1
    kv = (p.row(p.chosen_kv).max_tokens if p is not None else 0)
    summary = _summary(p, float(settings["kv_cache_free_gpu_mem_fraction"])) if p is not None else None
    plan = ServingPlan(tp=tp, pp=pp, world=world, kv_tokens=kv, summary=summary, settings=settings, sources=sources,
                       profile=profile, notes=tuple(notes), kv_plan=p)
    if predict or profile is not None:  # the model answered for the profile: its figures are cached, ask for them
        plan = with_predictions(cfg, plan)
    if summary is not None:  # build.json and bundle.json record the plan ("capacity"): settings, profile, figures
        plan = dataclasses.replace(plan, summary={**summary, "serving": plan.record()})
    return plan


def with_predictions(cfg: DictConfig, plan: ServingPlan) -> ServingPlan:
    """``plan`` with the performance model's figures (``plan`` and the bundle), or a line saying why there are none."""
    if plan.predictions is not None or cfg.target.device.value != "cuda" or plan.kv_plan is None or any(
            n.startswith("no prediction") for n in plan.notes):
        return plan
    preds, more = predictions(cfg, plan)
    plan = dataclasses.replace(plan, predictions=preds, notes=tuple(plan.notes) + tuple(more))
    if plan.summary is not None:
        plan = dataclasses.replace(plan, summary={**plan.summary, "serving": plan.record()})
    return plan


def kv_problems(plan: ServingPlan) -> list[str]:
    """Where the plan's ``max_batch_size x max_seq_len`` exceeds the KV pool it computed (a full batch of full-length
    sequences would not fit); empty on a CPU target and without a plan."""
    if plan.kv_plan is None:
        return []
    demand = int(plan.settings["max_batch_size"]) * int(plan.settings["max_seq_len"])
    return [] if demand <= plan.kv_tokens else [
        f"max_batch_size x max_seq_len = {demand:,} tokens exceeds the KV pool of {plan.kv_tokens:,} tokens"]


def capacity_problems(cfg: DictConfig, plan: ServingPlan | None = None) -> list[str]:
    p = (plan or resolve(cfg)).kv_plan
    if p is None or p.fits:
        return []
    t = cfg.target
    row = p.row(p.chosen_kv)
    return [f"{cfg.model.name} with {cfg.quant.format.value} weights does not fit on {t.name}: at TP={p.tp} "
            f"(at most {t.gpus_per_node} GPUs per node) the KV pool holds {row.max_tokens:,} tokens, fewer than "
            f"one {max(i + o for i, o in workloads(cfg).values())}-token request; use a smaller quant, more GPUs "
            f"(build.pp_size), or a larger GPU"]
