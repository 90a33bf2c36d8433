"""ModelOpt specifics of the quantize stage: format presets, calibration, the fake-quant reference, exports.

Every ``modelopt`` import is inside a function, so that plan-time checks (``awq_block_problem``) load nothing heavy.
The presets and the KV merge follow ModelOpt's ``examples/llm_ptq/hf_ptq.py``.
"""
from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path
from typing import Any

from pipeline.config import to_plain
from pipeline.errors import StageFailed
from pipeline.formats import AWQ_FORMATS, FORMATS, KV_FORMATS
from pipeline.ui import progress, status

# ModelOpt preset per format (the format modules'); the KV config is merged in with update_quant_cfg_with_kv_cache_quant
PRESETS = {n: f.preset for n, f in FORMATS.items() if f.preset}
KV_PRESETS = {n: k.preset for n, k in KV_FORMATS.items() if k.preset}


# ------------------------------------------------------------------------------------------------------ configs
def quant_config(fmt: str, kv: str, block_size: int | None = None) -> dict[str, Any] | None:
    """The ModelOpt config for a format × KV format (× AWQ block size), or None when nothing is quantized."""
    import modelopt.torch.quantization as mtq

    if fmt == "none" and kv == "none":
        return None
    if fmt == "none":
        cfg: dict[str, Any] = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    else:
        cfg = copy.deepcopy(getattr(mtq, PRESETS[fmt]))
    if block_size is not None and fmt in AWQ_FORMATS:
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer":
                sub = entry["cfg"][0] if isinstance(entry["cfg"], list) else entry["cfg"]
                sub["block_sizes"] = {**sub["block_sizes"], -1: block_size}
    if kv != "none":
        cfg = mtq.update_quant_cfg_with_kv_cache_quant(cfg, kv_preset(kv)["quant_cfg"])
    return cfg


def kv_preset(kv: str) -> dict[str, Any]:
    """ModelOpt's KV preset for ``quant.kv_cache=kv``, as hf_ptq.py takes it for ``--kv_cache_qformat kv``:
    ``modelopt.recipe.presets.KV_QUANT_CFG_CHOICES[kv]`` (the YAML presets of ``configs/ptq/presets/kv/``; the KV
    formats are named as ModelOpt names them). A format whose name ModelOpt lacks falls back to its ``mtq``
    constant."""
    import modelopt.torch.quantization as mtq

    try:
        from modelopt.recipe.presets import KV_QUANT_CFG_CHOICES
    except ImportError:  # before ModelOpt's preset table (0.45)
        KV_QUANT_CFG_CHOICES = {}
    if kv in KV_QUANT_CFG_CHOICES:
        return copy.deepcopy(KV_QUANT_CFG_CHOICES[kv])
    return copy.deepcopy(getattr(mtq, KV_PRESETS[kv]))


def linear_in_sizes(shape: dict[str, int]) -> dict[str, int]:
    """Input sizes of a decoder's linear layers, from the model's shape."""
    out = {"hidden size": shape.get("hidden_size", 0), "intermediate size": shape.get("intermediate_size", 0)}
    if shape.get("num_heads") and shape.get("head_dim"):
        out["attention output size"] = shape["num_heads"] * shape["head_dim"]
    return {k: v for k, v in out.items() if v}


def awq_block_problem(fmt: str, block: int | None, shape: dict[str, int], model: str) -> str | None:
    """An AWQ group size must divide every linear input size; name the largest one that does."""
    if fmt not in AWQ_FORMATS:
        return None
    block = FORMATS[fmt].export_group(block)
    sizes = linear_in_sizes(shape)
    bad = {k: v for k, v in sizes.items() if v % block}
    if not bad:
        return None
    g = math.gcd(*sizes.values())
    works = max((b for b in (128, 64, 32, 16, 8) if g % b == 0 and b <= block), default=None)
    what = ", ".join(f"{k} {v}" for k, v in bad.items())
    fix = f"use quant.block_size={works}" if works else "this model cannot use AWQ group quantization"
    return f"quant.block_size={block} does not divide {model}'s {what}; {fix}"


