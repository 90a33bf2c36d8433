"""publish: an immutable, checksummed bundle for ops: checkpoint, Triton repository, every manifest and report.

The bundle is assembled here (``paths.bundles``); after every build it is uploaded to ``publish.dest`` (any fsspec URL) under
``<model>/<quant>-kv<kv>/<target>/<runtime>/<version>/``; ``latest`` moves only when every gate passed
(accuracy, export check, bench). Republishing a version that exists uploads only its files found missing or
damaged (checked against its ``bundle.json``).

Layout::

    bundle.json            what it is (model, quant, target, runtime, fingerprints, results) + every file's sha256
    checkpoint/            the exported (quantized) unified HF checkpoint
    triton_repo/           the model repository, ready for tritonserver --model-repository
    reports/               quantize.md, accuracy.json, build.json, bench.md, bench.json, bench.png,
                           requests.jsonl, aiperf/<workload>/concurrency_<N>/ (aiperf's export)
    manifests/<stage>.json the manifest of every stage that produced it
    bundle.sig             with publish.sign: an OpenSSF model_signing signature over bundle.json

``gates.bench`` is the bench stage's own verdict (``pass``, or ``no-baseline`` when the regression baseline could not
be read), with its breaches and reported regressions in ``gates.bench_detail``; publish fails when bench.json lacks
them rather than assume a pass.
"""
from __future__ import annotations

import json
from typing import Any

from pipeline import __version__, store
from pipeline.bundle import SCHEMA, BundleManifest
from pipeline.bundle import publish as publish_bundle
from pipeline.bundle import sign as sign_bundle
from pipeline.bundle import sign_problems
from pipeline.ui import status
from pipeline.config import to_plain
from pipeline.runner import Context, Stage, artifact_label, host_info

REPORTS = {"quantize": ("quantize.md", "accuracy.json"), "build": ("build.json",),
           "bench": ("bench.md", "bench.json", "requests.jsonl", "bench.png")}


def _git_commit() -> str | None:
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


BENCH_VERDICTS = ("pass", "fail", "no-baseline")


def bench_verdict(path) -> dict[str, Any]:
    """The bench gate as the bench stage recorded it in ``bench.json``: its verdict, breaches and the regressions it
    reported (gated or only reported). A missing or unknown field fails the stage: the bundle never claims a verdict
    that bench did not give."""
    from pipeline.errors import StageFailed

    try:
        g = json.loads(path.read_text()).get("gates")
    except (OSError, json.JSONDecodeError) as exc:
        raise StageFailed(f"{path}: cannot read the bench gate ({exc}); re-run bench (force=[bench])") from exc
    if not isinstance(g, dict) or g.get("verdict") not in BENCH_VERDICTS:
        got = g.get("verdict") if isinstance(g, dict) else None
        raise StageFailed(f"{path}: no bench gate verdict (gates.verdict={got!r}, expected one of "
                          f"{', '.join(BENCH_VERDICTS)}); re-run bench (force=[bench])")
    for key in ("breaches", "regressions"):
        if not isinstance(g.get(key), list):
            raise StageFailed(f"{path}: gates.{key} is missing; re-run bench (force=[bench])")
    return {"verdict": g["verdict"], "breaches": [str(x) for x in g["breaches"]],
            "regressions": [str(x) for x in g["regressions"]],
            "regressions_gated": bool(g.get("regressions_gated", True)),
            "compared_with_previous_levels": int(g.get("compared_with_previous_levels") or 0),
            "baseline": g.get("baseline")}


def gates_passed(gates: dict[str, Any]) -> bool:
    """Whether ``latest`` may move: every gate verdict passed or does not apply (``no-baseline`` does not pass)."""
    return all(gates.get(k) in ("pass", "n/a") for k in GATE_KEYS)


GATE_KEYS = ("accuracy", "export_check", "bench")


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
    if (ctx.inputs["bench"] / "aiperf").is_dir():  # aiperf's own export of every level, for ops' aiperf tooling
        take("bench", "aiperf", "reports/aiperf")
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
    q = ctx.manifests["quantize"].get("result") or {}
    bench = ctx.manifests["bench"].get("result", {})
    build = json.loads((ctx.inputs["build"] / "build.json").read_text())
    versions = {k: v for k, v in (build.get("versions") or {}).items()
                if k in ("tensorrt_llm", "tensorrt", "cuda", "driver", "torch", "transformers")}
    acc = q.get("accuracy") or {}
    bench_gate = bench_verdict(ctx.inputs["bench"] / "bench.json")
    gates = {"accuracy": acc.get("gate", "n/a"), "export_check": acc.get("export_check", "n/a"),
             "bench": bench_gate["verdict"], "bench_detail": bench_gate}
    manifest = BundleManifest.model_validate({
        "schema": SCHEMA, "version": f"v{ctx.fingerprint[:12]}",
        "model": {"name": cfg.model.name, "source": cfg.model.source,
                  "revision": (ctx.manifests["fetch"].get("result") or {}).get("resolved_sha")},
        "quant": {**{k: q.get(k) for k in ("format", "kv_cache", "quant_algo", "kv_cache_quant_algo", "group_size",
                                           "exclude_modules")},
                  "format": cfg.quant.format.value, "kv_cache": cfg.quant.kv_cache.value,
                  "calibration_sha256": (q.get("calibration") or {}).get("sha256")},
        "target": to_plain(cfg.target), "runtime": to_plain(cfg.runtime),
        "runtime_versions": {**versions, "container": cfg.runtime.container if cfg.runtime.name.value != "reference"
                             else None},
        "build": to_plain(cfg.build), "capacity": build.get("capacity"), "accuracy": acc or None, "bench": bench,
        "gates": gates, "lineage": lineage,
        "provenance": {"pipeline": __version__, "git_commit": _git_commit(), "host": host_info()},
        "files": files,
    })
    (out / "bundle.json").write_text(manifest.model_dump_json(indent=2, by_alias=True) + "\n")
    signature = sign_bundle(out, cfg.publish.sign)  # bundle.sig over bundle.json (publish.sign.method != none)
    return {"signed": signature is not None, "files": len(files), "bytes": sum(f["size"] for f in files), "version": manifest.version,
            "gates": gates}


def upload(local, dest: str, *, lock_dir=None) -> dict[str, Any]:
    """Upload an assembled bundle to ``publish.dest`` (after every build: a complete version already there is
    checked, and only its missing or damaged files are uploaded). ``latest`` moves only when every gate passed. Not part of the cached stage: the destination is no property of
    the bundle, and its version must not depend on it."""
    doc = json.loads((local / "bundle.json").read_text())
    passed = gates_passed(doc["gates"])
    with status(f"publishing {doc['version']} to {dest}"):
        return {**publish_bundle(local, dest, move_latest=passed, lock_dir=lock_dir), "gates_passed": passed}


STAGE = Stage(
    read_only=True,  # published files are read-only
    name="publish",
    run=run,
    check=lambda cfg: sign_problems(cfg.publish.sign, environment=False),
    env_check=lambda cfg: sign_problems(cfg.publish.sign, environment=True),
    reads=("publish.link", "publish.sign", "model.name", "model.source", "target", "runtime", "build",
           "quant.format", "quant.kv_cache"),
    inputs=("fetch", "quantize", "build", "package", "bench"),
    code=("pipeline.bundle",),
    libs=("fsspec", "pydantic"),
    root="bundles",
    label=artifact_label,
)
