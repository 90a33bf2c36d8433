"""quantize: ModelOpt PTQ on calibration text, unified HF checkpoint export, and an accuracy report.

Arch-independent: one output is shared by every target. ModelOpt is imported only through ``pipeline.quant.modelopt``.

Output layout::

    checkpoint/            unified HF checkpoint (safetensors + config.json + hf_quant_config.json + tokenizer)
    trtllm_checkpoint/     TRT-LLM checkpoint (config.json + rank{N}.safetensors), for runtime=trtllm_engine only
    accuracy.json          the accuracy gate and the export proof, on held-out text
    quantize.md            the same, readable

The accuracy gate (``pipeline.quality``) compares what is deployed, the exported checkpoint reloaded as it is served
(the reference runtime's dequantizing loader), with the unquantized model; ModelOpt's fake-quant model is compared
too, as a diagnostic. The export proof (``pipeline.quant.proof``) checks the export's structure, each layer and the
reloaded logits against the fake-quant model; a stage where nothing was quantized fails. The calibrated model is
freed before the proof, which holds one model at a time and reads the export tensor by tensor.
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig

from pipeline import calib, capacity, quality, store
from pipeline.config import to_plain
from pipeline.errors import StageFailed, UserError
from pipeline.identity import ArtifactKey
from pipeline.quant import modelopt
from pipeline.results import QuantizeResult
from pipeline.runner import Context, Stage
from pipeline.ui import console, progress, status

TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "*.model", "chat_template.*")


def check(cfg: DictConfig) -> list[str]:
    problems = []
    fmt, kv = cfg.quant.format.value, cfg.quant.kv_cache.value
    c = cfg.quant.calib
    dataset = calib.resolve(c.dataset, cfg.model.source)
    try:
        calib.dataset_path(dataset)
        if not (fmt == "none" and kv == "none"):
            problems.append(calib.short_problem(dataset, int(c.num_samples), int(c.seq_len), bool(c.chat_template),
                                                bool(c.allow_short)))
    except UserError as exc:
        problems.append(str(exc))
    problems.append(modelopt.awq_block_problem(fmt, cfg.quant.block_size, modelopt.config_shape(cfg),
                                               cfg.model.name))
    if kv == "nvfp4" and fmt in modelopt.AWQ_FORMATS and cfg.target.device.value != "cuda":
        problems.append(f"quant.kv_cache=nvfp4 with {fmt} calibrates on a CUDA GPU only (ModelOpt's AWQ search "
                        f"runs NVFP4 KV kernels that have no CPU version); use quant.kv_cache=fp8 on target cpu")
    if not (fmt == "none" and kv == "none"):
        t = cfg.target
        problems.append(capacity.calibration_fit_problem(
            cfg.model.name, float(cfg.model.shape.params_b or 0), device=t.device.value, target=t.name,
            memory_gb=t.memory_gb, gpus_per_node=t.gpus_per_node))
    return [p for p in problems if p]


@contextlib.contextmanager
def _timed(timings: dict[str, float], key: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    timings[key] = time.perf_counter() - t0


def _logits(label: str, model, rows, bs: int):
    with progress(label, -(-len(rows) // bs)) as bar:
        return quality.logits(model, rows, bs, bar.advance)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for pattern in TOKENIZER_GLOBS:
        for p in src.glob(pattern):
            if p.is_file() and not (dst / p.name).exists():
                store.link_or_copy(p, dst / p.name)


def run(ctx: Context) -> QuantizeResult:
    q = ctx.cfg.quant
    fmt, kv = q.format.value, q.kv_cache.value
    src = ctx.inputs["fetch"]
    ckpt = ctx.out / "checkpoint"
    ckpt.mkdir()
    if fmt == "none" and kv == "none":
        for p in sorted(src.iterdir()):
            if p.is_file() and p.name != store.MANIFEST:
                ctx.link_input("fetch", p.name, f"checkpoint/{p.name}")
        result = {"format": fmt, "kv_cache": kv, "quant_algo": None, "kv_cache_quant_algo": None,
                  "note": "unquantized: the fetched checkpoint, unchanged"}
        _write_report(ctx, result)
        return QuantizeResult.model_validate(result)

    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.quant import proof
    from pipeline.runtime import reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, ctx.cfg.model.dtype.value)
    timings: dict[str, float] = {}
    rows = calib.rows(AutoTokenizer.from_pretrained(src), calib.resolve(q.calib.dataset, ctx.cfg.model.source),
                      seq_len=q.calib.seq_len, num_samples=q.calib.num_samples,
                      chat_template=bool(q.calib.chat_template), allow_short=bool(q.calib.allow_short),
                      eval_seq_len=q.eval.seq_len, eval_num_samples=q.eval.num_samples)
    for note in rows.notes:
        console.print(f"[yellow]note:[/] {note}")

    with _timed(timings, "load_s"), status(f"loading {ctx.cfg.model.name} ({ctx.cfg.model.dtype.value}) on {device}"):
        model = AutoModelForCausalLM.from_pretrained(
            src, dtype=dtype, device_map="auto" if device == "cuda" else None, use_safetensors=True,
            trust_remote_code=bool(ctx.cfg.model.trust_remote_code))
        model.eval()
    problem = modelopt.awq_block_problem(fmt, q.block_size, modelopt.model_shape(model), ctx.cfg.model.name)
    if problem:  # the checkpoint disagrees with model.shape: still refuse before calibrating
        raise UserError(problem)
    bs = modelopt.batch_size(q.calib.batch_size, model, q.calib.seq_len, device, len(rows.calib))
    with _timed(timings, "baseline_eval_s"):
        base = _logits("reference logits (unquantized, held-out)", model, rows.heldout, bs)
    with _timed(timings, "calibrate_s"):
        modelopt.calibrate(model, fmt, kv, q.block_size, rows.calib, bs)
    fallbacks = modelopt.use_cpu_nvfp4_fallback(model) if device == "cpu" else 0
    if ctx.capacity is not None:  # trtllm_engine only (trtllm_mapping)
        # first: it adjusts the scales of the layers it fuses, which the HF export then writes
        with _timed(timings, "trtllm_export_s"):
            modelopt.export_trtllm_checkpoint(model, dtype, ctx.out / "trtllm_checkpoint", tp=ctx.capacity.tp,
                                              pp=ctx.capacity.pp)
    ref, rounded = modelopt.prepare_reference(model, fmt, kv)
    with _timed(timings, "quant_eval_s"):
        fq = _logits("fake-quant logits (held-out)", model, rows.heldout, bs)
    with _timed(timings, "export_s"), status("exporting unified HF checkpoint"):
        modelopt.export_hf_checkpoint(model, ckpt)
        _copy_tokenizer(src, ckpt)
    del model  # the proof below holds one model at a time: the calibrated one is freed first
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()

    with _timed(timings, "export_check_s"):
        with status("export proof: structure and layers, from the safetensors"):
            structure = proof.check_structure(ckpt, fmt, kv, q.block_size)
            layers = proof.check_layers(ckpt, ref, q.eval.export_weight_ratio, device)
        with status("reloading the export as it is served (reference dequantizer)"):
            exported = reference.load(ckpt, dtype=dtype, device=device)
        ex = _logits("deployed-checkpoint logits (held-out)", exported, rows.heldout, bs)
        del exported
        gc.collect()

    accuracy = quality.assess(base, fq, ex, rows.heldout, structure=structure, layers=layers,
                              scales=ref.to_json()["scales"], thresholds=to_plain(q.thresholds), mode=q.gate.value,
                              kl_abs=q.eval.export_kl_abs, kl_frac=q.eval.export_kl_frac)
    hf_quant = proof.quant_config(ckpt) or {}
    result = {"format": fmt, "kv_cache": kv, **{k: hf_quant.get(k) for k in (
                  "quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules")},
              "block_size": q.block_size if fmt in modelopt.AWQ_FORMATS else None,
              "modelopt_version": modelopt.version(), "device": device, "cpu_nvfp4_fallback_quantizers": fallbacks,
              "fp8_layers_rounded_as_exported": rounded, "batch_size": bs,
              "bytes_per_param": capacity.bytes_per_param(ckpt), "notes": list(rows.notes),
              "calibration": rows.record(timings["calibrate_s"]),
              "heldout": {"rows": len(rows.heldout), "seq_len": q.eval.seq_len},
              "accuracy": accuracy, "timings_s": {k: round(v, 3) for k, v in timings.items()}}
    _write_report(ctx, result)
    failure = quality.failure(accuracy, fmt, kv)
    if failure:
        raise StageFailed(failure)
    return QuantizeResult.model_validate(result)


def _write_report(ctx: Context, r: dict[str, Any]) -> None:
    (ctx.out / "accuracy.json").write_text(json.dumps(r, indent=2) + "\n")
    (ctx.out / "quantize.md").write_text(quality.report(ctx.cfg.model.name, r))


def extra(cfg: DictConfig, store_dir: Path) -> dict[str, Any]:
    return {"calib_sha256": calib.dataset_digest(calib.resolve(cfg.quant.calib.dataset, cfg.model.source))}


def trtllm_mapping(cfg: DictConfig) -> tuple[str, ...]:
    """The engine runtime also gets a TRT-LLM checkpoint for the build's TP/PP mapping, so only its quantize output
    differs per mapping; the other runtimes share one."""
    return ("tp", "pp") if cfg.runtime.name.value == "trtllm_engine" else ()


STAGE = Stage(
    volatile=("accuracy.json", "quantize.md"),
    name="quantize",
    run=run,
    reads=("model.name", "model.source", "model.dtype", "model.trust_remote_code", "quant"),
    inputs=("fetch",),
    libs=("nvidia-modelopt", "torch", "transformers", "safetensors"),
    root="store",
    label=lambda cfg: ArtifactKey.of(cfg).checkpoint_label,
    check=check,
    extra=extra,
    capacity=trtllm_mapping,
)
