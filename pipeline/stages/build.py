"""build: turn the quantized checkpoint into what a runtime on one target serves, and check it.

- ``reference`` (PyTorch, runs anywhere): ``engine/`` holds the exported checkpoint (hard-linked); checked by
  loading it through the reference dequantizer and generating a few tokens.
- ``trtllm_engine``: ``trtllm-build`` on the TRT-LLM checkpoint in a child process, reusing a timing cache per
  (SM, TensorRT version): each build reads and writes its own copy, which replaces the shared file atomically when
  the build succeeds (concurrent builds never read a half-written cache; the last one to finish wins);
  ``engine/`` holds ``config.json`` + ``rank{N}.engine`` and the tokenizer; checked by loading the engine and
  generating.
- ``trtllm_llmapi``: ``engine/`` holds the unified checkpoint and ``llmapi.json`` (the ``LLM(...)`` options);
  checked by loading it with the PyTorch backend and generating.

Every build writes ``build.json``: runtime, target SM and GPU, TRT-LLM/TensorRT/CUDA/driver versions, the build
settings and the capacity plan.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from pipeline import planning, serving_plan
from pipeline.config import to_plain
from pipeline.errors import StageFailed, UserError
from pipeline.identity import ArtifactKey
from pipeline.results import BuildRecord
from pipeline.runner.contract import Context, Stage, lib_versions
from pipeline.ui import status
from pipeline.tokenizer_files import is_tokenizer_file


def run(ctx: Context) -> BuildRecord:
    if ctx.cfg.runtime.name.value != "reference":
        return run_trtllm(ctx)
    import torch
    from transformers import AutoTokenizer

    from pipeline.runtime import reference, trtllm

    engine = ctx.link_input("quantize", "checkpoint", "engine")

    rt = ctx.cfg.runtime
    device = "cuda" if ctx.cfg.target.device.value == "cuda" else "cpu"
    dtype = reference.compute_dtype(rt.dtype.value, device)
    t0 = time.perf_counter()
    with status(f"loading the engine through the reference runtime on {device}"):
        model = reference.load(engine, dtype=dtype, device=device)
        tok = AutoTokenizer.from_pretrained(engine)
    load_s = time.perf_counter() - t0
    ids = tok(rt.check_prompt, add_special_tokens=False)["input_ids"]
    t0 = time.perf_counter()
    out = list(reference.generate(model, ids, rt.check_tokens))
    gen_s = time.perf_counter() - t0
    text = tok.decode(out, skip_special_tokens=True)
    check_result = {"prompt": rt.check_prompt, "completion": text, "tokens": len(out),
                    "requested_tokens": rt.check_tokens}
    problems = trtllm.generation_problems(check_result, rt.check_tokens)
    if problems:
        raise StageFailed(f"reference runtime load-and-generate check on {device}: " + "; ".join(problems))

    record = {
        "runtime": rt.name.value,
        "target": ctx.cfg.target.name,
        "sm": ctx.cfg.target.sm,
        "device": device,
        "gpu_name": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "dtype": str(dtype).removeprefix("torch."),  # runtime.dtype as it resolved here (auto: by the device)
        "quant": reference.read_quant_config(engine),
        "build_settings": serving_plan.build_settings(to_plain(ctx.cfg.build), ctx.capacity.settings),
        "capacity": ctx.capacity.summary,
        "versions": lib_versions(("torch", "transformers", "safetensors")),
        "check": {**check_result, "pass": True,
                  "load_s": round(load_s, 3), "tokens_per_s": round(len(out) / max(gen_s, 1e-9), 2)},
    }
    (ctx.out / "build.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return BuildRecord(engine_dir="engine", check=record["check"], versions=record["versions"],
                       capacity=record["capacity"])


def run_trtllm(ctx: Context) -> BuildRecord:
    """Build or prepare for a TRT-LLM runtime in a child process, then record what was built where."""
    import subprocess
    import sys
    import tempfile

    from pipeline.runtime import trtllm

    cfg, rt = ctx.cfg, ctx.cfg.runtime.name.value
    info = trtllm.require(rt, cfg.runtime.trtllm_version)
    q = ctx.result("quantize")
    build = serving_plan.build_settings(to_plain(cfg.build), ctx.capacity.settings)
    tp, pp = ctx.capacity.tp, ctx.capacity.pp
    engine = ctx.out / "engine"
    engine.mkdir()
    spec: dict[str, Any] = {"prompt": cfg.runtime.check_prompt, "check_tokens": cfg.runtime.check_tokens}
    if rt == "trtllm_engine":
        spec.update(engine_build_spec(ctx, q.quant_algo, q.kv_cache_quant_algo, info.tensorrt))
    else:
        ctx.link_input("quantize", "checkpoint", "engine")
        options = trtllm.llmapi_options(build, cfg.quant.kv_cache.value, tp, pp,
                                        chunked_prefill=cfg.serve.enable_chunked_context)
        (engine / "llmapi.json").write_text(json.dumps(options, indent=2) + "\n")
        spec.update(kind="llmapi", checkpoint_dir=str(engine), options=options)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        with status(f"{rt}: building and checking on {cfg.target.name} (child process)"):
            proc = subprocess.run([sys.executable, "-m", "pipeline.runtime.trtllm_child", f.name],
                                  capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    (ctx.out / "build.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise StageFailed(f"{rt} build on {cfg.target.name} failed: {tail} (full log: build.log)")
    if rt == "trtllm_engine":
        publish_timing_cache(ctx.out / TIMING_CACHE, timing_cache_path(ctx.paths["store"], int(cfg.target.sm),
                                                                       info.tensorrt))
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    problems = trtllm.generation_problems(child.get("check") or {}, int(cfg.runtime.check_tokens))
    if problems:  # the child checks too; a result that still falls short is never recorded as a pass
        raise StageFailed(f"{rt} load-and-generate check on {cfg.target.name}: " + "; ".join(problems))
    record = {"runtime": rt, "target": cfg.target.name, "sm": int(cfg.target.sm), "gpu_name":
              child["versions"].get("gpu"), "versions": {"tensorrt_llm": info.version, "tensorrt": info.tensorrt,
                                                         "cuda": child["versions"].get("cuda"),
                                                         "driver": child["versions"].get("driver")},
              "tp": tp, "pp": pp, "build_settings": build, "capacity": ctx.capacity.summary,
              "container": cfg.runtime.container,
              "check": {**child["check"], "requested_tokens": int(cfg.runtime.check_tokens), "pass": True}}
    (ctx.out / "build.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return BuildRecord(engine_dir="engine", check=child["check"], versions=record["versions"],
                       capacity=record["capacity"])


TIMING_CACHE = "timing.cache"  # this build's copy, in its temporary output directory (never part of the output)


def engine_build_spec(ctx: Context, quant_algo: str | None, kv_algo: str | None,
                      tensorrt: str | None) -> dict[str, Any]:
    """The child process's ``trtllm-build`` job. Its timing-cache flags name this build's own copy, seeded from the
    shared cache for (SM, TensorRT version); the tokenizer is linked next to the engine (Triton's tokenizer_dir)."""
    from pipeline.runtime import trtllm

    engine, ckpt = ctx.out / "engine", ctx.inputs["quantize"] / "checkpoint"
    own = ctx.out / TIMING_CACHE
    seed_timing_cache(timing_cache_path(ctx.paths["store"], int(ctx.cfg.target.sm), tensorrt), own)
    for p in ckpt.iterdir():
        if p.is_file() and is_tokenizer_file(p.name):
            ctx.link_input("quantize", f"checkpoint/{p.name}", f"engine/{p.name}")
    args = trtllm.trtllm_build_args(serving_plan.build_settings(to_plain(ctx.cfg.build), ctx.capacity.settings),
                                    quant_algo, kv_algo,
                                    str(ctx.inputs["quantize"] / "trtllm_checkpoint"), str(engine), str(own))
    return {"kind": "engine", "engine_dir": str(engine), "tokenizer_dir": str(ckpt), "trtllm_build_args": args}


def timing_cache_path(store_dir: Path, sm: int, tensorrt: str | None) -> Path:
    """The timing cache shared by every engine build for one (SM, TensorRT version)."""
    return store_dir / "timing-cache" / f"sm{sm}-trt{tensorrt or 'unknown'}.cache"


def seed_timing_cache(shared: Path, own: Path) -> None:
    """Start this build's timing cache from the shared one, if there is one. The shared file is only ever replaced
    by a rename, so the copy is of one complete version."""
    try:
        shutil.copyfile(shared, own)
    except FileNotFoundError:
        pass


def publish_timing_cache(own: Path, shared: Path) -> None:
    """Move this build's timing cache over the shared one by an atomic rename (from a copy in the shared file's
    directory, so the rename never crosses filesystems). Concurrent builds each publish a complete cache; the last
    one wins. ``own`` is removed: it is not part of the build's output."""
    if not own.is_file():  # trtllm-build writes no cache when it has nothing to record
        return
    shared.parent.mkdir(parents=True, exist_ok=True)
    tmp = shared.with_name(f".{shared.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        shutil.copyfile(own, tmp)
        os.replace(tmp, shared)
    finally:
        tmp.unlink(missing_ok=True)
    own.unlink()


def check(cfg) -> list[str]:
    from pipeline.runtime import trtllm
    from pipeline.upstream import rules

    if cfg.runtime.name.value == "trtllm_engine":
        problem = trtllm.engine_export_problem(planning.model_type(cfg))
        if problem:
            return [problem]
    problems = planning.compat_problems(cfg)
    if problems:
        return problems
    # the settings the build renders (validate and sweeps check hundreds of configs through one performance-model
    # process; the predictions are left out here); a profile that cannot meet serve.slo is this config's refusal
    try:
        plan = serving_plan.resolve(cfg, predict=False)
    except UserError as exc:
        return [str(exc)]
    return (rules.refusals(cfg, serving_plan.build_settings(to_plain(cfg.build), plan.settings))
            or serving_plan.capacity_problems(cfg, plan))


def capacity_check(cfg, plan) -> list[str]:
    """The upstream rules on the sizes this build renders: the preflight's plan itself (the one the stages get)."""
    from pipeline.upstream import rules

    return rules.refusals(cfg, serving_plan.build_settings(to_plain(cfg.build), plan.settings))


def env_check(cfg) -> list[str]:
    """This machine must have the target's GPU, and a TRT-LLM that can run the runtime."""
    from pipeline.runtime import trtllm

    problems = planning.local_sm_problems(cfg)
    if cfg.runtime.name.value != "reference":
        try:
            trtllm.require(cfg.runtime.name.value, cfg.runtime.trtllm_version)
        except UserError as exc:
            problems.append(str(exc))
    return problems


STAGE = Stage(
    volatile=("build.json", "build.log"),
    name="build",
    run=run,
    reads=("runtime", "target", "build", "quant.format", "quant.kv_cache", "serve.enable_chunked_context"),
    # TP and PP (the planner picks TP from model.shape when build.tp_size is 0) and the plan build.json records
    capacity=("tp", "pp", "summary", "settings"),
    inputs=("quantize",),
    libs=("torch", "transformers", "safetensors", "tensorrt_llm", "tensorrt"),
    check=check,
    capacity_check=capacity_check,
    env_check=env_check,
    root="engines",
    label=lambda cfg: ArtifactKey.of(cfg).label,
)