def model_shape(model) -> dict[str, int]:
    """The shape of a loaded transformers model (its text config): the linear-layer sizes ``awq_block_problem``
    reads, and the KV heads and vocabulary that ``capacity.row_bytes`` also needs."""
    hf = model.config.get_text_config()
    heads = hf.num_attention_heads
    return {"hidden_size": hf.hidden_size, "intermediate_size": getattr(hf, "intermediate_size", 0) or 0,
            "num_heads": heads, "num_kv_heads": getattr(hf, "num_key_value_heads", None) or heads,
            "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // heads, "vocab_size": hf.vocab_size}


def config_shape(cfg) -> dict[str, int]:
    """The shape the config declares (``model.shape``, or a synthetic model's own config)."""
    shape = {k: int(v) for k, v in to_plain(cfg.model.shape).items() if k not in ("params_b", "model_type") and v}
    if cfg.model.source == "synthetic" and cfg.model.synthetic is not None:
        c = to_plain(cfg.model.synthetic.config)
        shape.update({k: int(c[src]) for k, src in (("hidden_size", "hidden_size"),
                                                      ("intermediate_size", "intermediate_size"),
                                                      ("num_heads", "num_attention_heads"),
                                                      ("num_kv_heads", "num_key_value_heads"),
                                                      ("head_dim", "head_dim")) if src in c})
    return shape


# -------------------------------------------------------------------------------------------------- calibration
def weight_bytes_per_device(model) -> dict[str, int]:
    """Bytes of parameters and buffers per device the model occupies."""
    out: dict[str, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        out[str(t.device)] = out.get(str(t.device), 0) + t.numel() * t.element_size()
    return out


def free_memory(devices) -> dict[str, dict[str, int]]:
    """Free and total bytes of each CUDA device (``torch.cuda.mem_get_info``: what the driver reports, other
    processes included), after the allocator's cached blocks are returned."""
    import torch

    torch.cuda.empty_cache()
    out = {}
    for d in devices:
        free, total = torch.cuda.mem_get_info(torch.device(d))
        out[d] = {"free": int(free), "total": int(total)}
    return out


def batch_plan(setting: str, model, seq_len: int, device: str, rows: int, *, eval_seq_len: int | None = None,
               eval_rows: int | None = None) -> dict[str, Any]:
    """:func:`pipeline.capacity.batch_plan` for a loaded model: its shape, its weights per device and, on a GPU, the
    memory free on each of them."""
    from pipeline import capacity

    per_device = {d: b for d, b in weight_bytes_per_device(model).items() if d.startswith("cuda")}
    return capacity.batch_plan(setting, shape=model_shape(model), weight_bytes=per_device,
                               free=free_memory(sorted(per_device)) if device == "cuda" and str(setting) == "auto"
                               else {},
                               dtype_bytes=next(model.parameters()).element_size(), seq_len=seq_len, device=device,
                               rows=rows, eval_seq_len=eval_seq_len, eval_rows=eval_rows)


def _oom_types():
    import torch

    return (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)


def batched(rows, batch_size: int, fn, *, step: str, events: list[dict[str, Any]] | None = None, on_rows=None):
    """``fn(chunk)`` over ``rows`` in batches of ``batch_size`` -> the list of results. An out-of-memory error
    halves the batch and retries the same rows (recorded in ``events``); with one row that still does not fit, the
    stage fails (StageFailed). Returns (results, the batch size it ended with)."""
    import gc

    import torch

    out, i, bs = [], 0, max(1, int(batch_size))
    while i < len(rows):
        chunk = rows[i:i + bs]
        oom = None
        try:
            out.append(fn(chunk))
        except _oom_types() as exc:
            oom = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        if oom is None:
            i += len(chunk)
            if on_rows:
                on_rows(len(chunk))
            continue
        # the exception and its frames are gone here: their tensors can be freed before the retry
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if bs == 1:
            raise StageFailed(f"{step}: out of GPU memory with a batch of one row of {rows.shape[1]} tokens "
                              f"({oom}); free GPU memory (other processes), lower quant.calib.seq_len, or use a "
                              f"GPU with more memory")
        if events is not None:
            events.append({"step": step, "row": i, "batch_size": bs, "retry_batch_size": bs // 2, "error": oom})
        bs //= 2
    return out, bs


def calibration_forward(model, rows, batch_size: int, on_rows=None, events: list[dict[str, Any]] | None = None) -> int:
    """Run the calibration rows through ``model`` (ModelOpt's quantizers observe every layer) -> the batch size it
    ended with. Only the last position's logits are computed and no KV cache is kept (``use_cache=False``, as
    ModelOpt's own forward loop runs): calibration needs the activations, not a [batch, seq, vocab] logits tensor or
    the keys and values. A batch that runs out of memory is halved and re-run (``batched``); ModelOpt's
    max calibration sees those rows twice, which leaves every amax as it is."""
    import torch

    dev = next(model.parameters()).device

    def one(chunk) -> None:
        with torch.inference_mode():
            model(input_ids=chunk.to(dev), logits_to_keep=1, use_cache=False)

    return batched(rows, batch_size, one, step="calibrate", events=events, on_rows=on_rows)[1]


def calibrate(model, fmt: str, kv: str, block_size: int | None, rows, batch_size: int,
              events: list[dict[str, Any]] | None = None, parts: dict[str, Any] | None = None, *,
              config: dict[str, Any] | None = None) -> int:
    """ModelOpt PTQ in place: insert the quantizers of ``quant_config`` (or ``config``: a ModelOpt recipe's
    ``quantize`` section, ``pipeline.quant.recipes``) and calibrate them on ``rows`` -> the batch
    size calibration ended with (smaller than ``batch_size`` after an out-of-memory retry, recorded in ``events``).
    Forward loops that ModelOpt runs more than once (AWQ's search) start from the last size that fitted.

    ``parts`` (when given) receives where the time went: ``forward_loop_s`` (every forward loop ModelOpt ran, the
    GPU synchronized at its end), ``forward_loops`` (how many), ``batches_s`` (each batch of the first loop; the
    first also loads ModelOpt's CUDA extensions) and ``insert_and_finish_s`` (the rest of ``mtq.quantize``: the
    quantizers' insertion and the calibration's finish)."""
    import time

    import modelopt.torch.quantization as mtq
    import torch

    state: dict[str, Any] = {"bs": batch_size, "loop_s": 0.0, "loops": 0, "batches": []}
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)

    def forward_loop(m) -> None:
        first = state["loops"] == 0
        t0 = last = time.perf_counter()

        def advance(n: int) -> None:
            nonlocal last
            bar.advance(n)
            if first:
                sync()
                now = time.perf_counter()
                state["batches"].append(round(now - last, 3))
                last = now

        with progress(f"calibrating {fmt} + {kv} KV ({len(rows)}×{rows.shape[1]} tokens)", len(rows)) as bar:
            state["bs"] = calibration_forward(m, rows, state["bs"], advance, events)
        sync()
        state["loop_s"] += time.perf_counter() - t0
        state["loops"] += 1

    t_all = time.perf_counter()
    counter = ExpertTokens(model)
    try:
        mtq.quantize(model, config if config is not None else quant_config(fmt, kv, block_size), forward_loop)
    finally:
        counter.remove()
    sync()
    if parts is not None and counter.counts:
        parts["expert_tokens"] = {name: c.tolist() for name, c in counter.counts.items()}
    uncovered = moe_coverage_problem(counter, model, len(rows), rows.shape[1])
    if uncovered and fmt != "none":
        raise StageFailed(uncovered)
    if parts is not None:
        parts.update(forward_loop_s=round(state["loop_s"], 3), forward_loops=state["loops"],
                     batches_s=state["batches"],
                     insert_and_finish_s=round(time.perf_counter() - t_all - state["loop_s"], 3))
    return state["bs"]


# ------------------------------------------------------------------------------------------ MoE expert coverage
class ExpertTokens:
    """Counts the calibration tokens each MoE expert is routed, from forward hooks on the routers (a module named
    ``gate`` beside an ``experts`` one, as transformers' Mixtral/Qwen-MoE blocks are built): transformers 5 routers
    return (logits, scores, indices); older ones are linear layers whose logits' top-k the block routes by.

    An expert no calibration token reaches has activation quantizers that never saw its inputs: ModelOpt leaves a
    per-expert input quantizer without an amax (its export then falls back to other experts' scales, the "token
    salad" of NVIDIA/Model-Optimizer PRs #1340, #1354, #1411), and transformers 5's fused experts share one input
    quantizer that was calibrated on the other experts' inputs only."""

    def __init__(self, model):
        import torch

        self.counts: dict[str, Any] = {}
        self._hooks = []
        for name, block in model.named_modules():
            gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
            if gate is None or experts is None or not isinstance(gate, torch.nn.Module):
                continue
            n = next((int(getattr(o, a)) for o in (gate, block, experts) for a in ("num_experts", "n_routed_experts")
                      if isinstance(getattr(o, a, None), int)), 0)
            top_k = next((int(getattr(o, a)) for o in (gate, block) for a in ("top_k", "num_experts_per_tok")
                          if isinstance(getattr(o, a, None), int)), 0)
            if n <= 0 or top_k <= 0:
                continue
            self.counts[name] = torch.zeros(n, dtype=torch.long)
            self._hooks.append(gate.register_forward_hook(self._hook(name, top_k)))

    def _hook(self, name: str, top_k: int):
        import torch

        def count(module, inputs, output) -> None:
            with torch.no_grad():
                if isinstance(output, tuple) and len(output) >= 3:
                    indices = output[2]
                else:
                    logits = output[0] if isinstance(output, tuple) else output
                    indices = torch.topk(logits.float(), top_k, dim=-1).indices
                counts = self.counts[name]
                if counts.device != indices.device:  # counted where the router runs: no host sync per batch
                    counts = self.counts[name] = counts.to(indices.device)
                counts += torch.bincount(indices.reshape(-1), minlength=counts.numel())[: counts.numel()]

        return count

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def uncalibrated_experts(counter: ExpertTokens, model) -> list[tuple[str, int]]:
    """(MoE block, expert index) of every expert that no calibration token reached, or whose own enabled
    quantizers were left without an amax (per-expert modules: ``<block>.experts.<index>.*``)."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    out = {(name, int(i)) for name, c in counter.counts.items() for i in (c == 0).nonzero().flatten().tolist()}
    for qname, q in model.named_modules():
        if not isinstance(q, TensorQuantizer) or not q.is_enabled or ".experts." not in qname:
            continue
        if getattr(q, "_use_constant_amax", False) or getattr(q, "_dynamic", False) or q.block_sizes:
            continue
        if getattr(q, "amax", None) is None and not getattr(q, "_disabled", False):
            block, _, rest = qname.partition(".experts.")
            idx = rest.split(".", 1)[0]
            if idx.isdigit():
                out.add((block, int(idx)))
    return sorted(out)


def moe_coverage_problem(counter: ExpertTokens, model, rows: int, seq_len: int) -> str | None:
    """The quantize stage's failure when calibration left MoE experts uncalibrated: which (layer, expert), and
    the fix."""
    missing = uncalibrated_experts(counter, model)
    if not missing:
        return None
    import re

    def layer(block: str) -> str:
        m = re.search(r"layers\.(\d+)", block)
        return f"layer {m.group(1)}" if m else block

    named = ", ".join(f"{layer(b)} expert {i}" for b, i in missing[:12])
    more = f" and {len(missing) - 12} more" if len(missing) > 12 else ""
    return (f"MoE calibration coverage: {len(missing)} expert(s) received no calibration token in {rows} rows x "
            f"{seq_len} tokens ({named}{more}), so their activation scales were never calibrated; calibrate with "
            f"more or longer rows (quant.calib.num_samples, quant.calib.seq_len, or a broader quant.calib.dataset), "
            f"or with ModelOpt's moe_calib_experts_ratio (the calibration algorithm's option, hf_ptq.py "
            f"--moe_calib_experts_ratio), which routes calibration tokens to more experts")


def use_cpu_fallbacks(model, fmt: str, kv: str) -> int:
    """On CPU, after calibration: route the fake-quant kernels of ``fmt`` and ``kv`` that ModelOpt has on CUDA only
    through the format modules' pure-torch ones (``cpu_fallback``; NVFP4's). Returns how many quantizers were
    switched."""
    hooks = dict.fromkeys(h for h in (FORMATS[fmt].cpu_fallback, KV_FORMATS[kv].cpu_fallback) if h is not None)
    return sum(hook(model) for hook in hooks)


# ----------------------------------------------------------------------------------- the reference before export
def prepare_reference(model, fmt: str, kv: str):
    """After calibration: fail when nothing was quantized; apply the steps ModelOpt's export applies anyway (fusion
    of layers that share an input, and the FP8 weight rounding), so that the fake-quant model is the exported
    network; and record the export proof's reference. Returns (proof.Reference, layers rounded as exported: the
    format's ``round_as_exported``, FP8's)."""
    import torch
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    from pipeline.quant import proof

    nothing = nothing_quantized_problem(model, fmt, kv)
    if nothing:
        raise StageFailed(nothing)
    with torch.no_grad():  # idempotent: export_hf_checkpoint runs it again and finds nothing left to do
        requantize_resmooth_fused_llm_layers(model)
    ref = proof.record(model)  # quantization errors from the original weights
    round_as_exported = FORMATS[fmt].round_as_exported
    rounded = round_as_exported(proof.quantized_linears(model)) if round_as_exported else 0
    if rounded:
        proof.resketch(model, ref)
    return ref, rounded


@contextlib.contextmanager
def kv_as_served(model, kv: str, runtime: str = "reference"):
    """Within: every calibrated K/V quantizer's amax is the one the deployment applies (the KV format's
    ``served_scales`` × 448: TensorRT-LLM's LLM API quantizes an FP8 KV cache at scale 1.0 whatever was calibrated),
    so the fake-quant model evaluated is the served one, as the export proof requires; restored on exit, so the
    export still writes the calibrated scales (what ModelOpt exports, and what an engine's checkpoint holds)."""
    import torch

    served = getattr(KV_FORMATS.get(kv), "served_scales", None)
    saved = []
    if served is not None:
        for mod in model.modules():
            qs = [getattr(mod, f"{w}_bmm_quantizer", None) for w in ("k", "v")]
            if not all(q is not None and q.is_enabled and getattr(q, "_amax", None) is not None
                       and not getattr(q, "_use_constant_amax", False) for q in qs):
                continue
            bound = float(qs[0].maxbound)
            scales = served(*(float(q._amax.float().max()) / bound for q in qs), runtime)
            for q, s in zip(qs, scales):
                saved.append((q, q._amax.detach().clone()))
                with torch.no_grad():
                    q._amax.fill_(s * bound)
    try:
        yield len(saved)
    finally:
        with torch.no_grad():
            for q, amax in saved:
                q._amax.copy_(amax)


def nothing_quantized_problem(model, fmt: str, kv: str) -> str | None:
    """After calibration: the requested weight (and KV-cache) quantization must be enabled on some layer."""
    from pipeline.quant import proof

    if fmt != "none" and not any(True for _ in proof.quantized_linears(model)):
        return (f"nothing was quantized: every weight quantizer is disabled after calibration ({fmt} requested; "
                f"no linear layer matched ModelOpt's {PRESETS[fmt]} patterns)")
    if kv != "none" and not any(getattr(getattr(m, f"{k}_bmm_quantizer", None), "is_enabled", False)
                                for m in model.modules() for k in ("k", "v")):
        return (f"nothing was quantized in the KV cache: no k/v quantizer is enabled after calibration "
                f"(quant.kv_cache={kv} requested; ModelOpt found no attention layer it supports)")
    return None


# ------------------------------------------------------------------------------------------------------ exports
def export_trtllm_checkpoint(model, dtype, export_dir: Path, *, tp: int, pp: int) -> None:
    """ModelOpt's TRT-LLM checkpoint export (config.json + rank{N}.safetensors) for the TP x PP mapping. Run it
    before the HF export, which replaces the model's weights in place, and before the proof's reference is
    recorded: it adjusts the quantizers of layers it fuses (q/k/v, gate/up), and the HF export then writes those
    adjusted scales. Its ``config.json`` is then rewritten as TensorRT-LLM's own ``from_hugging_face`` would write it
    (``pipeline.runtime.trtllm_checkpoint``), so it does not depend on whether ``tensorrt_llm`` imports here."""
    import warnings

    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    from pipeline.runtime import trtllm_checkpoint
    from pipeline.runtime.trtllm import decoder_type

    decoder = decoder_type(model.config.model_type)
    with status(f"exporting TRT-LLM checkpoint (TP={tp}, PP={pp})"), warnings.catch_warnings():
        # without tensorrt_llm ModelOpt warns and writes its manual config, which the rewrite below corrects
        warnings.filterwarnings("ignore", message="Cannot export tensorrt_llm checkpoint config")
        export_tensorrt_llm_checkpoint(model, decoder, dtype, export_dir=str(export_dir),
                                       inference_tensor_parallel=tp, inference_pipeline_parallel=pp)
        trtllm_checkpoint.rewrite(export_dir, model.config.to_dict(), decoder)


def export_hf_checkpoint(model, export_dir: Path) -> None:
    """ModelOpt's unified HF export; it replaces the model's weights with the quantized ones."""
    from modelopt.torch.export import export_hf_checkpoint as export

    export(model, export_dir=str(export_dir))


def version() -> str:
    import modelopt

    return modelopt.__version__
