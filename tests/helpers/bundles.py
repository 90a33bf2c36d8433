"""A small bundle built without a model: a few files with random bytes and a ``bundle.json`` that the real schema
accepts. For the tests of publishing, verifying and signing, which read bundles and never their contents."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pipeline import bundle

FILES = {"checkpoint/config.json": b'{"architectures": ["Qwen3ForCausalLM"]}\n',
         "checkpoint/model.safetensors": None,  # random bytes
         "triton_repo/ensemble/config.pbtxt": b'name: "ensemble"\nplatform: "ensemble"\n',
         "triton_repo/ensemble/1/.keep": b"",  # the version directory Triton needs (pipeline.bundle.bundle_tree)
         "reports/bench.json": b'{"gates": {"verdict": "pass"}}\n'}


def make_bundle(root: Path, *, version: str = "v0123456789ab", lineage: dict[str, str] | None = None,
                model: str = "tiny-qwen3", quant: str = "fp8", kv: str = "fp8", target: str = "cpu",
                runtime: str = "reference", size: int = 48 << 10, seed: int = 0) -> Path:
    """A complete local bundle directory under ``root``; returns it."""
    import random

    out = root / f"bundle-{version}"
    out.mkdir(parents=True)
    files = []
    for rel, data in FILES.items():
        if data is None:
            data = random.Random(seed).randbytes(size)
        p = out / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        files.append({"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                      "mtime_ns": os.stat(p).st_mtime_ns})
    detail = {"verdict": "pass", "breaches": [], "regressions": [], "regressions_gated": False,
              "compared_with_previous_levels": 0, "baseline": None}
    doc: dict[str, Any] = {
        "schema": bundle.SCHEMA, "version": version,
        "model": {"name": model, "source": "synthetic", "revision": None},
        "quant": {"format": quant, "kv_cache": kv, "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                  "group_size": None, "exclude_modules": ["lm_head"], "calibration_sha256": "0" * 64},
        "target": {"name": target, "device": "cpu", "sm": 0}, "runtime": {"name": runtime},
        "runtime_versions": {"torch": "2.13.0", "container": None}, "build": {}, "capacity": None,
        "accuracy": None, "bench": {"workloads": {}},
        "gates": {"accuracy": "pass", "export_check": "pass", "bench": "pass", "bench_detail": detail},
        "lineage": lineage or {"fetch": "f" * 64}, "provenance": {"pipeline": "0.1.0", "git_commit": None, "host": {}},
        "files": files, "dirs": bundle.store_dirs(out),
    }
    bundle.BundleManifest.model_validate(doc)
    (out / "bundle.json").write_text(json.dumps(doc, indent=2) + "\n")
    return out


def rewrite_manifest(path: Path, change) -> None:
    """Apply ``change(doc)`` to the ``bundle.json`` at ``path`` (a local file), keeping it valid JSON."""
    doc = json.loads(path.read_text())
    change(doc)
    path.chmod(0o644)
    path.write_text(json.dumps(doc, indent=2) + "\n")
