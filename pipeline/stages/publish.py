"""publish: an immutable, checksummed bundle for ops: checkpoint, Triton repository, every manifest and report.

Layout::

    bundle.json            what it is (model, quant, target, runtime, fingerprints, results) + every file's sha256
    checkpoint/            the exported (quantized) unified HF checkpoint
    triton_repo/           the model repository, ready for tritonserver --model-repository
    reports/               quantize.md, accuracy.json, build.json, bench.md, bench.json, bench.png
    manifests/<stage>.json the manifest of every stage that produced it
"""
from __future__ import annotations

import json
import os
import stat
from typing import Any

from pipeline import __version__, store
from pipeline.config import to_plain
from pipeline.runner import Context, Stage, host_info

REPORTS = {"quantize": ("quantize.md", "accuracy.json"), "build": ("build.json",), "bench": ("bench.md", "bench.json", "bench.png")}


def _git_commit() -> str | None:
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(ctx: Context) -> dict[str, Any]:
    cfg, out = ctx.cfg, ctx.out
    known: dict[str, str] = {}

    def take(stage: str, sub: str, dest: str) -> None:
        files = {f["path"]: f["sha256"] for f in ctx.manifests[stage].get("files", [])}
        src = ctx.inputs[stage] / sub if sub else ctx.inputs[stage]
        for p in sorted(src.rglob("*")):
            if p.is_file() and not (p.name == store.MANIFEST and p.parent == ctx.inputs[stage]):
                rel_src = p.relative_to(ctx.inputs[stage]).as_posix()
                rel_dst = f"{dest}/{p.relative_to(src).as_posix()}"
                store.link_or_copy(p, out / rel_dst, link=cfg.publish.link)
                if rel_src in files:
                    known[rel_dst] = files[rel_src]

    take("quantize", "checkpoint", "checkpoint")
    take("package", "", "triton_repo")
    for stage, names in REPORTS.items():
        for name in names:
            if (ctx.inputs[stage] / name).is_file():
                store.link_or_copy(ctx.inputs[stage] / name, out / "reports" / name, link=cfg.publish.link)
    (out / "manifests").mkdir()
    lineage = {}
    for stage, manifest in ctx.manifests.items():
        (out / "manifests" / f"{stage}.json").write_text(json.dumps(manifest, indent=2) + "\n")
        lineage[stage] = manifest["fingerprint"]
    ctx.known_hashes.update(known)

    files = store.list_files(out, known)
    quant = ctx.manifests["quantize"]
    bench = ctx.manifests["bench"].get("result", {})
    bundle = {
        "schema": "llm-pipeline/bundle/v1",
        "model": {"name": cfg.model.name, "source": cfg.model.source,
                  "revision": (ctx.manifests["fetch"].get("result") or {}).get("resolved_sha")},
        "quant": {k: (quant.get("result") or {}).get(k) for k in
                  ("format", "kv_cache", "quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules")}
                 | {"calibration_sha256": ((quant.get("result") or {}).get("calibration") or {}).get("sha256")},
        "target": to_plain(cfg.target),
        "runtime": to_plain(cfg.runtime),
        "build": to_plain(cfg.build),
        "accuracy": (quant.get("result") or {}).get("accuracy"),
        "bench": bench,
        "lineage": lineage,
        "provenance": {"pipeline": __version__, "git_commit": _git_commit(), "host": host_info()},
        "files": files,
    }
    (out / "bundle.json").write_text(json.dumps(bundle, indent=2, default=str) + "\n")
    for p in out.rglob("*"):  # published files are read-only
        if p.is_file():
            os.chmod(p, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    return {"files": len(files), "bytes": sum(f["size"] for f in files)}


STAGE = Stage(
    name="publish",
    run=run,
    reads=("publish", "model.name", "model.source"),
    inputs=("fetch", "quantize", "build", "package", "bench"),
    libs=(),
    code=(),
    root="bundles",
    label=lambda cfg: f"{cfg.model.name}.{cfg.quant.format.value}-kv{cfg.quant.kv_cache.value}"
                      f".{cfg.target.name}.{cfg.runtime.name.value}",
)
