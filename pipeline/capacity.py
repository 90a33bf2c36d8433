"""KV-cache capacity planner: how many tokens and concurrent sequences a model + quant + KV format + GPU + TP/PP holds.

    KV bytes per token per GPU = (layers / PP) × ceil(kv_heads / TP) × head_dim × 2 (K and V) × KV dtype size
    weights per GPU            = (embedding params × 2 bytes + linear params × format bytes/param) / (TP × PP)
    KV pool per GPU            = (GPU memory − weights − activation reserve) × kv_cache_free_gpu_mem_fraction
    max tokens                 = KV pool / KV bytes per token;  max sequences = max tokens / (input + output length)

All sizes in bytes; GPU memory is the target's ``memory_gb`` × 10^9. The activation reserve is an estimate: 1.5 GB
for the CUDA context and workspaces plus ``max_num_tokens`` × (4 × hidden + 2 × intermediate / TP) × 2 bytes.

Also the quantize stage's sizing: the memory calibration needs (``memory_estimate``, ``calibration_fit_problem``) and
the bytes per parameter of an exported checkpoint (``bytes_per_param``); and the CPUs and host memory a Slurm job of a
sweep asks for (``job_host_needs``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.formats import FORMATS, KV_FORMATS

# Bytes per parameter of quantized linear weights (scales included) and per cached K/V value (the format modules).
WEIGHT_BYTES = {n: f.weight_bytes for n, f in FORMATS.items()}
KV_BYTES = {"bf16": KV_FORMATS["none"].bytes, **{n: k.bytes for n, k in KV_FORMATS.items()}}


@dataclass
class Shape:
    params: float
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool


@dataclass
class KVRow:
    kv_dtype: str
    kv_bytes_per_token: float
    pool_bytes: float
    max_tokens: int
    max_sequences: int


@dataclass
class KVPlan:
    """The KV-capacity plan of one model × quant × GPU × TP/PP: weights per GPU, the KV pool and the tokens and
    sequences it holds per KV dtype (``rows``), and the KV dtype chosen. ``planning.Capacity`` is what a build takes
    from it; ``runner.BuildPlan`` is the build's stage plan."""

    tp: int
    pp: int
    gpus: int
    weights_bytes_per_gpu: float
    activation_reserve_bytes: float
    gpu_bytes: float
    rows: list[KVRow]
    chosen_kv: str
    fits: bool
    tp_chosen_by_planner: bool
    warnings: list[str]

    def row(self, kv: str) -> KVRow:
        return next(r for r in self.rows if r.kv_dtype == kv)


def shape_from(model_shape: dict[str, Any]) -> Shape | None:
    s = dict(model_shape)
    need = ("num_layers", "hidden_size", "num_kv_heads", "head_dim", "num_heads")
    if not s.get("params_b") or not all(s.get(k) for k in need):
        return None
    return Shape(params=float(s["params_b"]) * 1e9, num_layers=int(s["num_layers"]),
                 hidden_size=int(s["hidden_size"]), intermediate_size=int(s.get("intermediate_size") or 0),
                 num_heads=int(s["num_heads"]), num_kv_heads=int(s["num_kv_heads"]), head_dim=int(s["head_dim"]),
                 vocab_size=int(s.get("vocab_size") or 0), tie_word_embeddings=bool(s.get("tie_word_embeddings")))


