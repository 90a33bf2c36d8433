"""``render DIR [overrides]``: the files a bundle of this config will carry, written without a GPU or TensorRT-LLM.

For any target and runtime, from the same serving plan and renderers the build and package stages use (nothing is
re-implemented here):

- ``triton_repo/``: the Triton model repository as the package stage writes it (every ``config.pbtxt``, the python
  models, ``llmapi``'s ``tensorrt_llm/1/model.yaml``), linted as the package stage lints it, less the build output
  (``tensorrt_llm/1/engine``: the engine or checkpoint and the tokenizer, which only the build makes) and what the
  package stage derives from it (``inflight_batcher_llm``'s ``xgrammar_tokenizer_info.json``);
- ``llmapi.json`` (``runtime=trtllm_llmapi``): the ``LLM(...)`` options the build writes beside the checkpoint;
- ``trtllm-build.sh`` (``runtime=trtllm_engine``): the ``trtllm-build`` command the build runs, with the checkpoint
  and engine directories as ``$CHECKPOINT_DIR`` / ``$ENGINE_DIR`` (the build's own timing-cache flags are left out);
- ``serving_plan.json``: the serving plan (settings and where each came from, the profile, the predictions).

The directory is written beside and renamed into place when complete; an existing one is refused.
"""
from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from pipeline.cli.common import add_overrides, subcommand
from pipeline.errors import UserError


def register(sub) -> None:
    p = subcommand(sub, "render", help="write the configs a bundle of this config will carry, without a GPU",
                   description="Write into DIR the files the package stage would put in the bundle (every "
                               "config.pbtxt, the LLM-API model.yaml, the python models), the build's trtllm-build "
                               "command or LLM-API options, and the serving plan, for any target and runtime, "
                               "without a GPU or TensorRT-LLM. The repository is linted as the package stage lints "
                               "it. Nothing is built; the engine directory is left out.")
    p.add_argument("dest", metavar="DIR", help="a directory that does not exist yet")
    add_overrides(p)
    p.set_defaults(func=lambda a: cmd_render(Path(a.dest), a.args))


def cmd_render(dest: Path, overrides: list[str]) -> int:
    from pipeline import hardware

    render(hardware.compose(overrides, say=True), dest)
    return 0


def render(cfg, dest: Path) -> dict[str, Path]:
    """Write the files (module docstring) into ``dest``; returns them by name."""
    from pipeline import overlays, serving_plan
    from pipeline.config import to_plain
    from pipeline.formats import FORMATS, KV_FORMATS
    from pipeline.runner import executor
    from pipeline.runtime import trtllm
    from pipeline.stages import STAGES
    from pipeline.triton import lint
    from pipeline.triton.repository import layout, render_repository
    from pipeline.ui import out

    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserError(f"render: {dest} exists; give a new directory (nothing was written)")
    plan = executor.preflight(cfg, STAGES, environment=False)  # what plan checks and resolves, nothing more
    capacity = plan.capacity
    runtime = cfg.runtime.name.value
    build = serving_plan.build_settings(to_plain(cfg.build), capacity.settings)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with overlays.replacing(dest) as tmp:
        repo = tmp / "triton_repo"
        repo.mkdir()
        render_repository(cfg, repo, capacity, engine_cfg={})
        findings = lint.lint(repo, trtllm_version=cfg.runtime.trtllm_version, repo_mount=cfg.serve.repo_mount,
                             layout=layout(cfg), engine=False)
        if findings:
            raise UserError(f"render: the repository fails lint: {findings[0]}"
                            + (f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""))
        if runtime == "trtllm_llmapi":
            options = trtllm.llmapi_options(build, cfg.quant.kv_cache.value, capacity.tp, capacity.pp,
                                            chunked_prefill=cfg.serve.enable_chunked_context)
            (tmp / "llmapi.json").write_text(json.dumps(options, indent=2) + "\n")
        elif runtime == "trtllm_engine":
            args = trtllm.trtllm_build_args(build, FORMATS[cfg.quant.format.value].quant_algo,
                                            KV_FORMATS[cfg.quant.kv_cache.value].quant_algo, "$CHECKPOINT_DIR",
                                            "$ENGINE_DIR", None)
            line = " ".join(f'"{a}"' if a.startswith("$") else shlex.quote(a) for a in args)
            (tmp / "trtllm-build.sh").write_text(
                "#!/bin/sh\n# The build stage's trtllm-build for this config (TensorRT-LLM "
                f"{cfg.runtime.trtllm_version or 'as runtime.trtllm_version names'}): CHECKPOINT_DIR holds the "
                "quantize stage's TRT-LLM checkpoint, ENGINE_DIR receives the engine\nset -eu\n" + line + "\n")
        record = serving_plan.with_predictions(cfg, capacity).record()
        (tmp / "serving_plan.json").write_text(json.dumps(
            {"tp": capacity.tp, "pp": capacity.pp, "settings": capacity.settings, "sources": capacity.sources,
             **{k: v for k, v in record.items() if k != "settings"}}, indent=2, default=str) + "\n")
    written = {p.relative_to(dest).as_posix(): p for p in sorted(dest.rglob("*")) if p.is_file()}
    out.print(f"rendered {cfg.model.name} {cfg.quant.format.value} (KV {cfg.quant.kv_cache.value}) on "
              f"{cfg.target.name} / {runtime} into {dest}: {len(written)} files, lint passes (the engine directory "
              f"is the build's)", markup=False, soft_wrap=True)
    for rel in written:
        if rel.endswith(("config.pbtxt", "model.yaml")) or "/" not in rel:
            out.print(f"  {rel}", markup=False)
    return written
