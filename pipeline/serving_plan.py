"""The serving plan of one config: the serving settings per target, where each came from, the KV-capacity table, the
service-level profile and NVIDIA's performance model's predictions at those very settings, as one typed result
(:class:`ServingPlan`) that ``plan``, ``render``, the renderers (``pipeline/runtime/trtllm.py``, the layouts'
``placeholders.py``), the build and the bundle read. It calls down into the KV arithmetic (:mod:`pipeline.capacity`)
and the performance model (:mod:`pipeline.perfmodel`), never back up.

One plan everywhere: the settings are a function of the config and the pinned versions only. Where the performance
model chooses them (a TensorRT-LLM runtime on a GPU its tables cover), it is required: a host without it refuses the
config in one line (``make perfmodel-env``) rather than build another bundle than ``plan`` showed elsewhere; the
installed version is recorded and enters the build's fingerprint with the settings.

How each setting is derived (a value set in ``build`` wins, and is marked ``set``):

- CPU target: the CPU smoke's sizes (:data:`CPU_SIZES`), because the target is a CPU.
- ``tp_size``: the service profile's TP, else the smallest TP whose KV pool holds the longest workload (the capacity
  planner); 1 for the reference runtime, which runs the model on one device.
- ``max_batch_size``: the service profile's batch (below); without the model's data, trtllm-bench's rule: the
  typical requests (``build.expected_*_len``) the KV pool holds, rounded up as trtllm-bench rounds them
  (``tensorrt_llm/bench/build/tuning.py`` ``finetune_setting``; TensorRT-LLM's scheduler queues what does not fit).
- ``max_seq_len``: the model's context (``model.shape.max_position_embeddings``; what TensorRT-LLM itself uses when
  none is given, ``infer_max_seq_len``), cut only where the KV pool cannot hold one sequence of that length (as
  TensorRT-LLM's KV-cache manager cuts it, "Adjusted max_seq_len"), and never below the longest workload;
  ``max_input_len`` = ``max_seq_len`` - 1. A full batch of full-length sequences need not fit: TensorRT-LLM's
  capacity scheduler (``GUARANTEED_NO_EVICT``, its default) admits a request once the blocks for its prompt and
  ``max_tokens`` are free and queues the rest, first come first served; a started request is never evicted.
- ``max_num_tokens``: one typical prompt plus one decode token per sequence of a full batch (what one in-flight
  batching step schedules, aiconfigurator's context-token budget); with chunked context off, the longest prompt.
- ``cuda_graph_batch_sizes``: powers of two below ``max_batch_size``, and ``max_batch_size``.
- ``kv_cache_free_gpu_mem_fraction``: TensorRT-LLM's default 0.9 (``KvCacheConfig.free_gpu_memory_fraction``,
  "Default is 90%"), never raised to make a worst case fit: the rest is headroom for what the estimate misses.

Service profile (``serve.slo``): among TP x batch at the typical request, the configurations the KV pool holds with at
least ``serve.slo.concurrency`` requests (default: the bench's highest level), each predicted at its own settings
(token budget, ``max_seq_len``, context attention), those within ``ttft_ms`` and ``tpot_ms``; ``objective``
throughput takes the most output tokens/s per GPU, latency the shortest request. None within the limits, or none
holding the concurrency: refused, naming the closest. Where the tables have no data (a GPU without tables, a head
size they lack) the profile is skipped with one line and trtllm-bench's rule sizes the batch; on the reference
runtime there is no TensorRT-LLM prediction at all (one line says why).
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
# TensorRT-LLM's KV fraction default (tensorrt_llm/llmapi/llm_args.py KvCacheConfig.free_gpu_memory_fraction: "Default
# is 90%"; the Triton backend's kv_cache_free_gpu_mem_fraction likewise)
DEFAULT_FRACTION = 0.9
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
WORDS_PER_TOKEN = 0.75  # an English BPE token is about 3/4 of a word: a bench workload's prompt words -> tokens
# TensorRT-LLM's capacity scheduler policy where none is set: tensorrt_llm/llmapi/llm_args.py
# SchedulerConfig.capacity_scheduler_policy, and the Triton backend's batch_scheduler_policy (model_instance_state.cc
# getSchedulerConfigFromParams); "Useful Runtime Options" in TensorRT-LLM's performance tuning guide
SCHEDULER = "GUARANTEED_NO_EVICT"
QUEUE = (f"TensorRT-LLM's capacity scheduler ({SCHEDULER}, its default) admits a request once the KV blocks for its "
         f"prompt and max_tokens are free and queues the rest; a started request is never evicted")
# trtllm-bench's max_batch_size heuristic (tensorrt_llm/bench/build/tuning.py finetune_setting @ 04cba88): the KV
# requests at the target input + output length, at most 4096 per pipeline stage, rounded up optimistically
BENCH_BATCH_CAP = 4096


@dataclass(frozen=True)
class ServingPlan:
    """The serving plan of one config, resolved once (``runner.preflight``). A stage declares the JSON fields it takes
    (``Stage.capacity``, :data:`FIELDS`). ``summary`` carries :meth:`record` (the settings with their sources, the
    profile, the predictions and the performance model's installed version): a function of the config and the
    pinned versions, since a host without the model refuses a config it would choose settings for."""

    tp: int  # what the build uses: build.tp_size, or the profile's or the planner's choice (1 on CPU, reference)
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
    model: str | None = field(default=None, compare=False)  # the performance model that chose settings, if any

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
                "model": self.model}


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


def concurrency(cfg: DictConfig) -> int:
    """The concurrency the bundle is expected to hold: ``serve.slo.concurrency``, else the bench's highest level."""
    set_ = int(cfg.serve.slo.get("concurrency") or 0)
    if set_:
        return set_
    try:
        return max([int(c) for c in cfg.bench.concurrency] or [1])
    except Exception:  # levels not resolvable for this device: config validation names it
        return 1


def applies(cfg: DictConfig) -> bool:
    """Whether NVIDIA's performance model describes this config: a TensorRT-LLM runtime on a GPU whose tables it
    holds, with a format and KV cache it has modes for (it then chooses the settings, and is required)."""
    t = cfg.target
    return (cfg.runtime.name.value != "reference" and perfmodel.no_data(
        t.name, t.device.value, cfg.quant.format.value, cfg.quant.kv_cache.value) is None)


def prewarm(cfg: DictConfig) -> None:
    """Start the performance model's process for ``cfg`` now, where the model will choose its settings and the cache
    does not hold the profile's first answer yet: it loads the GPU's tables (and the speed-of-light view the
    predictions read) while the caller composes, fingerprints and checks."""
    try:
        shape = capacity.shape_from(to_plain(cfg.model.shape))
        if not applies(cfg) or shape is None or cfg.target.device.value != "cuda" or not cfg.target.memory_gb:
            return
        set_ = {k: to_plain(cfg.build)[k] for k in DERIVED if cfg.build[k]}
        sizer, fixed, tp_min = _sizing(cfg, shape, set_)
        cands, _ = _candidates(cfg, sizer, _tps(cfg, shape, tp_min), fixed)
        if cands:
            t, b, seq, mnt = cands[0]
            i, o = sizer.typical
            first = _query(cfg, tp=t, batch=b, isl=i, osl=o, ctx_tokens=mnt, max_seq_len=seq)
            perfmodel.prewarm([first, dataclasses.replace(first, database_mode="SOL")])
    except Exception:  # a warm-up only: whatever fails here fails again, with its message, where it is needed
        return


# ----------------------------------------------------------------------------------------------------- derivation
def _kv_plan(cfg: DictConfig, shape: capacity.Shape, *, tp: int, max_num_tokens: int, need: int) -> capacity.KVPlan:
    t, b = cfg.target, cfg.build
    return capacity.plan(shape, cfg.quant.format.value, cfg.quant.kv_cache.value, float(t.memory_gb),
                         int(t.gpus_per_node), tp=tp, pp=int(b.pp_size),
                         fraction=float(b.kv_cache_free_gpu_mem_fraction) or DEFAULT_FRACTION,
                         max_num_tokens=max_num_tokens, max_batch_size=1, max_seq_len=need,
                         input_len=int(b.expected_input_len), output_len=int(b.expected_output_len))


def _graphs(batch: int) -> list[int]:
    return sorted({2 ** i for i in range(0, 12) if 2 ** i < batch} | {batch})


def bench_batch(kv_requests: float, pp: int) -> int:
    """trtllm-bench's ``max_batch_size`` for a KV pool holding ``kv_requests`` requests of the target length
    (``tensorrt_llm/bench/build/tuning.py`` ``finetune_setting``, optimistic tuning): at most 4096 per pipeline stage,
    then at least 64 and a multiple of 32 below 256, of 128 below 1024, else of 256. "TRT-LLM relies on its runtime
    tuning features to adjust the runtime max batch size according to incoming traffic" (its docstring)."""
    raw = min(kv_requests, BENCH_BATCH_CAP) / max(1, pp)
    if raw < 256:
        return max(64, 32 * math.ceil(raw / 32))
    if raw < 1024:
        return 128 * math.ceil(raw / 128)
    return 256 * math.ceil(raw / 256)


def _summary(p: capacity.KVPlan, fraction: float, seq: int, typical: tuple[int, int]) -> dict[str, Any]:
    row = p.row(p.chosen_kv)
    return {"tp": p.tp, "pp": p.pp, "gpus": p.gpus, "tp_chosen_by_planner": p.tp_chosen_by_planner, "fits": p.fits,
            "weights_gb_per_gpu": round(p.weights_bytes_per_gpu / 1e9, 2),
            "activation_reserve_gb": round(p.activation_reserve_bytes / 1e9, 2), "gpu_gb": p.gpu_bytes / 1e9,
            "kv_cache_free_gpu_mem_fraction": fraction, "chosen_kv": p.chosen_kv, "table": capacity.table(p),
            "full_length_sequences": row.max_tokens // max(1, seq), "typical_requests": row.max_tokens // max(
                1, sum(typical)), "scheduler": SCHEDULER, "warnings": p.warnings}