def kv_bytes_per_token(shape: Shape, kv: str, tp: int = 1, pp: int = 1) -> float:
    kv_heads = -(-shape.num_kv_heads // tp)  # heads are split across TP ranks, replicated when TP > kv heads
    return (shape.num_layers / pp) * kv_heads * shape.head_dim * 2 * KV_BYTES[kv]


def weight_bytes(shape: Shape, quant: str) -> float:
    embed = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    linear = max(0.0, shape.params - embed)
    return embed * 2.0 + linear * WEIGHT_BYTES[quant]


def activation_reserve(shape: Shape, max_num_tokens: int, tp: int) -> float:
    return 1.5e9 + max_num_tokens * (4 * shape.hidden_size + 2 * shape.intermediate_size / tp) * 2


def plan_for(shape: Shape, quant: str, kv: str, memory_gb: float, *, tp: int, pp: int, fraction: float,
             max_num_tokens: int, seq_tokens: int) -> KVPlan:
    gpu = memory_gb * 1e9
    w = weight_bytes(shape, quant) / (tp * pp)
    act = activation_reserve(shape, max_num_tokens, tp)
    pool = max(0.0, (gpu - w - act) * fraction)
    rows = []
    for dtype in dict.fromkeys(("bf16", "fp8", kv if kv != "none" else "bf16")):
        per_tok = kv_bytes_per_token(shape, dtype, tp, pp)
        tokens = int(pool // per_tok)
        rows.append(KVRow(dtype, per_tok, pool, tokens, tokens // max(1, seq_tokens)))
    chosen = "bf16" if kv == "none" else kv
    return KVPlan(tp, pp, tp * pp, w, act, gpu, rows, chosen, False, False, [])


def plan(shape: Shape, quant: str, kv: str, memory_gb: float, gpus_per_node: int, *, tp: int = 0, pp: int = 1,
         fraction: float = 0.9, max_num_tokens: int = 8192, max_batch_size: int = 8, max_seq_len: int = 2048,
         input_len: int = 1024, output_len: int = 256) -> KVPlan:
    """The KV-capacity plan at the given TP, or the smallest TP (dividing the head count) whose KV pool holds one max-length
    sequence. ``fits`` is False when nothing within ``gpus_per_node`` does."""
    seq_tokens = input_len + output_len
    candidates = [tp] if tp else [t for t in (1, 2, 4, 8, 16, 32, 64)
                                  if t * pp <= max(1, gpus_per_node) and shape.num_heads % t == 0]
    result = None
    for t in candidates:
        result = plan_for(shape, quant, kv, memory_gb, tp=t, pp=pp, fraction=fraction,
                          max_num_tokens=max_num_tokens, seq_tokens=seq_tokens)
        if result.row(result.chosen_kv).max_tokens >= max_seq_len:
            result.fits = True
            break
    assert result is not None
    result.tp_chosen_by_planner = not tp
    row = result.row(result.chosen_kv)
    demand = max_batch_size * max_seq_len
    if result.fits and demand > row.max_tokens:
        result.warnings.append(
            f"max_batch_size × max_seq_len = {max_batch_size} × {max_seq_len} = {demand:,} tokens exceeds the KV "
            f"pool of {row.max_tokens:,} tokens: at full length only {row.max_tokens // max_seq_len} sequences fit; "
            f"lower build.max_seq_len or build.max_batch_size, or use more GPUs")
    return result


def table(p: KVPlan) -> list[dict[str, Any]]:
    return [{"kv_dtype": r.kv_dtype, "kv_kib_per_token_per_gpu": round(r.kv_bytes_per_token / 1024, 2),
             "kv_pool_gb_per_gpu": round(r.pool_bytes / 1e9, 2), "max_tokens": r.max_tokens,
             "max_concurrent_sequences": r.max_sequences} for r in p.rows]


# The quantize stage's GPU memory beyond the weights, as planned: at least GPU_HEADROOM × the weight bytes, or the
# CUDA context (CUDA_CONTEXT_BYTES: context, cuBLAS workspaces, allocator slack; nvidia-smi counts them, torch's
# max_memory_allocated does not) and one row of activations (``row_bytes``). When it runs, the stage sizes its
# batches to the memory it finds free (:func:`batch_plan`), keeping a margin of each GPU free. It
# holds one model at a time: the calibrated one (bf16 weights), then, for the export proof, the export dequantized.
GPU_HEADROOM = 0.1
CUDA_CONTEXT_BYTES = 1.0e9
ROW_SAFETY = 1.5  # margin on the per-row estimate (kernel workspaces, allocator rounding)


def row_bytes(shape: dict[str, Any], seq_len: int, dtype_bytes: int = 2, logits: bool = True) -> float:
    """GPU bytes one row of ``seq_len`` tokens needs during a forward pass without KV cache, at its peak layer,
    times ROW_SAFETY. ``shape``: hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, vocab_size.

    Per token: the residual stream and norm output (3 × hidden), q/k/v and attention output
    ((2 × heads + 2 × kv heads) × head dim), the MLP's gate, up and product (3 × intermediate) in the model's
    dtype, two float32 temporaries of the widest linear input (ModelOpt's fake-quant and amax), and the logits in the
    model's dtype plus their float32 copy (evaluation computes every position's logits; calibration, ``logits``
    False, only the last position's). Per row: attention scores in float32 (heads × seq²), in case SDPA falls back to
    its math kernel."""
    h, i = int(shape["hidden_size"]), int(shape.get("intermediate_size") or 0)
    heads = int(shape["num_heads"])
    kv, hd = int(shape.get("num_kv_heads") or heads), int(shape["head_dim"])
    vocab = int(shape["vocab_size"])
    per_token = (3 * h + (2 * heads + 2 * kv) * hd + 3 * i) * dtype_bytes + 2 * max(h, i) * 4
    logit_tokens = seq_len if logits else 1
    return ROW_SAFETY * (seq_len * per_token + logit_tokens * vocab * (dtype_bytes + 4) + heads * seq_len * seq_len * 4)


def memory_estimate(params_b: float, row: float = 0.0, devices: int = 1) -> dict[str, float]:
    """The least GPU memory the quantize stage needs, in GB: the bf16 weights (loaded in bf16, never as an fp32
    copy; the calibrated model is freed before the export proof reloads the export dequantized to bf16, so one model
    is held at a time), plus per device the larger of GPU_HEADROOM × its weights and the CUDA context with one row
    of activations (``row`` bytes; batches never go below one row). More free memory buys larger batches."""
    weights = params_b * 1e9 * 2
    per_device = weights / max(1, devices)
    extra = max(GPU_HEADROOM * per_device, CUDA_CONTEXT_BYTES + row) * max(1, devices)
    return {"weights_gb": round(weights / 1e9, 2), "activations_and_context_gb": round(extra / 1e9, 2),
            "peak_gb": round((weights + extra) / 1e9, 2)}


# Calibration on a host without a GPU holds the bf16 weights and the activations in host memory: this × the weights.
HOST_CALIB_FACTOR = 1.1


def calibration_fit_problem(model: str, params_b: float, *, device: str, target: str, memory_gb: float,
                            gpus_per_node: int, row: float = 0.0) -> str | None:
    """Calibration runs on the target's GPUs (``device`` cuda; the model spread over the node's GPUs) or on this
    host (target cpu): will the stage (``memory_estimate``) fit? None when it does, or when the size is unknown
    (``params_b`` 0). ``row``: one calibration row's activation bytes (``row_bytes``)."""
    if params_b <= 0:
        return None
    if device == "cuda":
        gpus = max(1, int(gpus_per_node))
        est = memory_estimate(params_b, row, gpus)
        need = est["peak_gb"]
        have = float(memory_gb) * gpus * 0.92
        if need <= have:
            return None
        where = f"target {target} has {gpus_per_node}× {memory_gb:g} GB"
    else:
        import psutil

        est = memory_estimate(params_b, row)
        need = est["weights_gb"] * HOST_CALIB_FACTOR  # host memory: weights and activations, no CUDA context
        host = psutil.virtual_memory().total / 1e9
        if need <= host * 0.8:
            return None
        where = f"target cpu calibrates on this host, which has {host:.0f} GB of memory and no GPU"
    counts = [(max(1, -(-int(need * 1.05) // size)), size) for size in (141, 80, 48)]
    options = " or ".join(f"{n}× {size} GB GPU{'s' if n > 1 else ''}" for n, size in counts)
    return (f"{model} needs ~{need:.0f} GB to calibrate ({est['weights_gb']:g} GB of bf16 weights + "
            f"{need - est['weights_gb']:.1f} GB of activations and CUDA context); {where}: run quantize on {options}")


# A Slurm job's host resources (hydra/launcher=pipeline_slurm: cpus_per_task, mem_gb), from its plan. Each number's
# source:
# - HOST_PROCESS_GB, the job's own memory beside the checkpoint. cuda: 10.8 GiB, the largest anonymous host RSS of the
#   quantize stage on H200 and H100 at the 14B and 32B shapes (benchmarks/results/gpu_quant_vs_hfptq-*.json,
#   ours.host_peak_anon_rss_gib 8.5 to 10.8; torch's CUDA libraries, ModelOpt, the calibration rows); the 4B bench on
#   an H200, server and front end included, peaked at 6.8 GiB (gpu_e2e-20261130-h200-4b-fp8-final.json). cpu: the
#   runner's peak RSS of the tiny model's stages on a CPU host (the stage's process and its children, manifest
#   peak_rss_mb): fetch to package 0.43 to 0.64 GB, bench 3.39 GB (with tritonserver, its python stub and the
#   front end).
# - the checkpoint: on a GPU job the bf16 checkpoint's pages are mapped while it loads onto the GPU, and the quantize
#   stage's host peak RSS was 0.98 to 1.02 x the bf16 weights at 14B and 32B (compare.ours.host_peak_rss_over_weights
#   in the same records): the bf16 weights once. Without a GPU the model is calibrated and served in host memory:
#   HOST_CALIB_FACTOR x the weights, calibration_fit_problem's host rule.
# - CPUs: one for the job's process (it runs the stages in order); one per GPU rank (TP x PP) where TensorRT-LLM runs
#   the model, which starts one worker process per rank ("the number of MPI processes should be the same as the model
#   world size", NVIDIA/TensorRT-LLM examples/llm-api/llm_mgmn_trtllm_serve.sh @ 0bd8871); SERVING_PROCESSES more
#   when a stage serves the model (bench, eval: pipeline/runner/leases.py starts them).
HOST_PROCESS_GB = {"cuda": 11.6, "cpu": 0.7, "cpu-serving": 3.4}
SERVING_PROCESSES = 3  # tritonserver, its python backend's stub, the OpenAI front end (python -m pipeline.serving)


def job_host_needs(params_b: float, *, device: str, ranks: int, serves: bool) -> dict[str, tuple[int, str]]:
    """The CPUs and host memory (GB, whole) one job needs, each with where its number comes from (see above).
    ``ranks``: GPU worker processes (TP x PP on a TensorRT-LLM runtime, else 0); ``serves``: a selected stage
    serves the model."""
    weights = params_b * 2  # GB: the bf16 weights, 2 bytes a parameter (memory_estimate's weights_gb, unrounded)
    if device == "cuda":
        held, held_why = weights, f"{weights:.3g} GB of bf16 checkpoint mapped while it loads"
        process, process_why = HOST_PROCESS_GB["cuda"], "GPU job's process"
    else:
        held = weights * HOST_CALIB_FACTOR
        held_why = f"{weights:.3g} GB of bf16 weights x {HOST_CALIB_FACTOR:g} held in host memory"
        process = HOST_PROCESS_GB["cpu-serving" if serves else "cpu"]
        process_why = "job's process with the server and front end" if serves else "job's process"
    if params_b <= 0:
        held_why = "the model's size unknown (model.shape.params_b): no checkpoint counted"
    mem = max(1, math.ceil(held + process))
    cpus = 1 + ranks + (SERVING_PROCESSES if serves else 0)
    parts = ["1 job process"] + ([f"{ranks} TensorRT-LLM rank{'s' if ranks > 1 else ''}"] if ranks else [])
    parts += [f"{SERVING_PROCESSES} serving processes"] if serves else []
    return {"cpus_per_task": (cpus, " + ".join(parts)),
            "mem_gb": (mem, f"{held_why} + {process:g} GB for the {process_why}")}


MAX_BATCH = 512
CPU_BATCH = 8
# Tokens per calibration batch beyond which a larger batch buys nothing: the matrix units are busy and ModelOpt's
# per-batch quantizer work (a few small kernels per quantizer and batch) is spread thin. Larger batches only raise the
# peak memory.
BATCH_TOKENS = 65536
# Device memory kept free beside the batches (CUDA context, cuBLAS workspaces, allocator slack, the export's
# temporaries): the stage's peak stays under (1 - MARGIN_FRACTION) of each GPU.
MARGIN_FRACTION = 0.1


def batch_plan(setting: str, *, shape: dict[str, Any], weight_bytes: dict[str, int],
               free: dict[str, dict[str, int]], dtype_bytes: int, seq_len: int, device: str, rows: int,
               eval_seq_len: int | None = None, eval_rows: int | None = None) -> dict[str, Any]:
    """The quantize stage's calibration batch size (``batch_size``) and its held-out evaluation's
    (``eval_batch_size``), and the memory bound they follow, from the facts of a loaded model: its ``shape``
    (:func:`row_bytes`' keys), its weights per CUDA device (``weight_bytes``), the memory ``free`` on each device
    (``{device: {"free", "total"}}``) and its element size.

    ``auto`` on a GPU: the largest batch whose activations (:func:`row_bytes`: calibration keeps only the last
    position's logits, evaluation all of them) fit the memory free after the weights on the tightest device, less
    MARGIN_FRACTION of that device, and at most BATCH_TOKENS tokens. ModelOpt's ``get_max_batch_size`` is not used:
    its probe runs a forward pass sized to fill all free GPU memory. ``auto`` on CPU: CPU_BATCH. An integer: that, up
    to the rows. An out-of-memory error halves a batch later (``pipeline.quant.modelopt.batched``)."""
    eval_seq_len = eval_seq_len or seq_len
    eval_rows = eval_rows or rows
    if str(setting) != "auto":
        n = max(1, int(setting))
        return {"batch_size": min(n, rows), "eval_batch_size": min(n, eval_rows), "rule": "quant.calib.batch_size"}
    if device != "cuda":
        return {"batch_size": max(1, min(CPU_BATCH, rows)), "eval_batch_size": max(1, min(CPU_BATCH, eval_rows)),
                "rule": f"cpu default {CPU_BATCH}"}
    budget = min((max(0, m["free"] - int(MARGIN_FRACTION * m["total"])) for m in free.values()), default=0)
    calib_row = row_bytes(shape, seq_len, dtype_bytes, logits=False)
    eval_row = row_bytes(shape, eval_seq_len, dtype_bytes, logits=True)

    def fit(per_row: float, seq: int, n: int) -> int:
        by_memory = int(budget // per_row) if per_row > 0 else n
        return max(1, min(by_memory, max(1, BATCH_TOKENS // seq), n, MAX_BATCH))

    return {"batch_size": fit(calib_row, seq_len, rows), "eval_batch_size": fit(eval_row, eval_seq_len, eval_rows),
            "rule": f"free GPU memory after the weights - {MARGIN_FRACTION:g} x device memory, per-row estimate, "
                    f"at most {BATCH_TOKENS} tokens a calibration batch",
            "weight_bytes": int(sum(weight_bytes.values())), "free_bytes_by_device": free,
            "budget_bytes": int(budget), "row_bytes": int(calib_row), "eval_row_bytes": int(eval_row)}


# safetensors dtype -> bytes per element
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1, "I8": 1}


def bytes_per_param(ckpt: Path) -> float | None:
    """Weight bytes per parameter of an exported checkpoint (packed 4-bit counts two params per byte)."""
    from safetensors import safe_open

    total_bytes = params = 0
    for shard in Path(ckpt).glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                t = f.get_slice(k)
                n = 1
                for d in t.get_shape():
                    n *= d
                total_bytes += n * DTYPE_BYTES.get(t.get_dtype(), 4)
                if k.endswith(".weight") or k.endswith(".bias"):
                    params += n * (2 if t.get_dtype() == "U8" else 1)
    return round(total_bytes / params, 4) if params else None
