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

GPU memory: the weights, plus batches sized to the memory free after them less a tenth of each GPU
(``modelopt.batch_plan``; never ModelOpt's probe, which fills the GPU). An out-of-memory error halves the batch and
retries it (``modelopt.batched``), recorded in accuracy.json with each step's torch peak; the stage fails only when one
row does not fit. One model is held at a time.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig

from pipeline import calib, capacity, catalog, hf_config, planning, quality, store, upstream
from pipeline.config import to_plain
from pipeline.errors import StageFailed, UserError
from pipeline.formats import FORMATS, KV_FORMATS
from pipeline.identity import ArtifactKey
from pipeline.quant import modelopt
from pipeline.results import QuantizeResult
from pipeline.runner.contract import Context, Stage
from pipeline.ui import console, progress, status
from pipeline.tokenizer_files import TOKENIZER_GLOBS

PROCESS_PEAK = "process"  # the key of the process's torch peak in the per-step peaks


def check(cfg: DictConfig) -> list[str]:
    problems = []
    fmt, kv = cfg.quant.format.value, cfg.quant.kv_cache.value
    c = cfg.quant.calib
    try:
        spec = calib.spec(cfg)
        calib.dataset_path(spec.dataset)
        if not (fmt == "none" and kv == "none"):
            problems.append(calib.short_problem(spec.dataset, spec.num_samples, spec.seq_len, bool(c.chat_template),
                                                spec.allow_short))
    except UserError as exc:
        problems.append(str(exc))
    problems.append(modelopt.awq_block_problem(fmt, cfg.quant.block_size, modelopt.config_shape(cfg),
                                               cfg.model.name))
    if not KV_FORMATS[kv].awq_calibrates_on_cpu and fmt in modelopt.AWQ_FORMATS and cfg.target.device.value != "cuda":
        problems.append(f"quant.kv_cache={kv} with {fmt} calibrates on a CUDA GPU only (ModelOpt's AWQ search "
                        f"runs {KV_FORMATS[kv].quant_algo} KV kernels that have no CPU version); use "
                        f"quant.kv_cache=fp8 on target cpu")
    if not FORMATS[fmt].calibrates_on_cpu and cfg.target.device.value != "cuda":
        problems.append(f"quant={fmt} calibrates on a CUDA GPU only (ModelOpt's {FORMATS[fmt].preset} runs a CUDA-only "
                        f"kernel during calibration); use a GPU target, or quant=nvfp4 on target cpu")
    if cfg.quant.get("recipe"):
        problems.extend(recipe_problems(cfg))
    if not (fmt == "none" and kv == "none"):
        t = cfg.target
        problems.append(capacity.calibration_fit_problem(
            cfg.model.name, float(cfg.model.shape.params_b or 0), device=t.device.value, target=t.name,
            memory_gb=t.memory_gb, gpus_per_node=t.gpus_per_node, row=_row_bytes(cfg)))
    return [p for p in problems if p]


def recipe_problems(cfg: DictConfig) -> list[str]:
    """``quant.recipe``: a shipped ModelOpt PTQ recipe whose export (derived with ModelOpt's own export code on a
    stand-in of the model's architecture) a format module describes, the target serves, and ``quant`` /
    ``quant.kv_cache`` name (``pipeline.quant.recipes``). When the build stage is selected its own compatibility
    check covers the target for a consistent config, so it is not repeated here."""
    from pipeline.quant import recipes

    until = cfg.get("until")
    build_checked = until is None or catalog.STAGE_NAMES.index(until) >= catalog.STAGE_NAMES.index("build")
    found, _, _ = recipes.problems(cfg, planning.model_type(cfg), upstream.line_for(cfg.runtime.get("trtllm_version")),
                                   compat_checked=build_checked)
    return found


def env_check(cfg: DictConfig) -> list[str]:
    """Before any stage runs, on this machine (quantize runs here, whatever the target): the model fits this
    machine's GPUs, or its memory without one (:func:`machine_fit_problem`), and the calibration data exists here
    (:func:`calibration_problem`)."""
    if cfg.quant.format.value == "none" and cfg.quant.kv_cache.value == "none":
        return []
    return [p for p in (machine_fit_problem(cfg), *calibration_problem(cfg)) if p]


def machine_fit_problem(cfg: DictConfig) -> str | None:
    """Quantize calibrates on this machine's GPUs (all of them, the model spread over them), or on its CPU when it
    has none: the ``check`` above sizes the target's GPUs, this one the machine that will run it. A cached quantize
    needs nothing here (``runner.env_problems`` runs this only for a quantize that runs). The refusal names what
    would work."""
    from pipeline import hardware

    params = float(cfg.model.shape.params_b or 0)
    if params <= 0:
        return None
    gpu = hardware.local_gpu()
    if gpu is not None:
        problem = capacity.calibration_fit_problem(
            cfg.model.name, params, device="cuda", target=f"this machine ({gpu['name']})",
            memory_gb=gpu["memory_gb"], gpus_per_node=gpu["count"], row=_row_bytes(cfg))
    else:
        problem = capacity.calibration_fit_problem(cfg.model.name, params, device="cpu", target="cpu",
                                                   memory_gb=0, gpus_per_node=0, row=_row_bytes(cfg))
        if problem:
            problem = problem.replace("target cpu calibrates on this host", "quantize runs on this machine")
    if problem is None:
        return None
    return (f"{problem}; build until=quantize on such a host (or submit it there with "
            f"hydra/launcher=pipeline_slurm), then build the rest here from the same store; until=fetch works here")


def calibration_problem(cfg: DictConfig) -> list[str]:
    """The calibration data given (``quant.calib.dataset``, not ``auto``) exists on this machine. A Hub dataset needs
    the ``hub`` extra (``datasets``) and a reachable Hub (not ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE``); the fix
    named is the shipped corpus or a local file."""
    import os

    c = cfg.quant.calib
    if c.dataset == "auto":
        return []  # the recipe's dataset, with the shipped corpus as the fallback where it cannot be loaded (calib)
    dataset = calib.resolve(c.dataset, cfg.model.source)
    if not calib.is_hub(dataset):
        return []
    fix = "calibrate on the shipped corpus (quant.calib.dataset=builtin) or a local .txt/.jsonl file"
    try:
        calib.require_hub_support(dataset)
    except UserError:
        return [f"quant.calib.dataset={dataset} comes from the Hub and needs {calib.HUB_EXTRA}; or {fix}"]
    offline = [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
               if os.environ.get(v, "").lower() in ("1", "true", "yes", "on")]
    if offline:
        return [f"quant.calib.dataset={dataset} comes from the Hub and {offline[0]}=1; {fix}"]
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(f"{endpoint}/api/datasets?limit=1", timeout=5).close()
    except urllib.error.HTTPError:
        pass  # the Hub answered
    except (OSError, ValueError) as exc:
        why = getattr(exc, "reason", exc)
        return [f"quant.calib.dataset={dataset} comes from the Hub, which is not reachable from here ({endpoint}: "
                f"{why}); {fix}"]
    return []


def _row_bytes(cfg: DictConfig) -> float:
    """One calibration or evaluation row's activation bytes (``capacity.row_bytes``) from the declared shape; 0 when
    the shape does not say enough."""
    shape = modelopt.config_shape(cfg)
    if not all(shape.get(k) for k in ("hidden_size", "num_heads", "head_dim", "vocab_size")):
        return 0.0
    seq = max(calib.spec(cfg).seq_len, int(cfg.quant.eval.seq_len))
    return capacity.row_bytes(shape, seq)


@contextlib.contextmanager
def _timed(timings: dict[str, float], key: str, peaks: dict[str, int] | None = None) -> Iterator[None]:
    """Time the block into ``timings[key]``; with ``peaks`` (CUDA only), also its torch peak GPU bytes. The peak
    counter is reset per step; ``peaks[PROCESS_PEAK]`` keeps the process's peak across the resets."""
    if peaks is not None:
        import torch

        peaks[PROCESS_PEAK] = max(peaks.get(PROCESS_PEAK, 0), torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    yield
    timings[key] = time.perf_counter() - t0
    if peaks is not None:
        import torch

        peaks[key.removesuffix("_s")] = torch.cuda.max_memory_allocated()


def _logits(label: str, model, rows, bs: int, events: list[dict[str, Any]] | None = None):
    """Held-out logits in batches of ``bs`` (halved on out-of-memory, recorded in ``events``)."""
    import torch

    with progress(label, len(rows)) as bar:
        parts, _ = modelopt.batched(rows, bs, lambda chunk: quality.logits(model, chunk, len(chunk)),
                                    step=label.split(" (")[0], events=events, on_rows=bar.advance)
    return torch.cat(parts)


def _free(ref) -> bool:
    """Free the object ``ref`` (a weakref) points to; True when it is gone.

    Finished frames can outlive their call and keep their locals: a library that stores an exception caught at
    import time (pulp, imported by ModelOpt, keeps its solvers' ImportErrors) keeps the traceback's frames, and their
    callers' frames, alive; when the import first ran inside a call that had the model as a local, that frame holds
    the model. Such frames are cleared (``frame.clear``; frames still executing refuse it and are left alone)."""
    import gc
    import types

    gc.collect()
    obj = ref()
    if obj is None:
        return True
    frames = [r for r in gc.get_referrers(obj) if isinstance(r, types.FrameType)]
    del obj
    for f in frames:
        try:
            f.clear()
        except RuntimeError:  # still executing
            pass
    del frames
    gc.collect()
    return ref() is None


def _hash_in_background(ctx: Context, ckpt: Path):
    """Start hashing the finished export's files in threads (hashlib and file reads release the GIL), so that the
    runner's manifest does not read tens of GB again after the stage. -> a function that waits and records the hashes
    in ``ctx.known_hashes``; nothing may change the files in between (the proof only reads them)."""
    import os

    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and not p.is_symlink())
    pool = ThreadPoolExecutor(max_workers=max(1, min(8, (os.cpu_count() or 2) // 2)), thread_name_prefix="sha256")
    futures = [(p, pool.submit(store.sha256_file, p)) for p in files]

    def finish() -> None:
        for p, fut in futures:
            ctx.known_hashes[p.relative_to(ctx.out).as_posix()] = fut.result()
        pool.shutdown()

    return finish


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
    import weakref

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.quant import proof
    from pipeline.runtime import reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, ctx.cfg.model.dtype.value)
    timings: dict[str, float] = {}
    detail: dict[str, float] = {}  # the export check's parts
    calibrate_parts: dict[str, Any] = {}  # where the calibrate step's time went (modelopt.calibrate)
    peaks: dict[str, int] | None = {} if device == "cuda" else None
    t_rows = time.perf_counter()
    spec = calib.spec(ctx.cfg)
    rows = calib.rows_for(AutoTokenizer.from_pretrained(src), spec, chat_template=bool(q.calib.chat_template),
                          eval_seq_len=q.eval.seq_len, eval_num_samples=q.eval.num_samples)
    timings["calib_rows_s"] = time.perf_counter() - t_rows
    for note in rows.notes:
        console.print(f"[yellow]note:[/] {note}")

    with _timed(timings, "modelopt_import_s"):  # its own step, as in hf_ptq.py (imported before its steps)
        importlib.import_module("modelopt.torch.quantization")  # `modelopt` here is pipeline.quant.modelopt
    with _timed(timings, "load_s", peaks), \
            status(f"loading {ctx.cfg.model.name} ({ctx.cfg.model.dtype.value}) on {device}"):
        model = AutoModelForCausalLM.from_pretrained(
            src, dtype=dtype, device_map="auto" if device == "cuda" else None, use_safetensors=True,
            trust_remote_code=bool(ctx.cfg.model.trust_remote_code))
        model.eval()
    problem = modelopt.awq_block_problem(fmt, q.block_size, modelopt.model_shape(model), ctx.cfg.model.name)
    if problem:  # the checkpoint disagrees with model.shape: still refuse before calibrating
        raise UserError(problem)
    batching = modelopt.batch_plan(q.calib.batch_size, model, int(rows.calib.shape[1]), device, len(rows.calib),
                                   eval_seq_len=int(rows.heldout.shape[1]), eval_rows=len(rows.heldout))
    bs, ebs = batching["batch_size"], batching["eval_batch_size"]
    oom: list[dict[str, Any]] = []  # out-of-memory retries: each halved batch
    with _timed(timings, "baseline_eval_s", peaks):
        base = _logits("reference logits (unquantized, held-out)", model, rows.heldout, ebs, oom)
    recipe, recipe_record = None, None
    if q.get("recipe"):
        from pipeline.quant import recipes

        # the result's and bundle's record (results.RecipeRecord): what the export carries, derived as plan does, on
        # a stand-in of the loaded model's architecture; building the stand-in seeds torch, so the RNG is restored
        with torch.random.fork_rng(devices=[]):
            derived = recipes.derive(str(q.recipe), str(model.config.model_type))
        recipe_record = recipes.record(derived, recipes.to_formats(derived))
    with _timed(timings, "calibrate_s", peaks), tempfile.TemporaryDirectory(prefix="recipe-layerwise-") as scratch:
        config = None
        if q.get("recipe"):  # ModelOpt's recipe (its loader) in place of the format's preset; plan checked it maps
            from pipeline.quant import recipes  # to quant.format / quant.kv_cache

            config = recipes.quant_config(q.recipe, scratch=scratch)
            recipe = {"name": recipes.normalize(q.recipe), "description": recipes.load(q.recipe).description,
                      "algorithm": recipes.algorithm(q.recipe), "quant_cfg": len(config.get("quant_cfg") or [])}
            console.print(f"[cyan]recipe:[/] ModelOpt {recipe['name']} ({recipe['algorithm']} calibration)")
        bs_used = modelopt.calibrate(model, fmt, kv, q.block_size, rows.calib, bs, oom, calibrate_parts,
                                     config=config)
    fallbacks = modelopt.use_cpu_fallbacks(model, fmt, kv) if device == "cpu" else 0
    if ctx.capacity is not None:  # trtllm_engine only (trtllm_mapping)
        # first: it adjusts the scales of the layers it fuses, which the HF export then writes
        with _timed(timings, "trtllm_export_s", peaks):
            modelopt.export_trtllm_checkpoint(model, dtype, ctx.out / "trtllm_checkpoint", tp=ctx.capacity.tp,
                                              pp=ctx.capacity.pp)
    with _timed(timings, "reference_s", peaks):  # the proof's record of the fake-quant weights
        ref, rounded = modelopt.prepare_reference(model, fmt, kv)
    with _timed(timings, "quant_eval_s", peaks), modelopt.kv_as_served(model, kv):  # KV scales as served
        fq = _logits("fake-quant logits (held-out)", model, rows.heldout, ebs, oom)
    with _timed(timings, "export_s", peaks), status("exporting unified HF checkpoint"):
        modelopt.export_hf_checkpoint(model, ckpt)
        hf_config.write_legacy_rope(ckpt / "config.json")  # as TensorRT-LLM 1.2's transformers 4.57 reads it
        _copy_tokenizer(src, ckpt)
    hashed = _hash_in_background(ctx, ckpt)  # overlaps the export proof
    # the proof below holds one model at a time: the calibrated one is freed first
    calibrated = weakref.ref(model)
    del model
    freed = _free(calibrated)
    if device == "cuda":
        torch.cuda.empty_cache()
    if not freed:
        console.print("[yellow]note:[/] the calibrated model is still referenced after export: the export proof "
                      "holds two models in memory")

    with _timed(timings, "export_check_s", peaks):
        with _timed(detail, "structure_s"), status("export proof: structure, from the safetensors"):
            structure = proof.check_structure(ckpt, fmt, kv, q.block_size)
        # the layer check (one layer at a time) reads the export while it is reloaded: their reads overlap
        with _timed(detail, "layers_and_reload_s"), status("export proof: layers; reloading the export as it is "
                                                           "served (reference dequantizer)"), \
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="proof-layers") as pool:
            pending = pool.submit(proof.check_layers, ckpt, ref, q.eval.export_weight_ratio, device)
            exported = reference.load(ckpt, dtype=dtype, device=device)
            layers = pending.result()
        with _timed(detail, "eval_s"):
            ex = _logits("deployed-checkpoint logits (held-out)", exported, rows.heldout, ebs, oom)
        del exported
        gc.collect()
    with _timed(detail, "hash_wait_s"):
        hashed()

    t_assess = time.perf_counter()
    accuracy = quality.assess(base, fq, ex, rows.heldout, structure=structure, layers=layers,
                              scales=ref.to_json()["scales"], thresholds=to_plain(q.thresholds), mode=q.gate.value,
                              kl_abs=q.eval.export_kl_abs, kl_frac=q.eval.export_kl_frac)
    timings["assess_s"] = time.perf_counter() - t_assess
    hf_quant = proof.quant_config(ckpt) or {}
    result = {"format": fmt, "kv_cache": kv, **{k: hf_quant.get(k) for k in (
                  "quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules")},
              "block_size": q.block_size if fmt in modelopt.AWQ_FORMATS else None,
              "modelopt_version": modelopt.version(), "device": device, "cpu_nvfp4_fallback_quantizers": fallbacks,
              "fp8_layers_rounded_as_exported": rounded, "batch_size": bs_used,
              "bytes_per_param": capacity.bytes_per_param(ckpt), "notes": list(rows.notes),
              "calibration": rows.record(timings["calibrate_s"]),
              "heldout": {"rows": len(rows.heldout), "seq_len": q.eval.seq_len},
              "accuracy": accuracy, "timings_s": {k: round(v, 3) for k, v in timings.items()}}
    if recipe:
        result["recipe"] = recipe_record  # absent for the format's preset
    # accuracy.json only (not in the stage's result record): the batch bound, per-step GPU peaks, the proof's parts
    if peaks is not None:
        peaks[PROCESS_PEAK] = max(peaks.get(PROCESS_PEAK, 0), torch.cuda.max_memory_allocated())
    gpu = {"torch_peak_bytes_by_step": peaks, "torch_peak_bytes": peaks[PROCESS_PEAK]} if peaks is not None else {}
    recorded = {**({"recipe": recipe} if recipe else {}),  # quant.recipe: which ModelOpt recipe ran
                "export_check_parts_s": {k: round(v, 3) for k, v in detail.items()},
                "calibrate_parts_s": calibrate_parts,
                "gpu_memory": {**batching, "calibration_batch_size_used": bs_used, "oom_retries": oom,
                               "calibrated_model_freed_before_proof": freed, **gpu}}
    _write_report(ctx, {**result, **recorded})
    failure = quality.failure(accuracy, fmt, kv)
    if failure:
        raise StageFailed(failure)
    return QuantizeResult.model_validate(result)


def _write_report(ctx: Context, r: dict[str, Any]) -> None:
    (ctx.out / "accuracy.json").write_text(json.dumps(r, indent=2) + "\n")
    (ctx.out / "quantize.md").write_text(quality.report(ctx.cfg.model.name, r))


def extra(cfg: DictConfig, store_dir: Path) -> dict[str, Any]:
    """The calibration text's digest and the resolved calibration (a fallback to the shipped corpus re-runs)."""
    spec = calib.spec(cfg)
    return {"calib_sha256": calib.dataset_digest(spec.dataset), "calibration": spec.to_json()}


def trtllm_mapping(cfg: DictConfig) -> tuple[str, ...]:
    """The engine runtime also gets a TRT-LLM checkpoint for the build's TP/PP mapping, so only its quantize output
    differs per mapping; the other runtimes share one."""
    return ("tp", "pp") if cfg.runtime.name.value == "trtllm_engine" else ()


STAGE = Stage(
    volatile=("accuracy.json", "quantize.md"),
    name="quantize",
    run=run,
    reads=("model.name", "model.source", "model.dtype", "model.trust_remote_code", "model.calib", "quant"),
    inputs=("fetch",),
    libs=("nvidia-modelopt", "torch", "transformers", "safetensors"),
    root="store",
    label=lambda cfg: ArtifactKey.of(cfg).checkpoint_label,
    check=check,
    env_check=env_check,
    extra=extra,
    capacity=trtllm_mapping,
)