def _query(cfg: DictConfig, *, tp: int, batch: int, isl: int, osl: int, kv: str | None = None,
           mode: str = "SILICON", ctx_tokens: int = 0, max_seq_len: int = 0) -> perfmodel.Query:
    shape = to_plain(cfg.model.shape)
    src = str(cfg.model.source)
    hub = src[len("hf://"):].split("@")[0] if src.startswith("hf://") else ""
    conf = perfmodel.model_config(shape, str(shape.get("model_type") or ""))
    kv = kv or cfg.quant.kv_cache.value
    fmha = perfmodel.fmha_mode(cfg.runtime.name.value, cfg.quant.format.value, kv, to_plain(cfg.build))
    return perfmodel.Query(hub, json.dumps(conf, sort_keys=True), perfmodel.SYSTEMS[cfg.target.name],
                           perfmodel.GEMM_MODES[cfg.quant.format.value], perfmodel.KV_MODES[kv], tp, batch, isl, osl,
                           mode, ctx_tokens, max_seq_len, fmha)


def _figures(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("ttft_ms", "tpot_ms", "tokens_per_s_per_gpu", "tokens_per_s_per_user", "request_latency_ms", "memory_gb",
            "memory_gb_at_request")
    return {**{k: round(float(r[k]), 2) for k in keys if k in r}, "oom": bool(r.get("oom"))}


def _round_up(n: int, step: int) -> int:
    return -(-int(n) // step) * step


@dataclass
class _Sizer:
    """The sizes that follow from a TP and a batch: the KV pool, ``max_seq_len`` and the token budget (each as set,
    or by its rule), settled together (the token budget's activations come out of the pool)."""

    cfg: DictConfig
    shape: capacity.Shape
    need: int  # the longest workload's tokens
    longest_in: int
    typical: tuple[int, int]
    context: int  # the model's context (0: not known)
    set_: dict[str, Any]

    def seq(self, pool: int) -> int:
        if self.set_.get("max_seq_len"):
            return int(self.set_["max_seq_len"])
        if not self.context:
            return self.need
        return min(self.context, max(self.need, pool))

    def tokens(self, batch: int, seq: int) -> int:
        if self.set_.get("max_num_tokens"):
            return int(self.set_["max_num_tokens"])
        chunked = bool(self.cfg.serve.enable_chunked_context)
        return _round_up((self.typical[0] if chunked else max(self.longest_in, seq - 1)) + batch, 64)

    def settle(self, tp: int, batch: int) -> tuple[capacity.KVPlan, int, int]:
        """(KV plan, max_seq_len, max_num_tokens) at ``tp`` and ``batch``."""
        kv = _kv_name(self.cfg)
        mnt = int(self.set_.get("max_num_tokens") or 8192)  # provisional: the activation reserve before the budget
        p = _kv_plan(self.cfg, self.shape, tp=tp, max_num_tokens=mnt, need=self.need)
        for _ in range(2):
            seq = self.seq(p.row(kv).max_tokens)
            mnt = self.tokens(batch, seq)
            p = _kv_plan(self.cfg, self.shape, tp=tp, max_num_tokens=mnt, need=self.need)
        return p, self.seq(p.row(kv).max_tokens), mnt


def _kv_name(cfg: DictConfig) -> str:
    return "bf16" if cfg.quant.kv_cache.value == "none" else cfg.quant.kv_cache.value


def _candidates(cfg: DictConfig, sizer: _Sizer, tps: list[int], fixed_batch: int) -> tuple[list, int]:
    """The profile's TP x batch candidates, each ``(tp, batch, max_seq_len, max_num_tokens)``: every batch from the
    expected concurrency up to what the KV pool holds of typical requests (the batch set, where set); and the most
    typical requests any of the TPs holds."""
    typical, conc = sizer.typical, concurrency(cfg)
    cands: list[tuple[int, int, int, int]] = []
    best_fit = 0
    for tp in tps:
        p, seq, _ = sizer.settle(tp, fixed_batch or 1)
        fit = p.row(_kv_name(cfg)).max_tokens // sum(typical)
        best_fit = max(best_fit, fit)
        batches = [fixed_batch] if fixed_batch else [b for b in BATCHES if conc <= b <= min(fit, TRTLLM_MAX_BATCH)]
        cands += [(tp, b, seq, sizer.tokens(b, seq)) for b in batches]
    return cands, best_fit


def _profile(cfg: DictConfig, sizer: _Sizer, tps: list[int], fixed_batch: int) -> dict[str, Any]:
    """The service profile: every TP x batch that holds the expected concurrency, predicted at its own settings at
    the typical request; the chosen one and the runners-up. Raises :class:`perfmodel.Unavailable` where the model
    cannot run; a table gap is returned as ``{"error": ...}``."""
    slo, typical = cfg.serve.slo, sizer.typical
    conc = concurrency(cfg)
    cands, best_fit = _candidates(cfg, sizer, tps, fixed_batch)
    where = f"{cfg.model.name} {cfg.quant.format.value} on {cfg.target.name}"
    if not cands:
        if best_fit < 1:
            raise UserError(f"{where}: no TP of {tps} leaves room in the KV pool for one {sum(typical)}-token "
                            f"request; use a smaller quant, more GPUs (build.pp_size), or a larger GPU")
        raise UserError(f"{where}: no TP of {tps} holds serve.slo.concurrency={conc} typical requests ({typical[0]} "
                        f"in / {typical[1]} out) in the KV pool at once (at most {best_fit}); lower "
                        f"serve.slo.concurrency, set build.tp_size higher, or use a smaller KV format")
    res = perfmodel.estimate([_query(cfg, tp=t, batch=b, isl=typical[0], osl=typical[1], ctx_tokens=m,
                                     max_seq_len=q) for t, b, q, m in cands])
    rows = []
    for (t, b, q, m), r in zip(cands, res):
        if "error" in r:
            return {"error": r["error"]}
        rows.append({"tp": t, "batch": b, **_figures(r), "max_num_tokens": m, "version": r["version"],
                     "within": r["ttft_ms"] <= slo.ttft_ms and r["tpot_ms"] <= slo.tpot_ms})
    throughput = slo.objective.value == "throughput"

    def rank(r: dict[str, Any]) -> tuple:
        return (-r["tokens_per_s_per_gpu"], r["request_latency_ms"]) if throughput else \
            (r["request_latency_ms"], -r["tokens_per_s_per_gpu"])

    ok = sorted((r for r in rows if r["within"]), key=rank)
    limits = f"TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms"
    if not ok:
        closest = min(rows, key=lambda r: max(r["ttft_ms"] / slo.ttft_ms, r["tpot_ms"] / slo.tpot_ms))
        raise UserError(f"{where}: no TP x batch meets serve.slo ({limits}) at {typical[0]} in / {typical[1]} out "
                        f"tokens with {conc} concurrent requests (serve.slo.concurrency); the closest is TP="
                        f"{closest['tp']} batch {closest['batch']} (TTFT {closest['ttft_ms']:.0f} ms, TPOT "
                        f"{closest['tpot_ms']:.1f} ms); raise serve.slo.ttft_ms / serve.slo.tpot_ms, lower "
                        f"serve.slo.concurrency, or use a faster format or GPU")
    best = ok[0]
    why = (f"{'most output tokens/s/GPU' if throughput else 'shortest request'} among {len(ok)} of {len(rows)} "
           f"TP x batch configurations holding {conc} concurrent requests within {limits} (typical request "
           f"{typical[0]} in / {typical[1]} out, each at its own token budget and max_seq_len)")
    return {"objective": slo.objective.value, "ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "concurrency": conc,
            "chosen": best, "runners_up": ok[1:3], "why": why, "swept": len(rows)}


def _sizing(cfg: DictConfig, shape: capacity.Shape, set_: dict[str, Any]) -> tuple[_Sizer, int, int]:
    """(the sizer, the batch set by hand or 0, the smallest TP: 1 on the reference runtime, else the capacity
    planner's)."""
    loads = workloads(cfg)
    need = max(i + o for i, o in loads.values())
    context = int(cfg.model.shape.get("max_position_embeddings") or 0)
    sizer = _Sizer(cfg, shape, need, max(i for i, _ in loads.values()), loads["typical"], context, set_)
    tp_min = 1 if cfg.runtime.name.value == "reference" else _kv_plan(
        cfg, shape, tp=int(cfg.build.tp_size), max_num_tokens=int(set_.get("max_num_tokens") or 8192), need=need).tp
    return sizer, int(set_.get("max_batch_size") or 0), tp_min


def _tps(cfg: DictConfig, shape: capacity.Shape, tp_min: int) -> list[int]:
    b, t = cfg.build, cfg.target
    if int(b.tp_size):
        return [int(b.tp_size)]
    return [x for x in (1, 2, 4, 8, 16) if x >= tp_min and x * int(b.pp_size) <= max(1, int(t.gpus_per_node))
            and shape.num_heads % x == 0][:3] or [tp_min]


def _derive(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, dict[str, str]], capacity.KVPlan | None,
                                      dict[str, Any] | None, list[str], str | None]:
    """(settings, sources, KV plan, profile, notes, the performance model that chose settings or None)."""
    b, t = cfg.build, cfg.target
    set_ = {k: to_plain(b)[k] for k in DERIVED if b[k]}
    sources = {k: {"source": "set", "why": f"build.{k}"} for k in set_}
    notes: list[str] = []
    if t.device.value != "cuda":
        out = {**CPU_SIZES, **set_}
        sources.update({k: {"source": "cpu", "why": "the CPU smoke's size (target is a CPU)"}
                        for k in DERIVED if k not in set_})
        return _fix_input(out, set_, sources), sources, None, None, notes, None
    shape = capacity.shape_from(to_plain(cfg.model.shape))
    loads = workloads(cfg)
    need = max(i + o for i, o in loads.values())
    typical = loads["typical"]
    context = int(cfg.model.shape.get("max_position_embeddings") or 0)
    if shape is None or not t.memory_gb:
        out = {**CPU_SIZES, **set_}
        why = "no model shape before fetch: the CPU smoke's size, not derived"
        sources.update({k: {"source": "fallback", "why": why} for k in DERIVED if k not in set_})
        notes.append(f"{cfg.model.name} has no known shape at plan time: serving sizes are not derived for "
                     f"{t.name}; set build.max_batch_size/max_seq_len, or give model.shape")
        return _fix_input(out, set_, sources), sources, None, None, notes, None
    reference = cfg.runtime.name.value == "reference"
    sizer, fixed, tp_min = _sizing(cfg, shape, set_)
    tp, batch, batch_why, profile, model = tp_min, fixed, "", None, None
    if not reference and applies(cfg):
        why = perfmodel.available()
        if why:
            raise UserError(f"{cfg.model.name} {cfg.quant.format.value} on {t.name} / {cfg.runtime.name.value}: "
                            f"the serving settings are chosen with {why}")
        try:
            prof = _profile(cfg, sizer, _tps(cfg, shape, tp_min), fixed)
        except perfmodel.Unavailable as exc:
            raise UserError(f"{cfg.model.name} on {t.name}: the serving settings are chosen with NVIDIA's "
                            f"performance model, which failed here: {exc}") from None
        if "error" in prof:  # a table gap (a head size the tables lack): deterministic for the installed version
            notes.append(f"no prediction for {cfg.model.name} on {t.name}: the tables have no data for it "
                         f"({prof['error']})")
        else:
            profile, model = prof, perfmodel.installed()
            tp, batch_why = prof["chosen"]["tp"], prof["why"]
            batch = batch or prof["chosen"]["batch"]
    elif not reference:
        gap = perfmodel.no_data(t.name, t.device.value, cfg.quant.format.value, cfg.quant.kv_cache.value)
        notes.append(f"no prediction: {gap}")
    if not batch:
        p0, _, _ = sizer.settle(tp, 64)
        pool0 = p0.row(_kv_name(cfg)).max_tokens
        batch = bench_batch(pool0 / sum(typical), int(b.pp_size))
        batch_why = (f"trtllm-bench's rule: the KV pool of {pool0:,} tokens holds {pool0 // sum(typical):,} typical "
                     f"requests ({typical[0]} in / {typical[1]} out), rounded up as trtllm-bench rounds them "
                     f"(tensorrt_llm/bench/build/tuning.py); more wait in the queue")
    p, seq, mnt = sizer.settle(tp, batch)
    pool = p.row(_kv_name(cfg)).max_tokens
    fraction = float(set_.get("kv_cache_free_gpu_mem_fraction") or DEFAULT_FRACTION)
    out = {"max_batch_size": batch, "max_seq_len": seq, "max_num_tokens": mnt, "cuda_graph_batch_sizes": _graphs(
        batch), "kv_cache_free_gpu_mem_fraction": fraction, **set_}
    if "max_batch_size" not in set_:
        sources["max_batch_size"] = {"source": "derived", "why": batch_why + (
            "; the reference runtime decodes up to this many sequences together" if reference else "")}
    if "max_seq_len" not in set_:
        seq_why = (f"the model's context of {context:,} tokens" if context and seq == context else
                   f"the model's context of {context:,} tokens, cut to the KV pool of {pool:,} tokens (one "
                   f"full-length sequence must fit; TensorRT-LLM cuts it so too)" if context and seq < context else
                   f"the longest workload ({need} tokens; the model's context is not known)")
        sources["max_seq_len"] = {"source": "derived", "why": seq_why}
    if "max_num_tokens" not in set_:
        sources["max_num_tokens"] = {"source": "derived", "why": (
            f"one typical prompt ({typical[0]} tokens) + one token per sequence of the batch"
            if cfg.serve.enable_chunked_context else
            "the longest prompt + one token per sequence (chunked context is off)")}
    if "cuda_graph_batch_sizes" not in set_:
        sources["cuda_graph_batch_sizes"] = {"source": "derived",
                                             "why": "powers of two below max_batch_size, and max_batch_size"}
    if "kv_cache_free_gpu_mem_fraction" not in set_:
        sources["kv_cache_free_gpu_mem_fraction"] = {"source": "derived", "why": (
            "TensorRT-LLM's default; not used by the reference runtime, which keeps its own KV cache" if reference
            else "TensorRT-LLM's default (KvCacheConfig.free_gpu_memory_fraction); never raised to make a worst "
                 "case fit")}
    p.tp_chosen_by_planner = not int(b.tp_size) and not reference
    conc = concurrency(cfg)
    if int(out["max_batch_size"]) < conc:
        p.warnings.append(f"max_batch_size {out['max_batch_size']} is below the expected concurrency of {conc} "
                          f"(serve.slo.concurrency, else the bench's highest level): requests beyond "
                          f"{out['max_batch_size']} wait in the queue")
    return _fix_input(out, set_, sources), sources, p, profile, notes, model


def _fix_input(out: dict[str, Any], set_: dict[str, Any], sources: dict[str, dict[str, str]]) -> dict[str, Any]:
    """``max_input_len``: as set, the CPU smoke's, or ``max_seq_len`` - 1; the settings in :data:`DERIVED` order."""
    if "max_input_len" not in set_ and (sources.get("max_input_len", {}).get("source") not in ("cpu", "fallback")
                                        or "max_seq_len" in set_):
        out["max_input_len"] = int(out["max_seq_len"]) - 1
        sources["max_input_len"] = {"source": "derived", "why": "max_seq_len - 1 (room for one generated token)"}
    return {k: out[k] for k in DERIVED}


# ----------------------------------------------------------------------------------------------------- predictions
def container_trtllm(cfg: DictConfig) -> str | None:
    """The TensorRT-LLM version the bundle is served with: ``runtime.trtllm_version``, else the one NVIDIA pairs
    with ``runtime.container`` (``pipeline/upstream/containers.yaml``); None where neither says."""
    if cfg.runtime.get("trtllm_version"):
        return str(cfg.runtime.trtllm_version)
    from pipeline import upstream

    return upstream.trtllm_for(str(cfg.runtime.get("container") or ""))


def predictions(cfg: DictConfig, plan: ServingPlan) -> tuple[dict[str, Any] | None, list[str]]:
    """The performance model's figures per workload at the bundle's own settings (TP, batch, token budget,
    ``max_seq_len``, context attention): the chosen KV dtype, bf16 KV beside it (when the chosen one is not bf16),
    the speed-of-light floor, and the chosen KV dtype at each bench concurrency; None with one line where it cannot
    say."""
    t = cfg.target
    if cfg.runtime.name.value == "reference" and t.device.value == "cuda":
        return None, ["no prediction: runtime=reference serves the model with PyTorch, which NVIDIA's TensorRT-LLM "
                      "kernel tables do not describe; its bench measures the serving path, not TensorRT-LLM's "
                      "performance"]
    gap = perfmodel.no_data(t.name, t.device.value, cfg.quant.format.value, cfg.quant.kv_cache.value)
    if gap:
        return None, [f"no prediction: {gap}"]
    if plan.kv_plan is None:
        return None, []
    s = plan.settings
    batch, mnt, seq = int(s["max_batch_size"]), int(s["max_num_tokens"]), int(s["max_seq_len"])
    loads = workloads(cfg)
    kvs = list(dict.fromkeys([cfg.quant.kv_cache.value, "none"]))
    levels = sorted({int(c) for c in cfg.bench.concurrency if 0 < int(c) <= batch})  # the bench's, to hold it against
    at = {"ctx_tokens": mnt, "max_seq_len": seq}
    qs = []
    for name, (i, o) in loads.items():
        qs += [_query(cfg, tp=plan.tp, batch=batch, isl=i, osl=o, kv=kv, **at) for kv in kvs]
        qs.append(_query(cfg, tp=plan.tp, batch=batch, isl=i, osl=o, mode="SOL", **at))
        if name != "typical":
            qs += [_query(cfg, tp=plan.tp, batch=c, isl=i, osl=o, **at) for c in levels]
    try:
        res = perfmodel.estimate(qs)
    except perfmodel.Unavailable as exc:
        raise UserError(f"{cfg.model.name} on {t.name}: NVIDIA's performance model failed here: {exc}") from None
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
    notes = []
    served = container_trtllm(cfg)
    if served and version and served != version:
        notes.append(f"the tables are TensorRT-LLM {version}'s; the bundle is served with TensorRT-LLM {served} "
                     f"(runtime.container): NVIDIA's tables hold no {served} line")
    if perfmodel.installed_version() and perfmodel.installed_version() != perfmodel.CORE_VERSION:
        notes.append(f"{perfmodel.installed()} is installed; the project pins {perfmodel.PINNED} ("
                     f"{perfmodel.ENV_HINT} installs it): settings and figures follow the installed one")
    fmha = perfmodel.fmha_mode(cfg.runtime.name.value, cfg.quant.format.value, cfg.quant.kv_cache.value,
                               to_plain(cfg.build))
    return {"trtllm_tables": version, "container_trtllm": served, "system": perfmodel.SYSTEMS[t.name],
            "model": perfmodel.installed(), "gemm": perfmodel.GEMM_MODES[cfg.quant.format.value], "fmha": fmha,
            "ctx_tokens": mnt, "max_seq_len": seq, "gpu_gb": float(t.memory_gb), "workloads": out}, notes


# ----------------------------------------------------------------------------------------------------- resolve
def resolve(cfg: DictConfig, *, predict: bool = True) -> ServingPlan:
    """The serving plan of ``cfg``: TP (the configured one, the profile's or the planner's choice), PP, the world size,
    the KV pool, the settings and their sources, and the performance model's figures at those settings
    (``predict`` False: settings only, for the plan-time checks of many configs). The summary (what build.json and
    bundle.json record as ``capacity``) carries :meth:`ServingPlan.record` under ``serving``. A config whose
    settings the performance model chooses raises a :class:`UserError` where it is not installed."""
    settings, sources, p, profile, notes, model = _derive(cfg)
    reference = cfg.runtime.name.value == "reference"
    tp = 1 if reference else int(cfg.build.tp_size) or (p.tp if p is not None else 1)
    pp = 1 if reference else int(cfg.build.pp_size)
    world = max(1, tp) * pp if cfg.target.device.value == "cuda" else 1
    kv = (p.row(p.chosen_kv).max_tokens if p is not None else 0)
    summary = (_summary(p, float(settings["kv_cache_free_gpu_mem_fraction"]), int(settings["max_seq_len"]),
                        workloads(cfg)["typical"]) if p is not None else None)
    plan = ServingPlan(tp=tp, pp=pp, world=world, kv_tokens=kv, summary=summary, settings=settings, sources=sources,
                       profile=profile, notes=tuple(notes), kv_plan=p, model=model)
    if predict:
        plan = with_predictions(cfg, plan)
    if plan.summary is not None:  # build.json and bundle.json record the plan ("capacity"): settings, profile, figures
        plan = dataclasses.replace(plan, summary={**plan.summary, "serving": plan.record()})
    return plan


def with_predictions(cfg: DictConfig, plan: ServingPlan) -> ServingPlan:
    """``plan`` with the performance model's figures (``plan`` and the bundle), or a line saying why there are none."""
    if plan.predictions is not None or cfg.target.device.value != "cuda" or plan.kv_plan is None or any(
            n.startswith("no prediction") for n in plan.notes):
        return plan
    preds, more = predictions(cfg, plan)
    plan = dataclasses.replace(plan, predictions=preds, notes=tuple(plan.notes) + tuple(more),
                               model=plan.model or (preds or {}).get("model"))
    if plan.summary is not None:
        plan = dataclasses.replace(plan, summary={**plan.summary, "serving": plan.record()})
    return plan


def kv_problems(plan: ServingPlan) -> list[str]:
    """Where the plan's ``max_seq_len`` exceeds the KV pool it computed (a full-length request could never be
    admitted); empty on a CPU target and without a plan. A full batch of full-length sequences need not fit: the
    capacity scheduler queues what does not."""
    if plan.kv_plan is None:
        return []
    seq = int(plan.settings["max_seq_len"])
    return [] if seq <= plan.kv_tokens else [
        f"max_seq_len {seq:,} exceeds the KV pool of {plan.kv_tokens:,} tokens: a full-length request could never "
        f"be admitted; lower build.max_seq_len, or use more GPUs (build.tp_size)"]


def capacity_problems(cfg: DictConfig, plan: ServingPlan | None = None) -> list[str]:
    """Whether the model fits the target at all, a set ``max_seq_len`` the pool cannot hold, and TP/PP set for the
    reference runtime (which runs on one device)."""
    if cfg.runtime.name.value == "reference" and cfg.target.device.value == "cuda" and (
            int(cfg.build.tp_size) > 1 or int(cfg.build.pp_size) > 1):
        return [f"runtime=reference runs the model on one GPU: build.tp_size={cfg.build.tp_size} "
                f"build.pp_size={cfg.build.pp_size} apply to TensorRT-LLM runtimes; leave them at 0 and 1, or use "
                f"runtime=trtllm_llmapi"]
    plan = plan or resolve(cfg, predict=False)
    p = plan.kv_plan
    if p is None:
        return []
    if not p.fits:
        t = cfg.target
        row = p.row(p.chosen_kv)
        more = ("use a smaller quant, a TensorRT-LLM runtime (TP/PP), or a larger GPU" if cfg.runtime.name.value ==
                "reference" else "use a smaller quant, more GPUs (build.pp_size), or a larger GPU")
        return [f"{cfg.model.name} with {cfg.quant.format.value} weights does not fit on {t.name}: at TP={p.tp} "
                f"(at most {t.gpus_per_node} GPUs per node) the KV pool holds {row.max_tokens:,} tokens, fewer than "
                f"one {max(i + o for i, o in workloads(cfg).values())}-token request; {more}"]
    return kv_problems(plan)
