"""publish: an immutable, checksummed bundle for ops: checkpoint, Triton repository, every manifest and report.

The bundle is assembled here (``paths.bundles``); after every build it is uploaded to ``publish.dest`` (any fsspec URL) under
``<model>/<quant>-kv<kv>/<target>/<runtime>/<version>/`` (``<quant>-kv<kv>.recipe-<name>`` for a ``quant.recipe`` build,
``pipeline.identity``); ``latest`` moves only when every gate passed
(accuracy, export check, bench). Republishing a version that exists uploads only its files found missing or
damaged (checked against its ``bundle.json``).

Layout::

    bundle.json            what it is (model, quant, target, runtime, fingerprints, results) + every file's sha256
    checkpoint/            the exported (quantized) unified HF checkpoint
    triton_repo/           the model repository, ready for tritonserver --model-repository: every directory of the
                           package stage's (an empty version directory holds an empty .keep, so that object stores
                           and file syncs keep it), no byte-code caches
    reports/               quantize.md, accuracy.json, build.json, bench.md, bench.json, bench.png,
                           requests.jsonl, aiperf/<workload>/concurrency_<N>/ (aiperf's export)
    manifests/<stage>.json the manifest of every stage that produced it
    bundle.sig             with publish.sign: an OpenSSF model_signing signature over bundle.json

``quant.recipe`` records the ModelOpt recipe the checkpoint was calibrated with (the quantize stage's record: its
name and calibration, the export plan derived and the formats it maps to); null for the format's own preset.
``eval`` holds the task gate per task (baseline and quantized scores, the difference and its interval, items, verdict,
lm-eval's version and the task files' digests); ``gates.eval`` its verdict (``inconclusive`` moves ``latest`` unless
``eval.strict``, which fails the evaluate stage on it). ``gates.bench`` is the bench stage's own verdict (``pass``; ``no-baseline`` when the regression baseline could not
be read or shares no concurrency level with the run; ``incomplete`` when a measure is missing), with its breaches and
reported regressions in ``gates.bench_detail``. ``gates.accuracy`` and ``gates.export_check`` are the quantize
stage's; ``n/a`` only for an unquantized bundle, ``missing`` where a quantized one has no accuracy section. Only
``pass`` (and that ``n/a``) moves ``latest``.
"""
from __future__ import annotations

import json
from typing import Any

from pipeline import __version__, serving_plan, store
from pipeline.bundle import SCHEMA, BundleManifest, bundle_tree, store_dirs
from pipeline.bundle import publish as publish_bundle
from pipeline.bundle import sign as sign_bundle
from pipeline.bundle import sign_problems
from pipeline.config import resolved_paths, to_plain
from pipeline.identity import ArtifactKey
from pipeline.results import BenchResult, PublishResult, QuantizeResult
from pipeline.runner.contract import Context, Stage, host_info
from pipeline.ui import status

REPORTS = {"quantize": ("quantize.md", "accuracy.json"), "build": ("build.json",),
           "bench": ("bench.md", "bench.json", "requests.jsonl", "bench.png"), "evaluate": ("eval.md", "eval.json")}


def _git_commit() -> str | None:
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def bench_verdict(bench: BenchResult) -> dict[str, Any]:
    """The bench gate as the bench stage gave it (its typed result's ``gates``): verdict, breaches, the regressions
    it reported (gated or only reported) and the baseline. A result without a verdict never reaches here:
    :meth:`~pipeline.runner.Context.result` refuses it."""
    return bench.gates.model_dump(mode="json")


def recipe(ctx: Context) -> dict[str, dict[str, Any]]:
    """The resolved config of every stage (what each ran with, from its manifest), this one's included; URLs lose
    any credentials embedded in them."""
    from pipeline.bundle import redact

    def clean(v):
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return redact(v) if isinstance(v, str) and "://" in v else v

    out = {stage: clean(m.get("config") or {}) for stage, m in ctx.manifests.items()}
    out["publish"] = clean(to_plain(ctx.cfg))
    return out


def _served_by(path, libraries: dict[str, Any] | None) -> dict[str, Any] | None:
    """The server the bench ran on, as bench.json records it, with the bench's library versions (the client and
    the bundled server's package); None for a bench that recorded no server."""
    try:
        server = json.loads(path.read_text()).get("server")
    except (OSError, json.JSONDecodeError):
        return None
    return {**server, "libraries": libraries or {}} if isinstance(server, dict) else None


def unquantized(quant: dict[str, Any] | None) -> bool:
    """An unquantized bundle (``quant.format=none``, ``quant.kv_cache=none``): no accuracy gate or export proof
    applies to it."""
    return bool(quant) and quant.get("format") == "none" and quant.get("kv_cache") == "none"


def gate_verdicts(quant: dict[str, Any], accuracy) -> dict[str, str]:
    """``accuracy`` and ``export_check`` of bundle.json's gates from the quantize result's accuracy section: ``n/a``
    only for an unquantized bundle; a quantized one without it is ``missing``, which does not pass."""
    if accuracy is not None:
        return {"accuracy": accuracy.gate, "export_check": accuracy.export_check}
    none = "n/a" if unquantized(quant) else "missing"
    return {"accuracy": none, "export_check": none}


def gate_outcomes(gates: dict[str, Any], quant: dict[str, Any] | None = None) -> list[tuple[str, str, bool]]:
    """Every gate of bundle.json that decides ``latest``, in order: (name, verdict, whether it lets ``latest`` move).
    Only ``pass`` passes (``no-baseline``, ``incomplete``, ``missing`` and ``warn`` do not); ``n/a`` passes only for
    the accuracy gate and export proof of an unquantized bundle (``quant``, bundle.json's); the task gate (``eval``)
    passes ``pass``, ``inconclusive`` (it reaches a bundle only without eval.strict; with it, evaluate fails) and
    ``n/a`` (no evaluate stage)."""
    allowed = {"accuracy": ("pass", "n/a"), "export_check": ("pass", "n/a")} if unquantized(quant) else {}
    allowed["eval"] = ("pass", "n/a", "inconclusive")
    out = []
    for name in GATE_NAMES:
        verdict = gates.get(name, "n/a" if name == "eval" else "missing")
        out.append((name, str(verdict), verdict in allowed.get(name, ("pass",))))
    return out


def gates_passed(gates: dict[str, Any], quant: dict[str, Any] | None = None) -> bool:
    """Whether ``latest`` may move: every gate of :func:`gate_outcomes` passed."""
    return all(ok for _, _, ok in gate_outcomes(gates, quant))


def gates_line(gates: dict[str, Any], quant: dict[str, Any] | None = None) -> str:
    """Every gate and its verdict in one line, those that keep ``latest`` where it is marked: ``accuracy warn (did not
    pass), export_check pass, bench pass, eval inconclusive``."""
    return ", ".join(f"{name} {verdict}" + ("" if ok else " (did not pass)")
                     for name, verdict, ok in gate_outcomes(gates, quant))


GATE_NAMES = ("accuracy", "export_check", "bench", "eval")  # bundle.json's gate verdicts that decide ``latest``


def quant_info(fmt: str, kv: str, q: QuantizeResult) -> dict[str, Any]:
    """bundle.json's ``quant`` (:class:`~pipeline.bundle.QuantInfo`): the config's format and KV preset, what the
    quantize stage's export carries, its calibration, and the ModelOpt recipe it ran (``quant.recipe``; None: the
    format's preset)."""
    return {"format": fmt, "kv_cache": kv, "quant_algo": q.quant_algo, "kv_cache_quant_algo": q.kv_cache_quant_algo,
            "group_size": q.group_size, "exclude_modules": q.exclude_modules,
            "calibration_sha256": q.calibration.sha256 if q.calibration else None,
            "calibration": {k: v for k, v in q.calibration.model_dump(mode="json").items()
                            if k in ("dataset", "rows", "seq_len", "tokens", "short", "short_reasons", "basis")}
            if q.calibration else None,
            "recipe": q.recipe.model_dump(mode="json") if q.recipe else None}


def run(ctx: Context) -> PublishResult:
    cfg, out = ctx.cfg, ctx.out
    ctx.link_input("quantize", "checkpoint", "checkpoint", link=cfg.publish.link)
    ctx.link_input("package", "", "triton_repo", link=cfg.publish.link)
    if (ctx.inputs["bench"] / "aiperf").is_dir():  # aiperf's own export of every level, for ops' aiperf tooling
        ctx.link_input("bench", "aiperf", "reports/aiperf", link=cfg.publish.link)
    for stage, names in REPORTS.items():
        for name in names:
            if (ctx.inputs[stage] / name).is_file():
                ctx.link_input(stage, name, f"reports/{name}", link=cfg.publish.link)
    bundle_tree(out, ctx.inputs["package"], "triton_repo")
    (out / "manifests").mkdir()
    lineage = {}
    for stage, manifest in ctx.manifests.items():
        (out / "manifests" / f"{stage}.json").write_text(json.dumps(manifest, indent=2) + "\n")
        lineage[stage] = manifest["fingerprint"]

    files = store.list_files(out, ctx.known_hashes)
    fetched, q, build, bench = (ctx.result(s) for s in ("fetch", "quantize", "build", "bench"))
    versions = {k: v for k, v in (build.versions or {}).items()
                if k in ("tensorrt_llm", "tensorrt", "cuda", "driver", "torch", "transformers")}
    acc = q.accuracy
    bench_gate = bench_verdict(bench)
    ev = ctx.result("evaluate") if "evaluate" in ctx.inputs else None
    quant = {"format": cfg.quant.format.value, "kv_cache": cfg.quant.kv_cache.value}
    gates = {**gate_verdicts(quant, acc), "bench": bench_gate["verdict"], "bench_detail": bench_gate,
             "eval": ev.verdict if ev else "n/a"}
    manifest = BundleManifest.model_validate({
        "schema": SCHEMA, "version": f"v{ctx.fingerprint[:12]}",
        "model": {"name": cfg.model.name, "source": cfg.model.source, "revision": fetched.resolved_sha},
        "quant": quant_info(cfg.quant.format.value, cfg.quant.kv_cache.value, q),
        "target": to_plain(cfg.target), "runtime": to_plain(cfg.runtime),
        "runtime_versions": {**versions, "container": cfg.runtime.container if cfg.runtime.name.value != "reference"
                             else None},
        # the settings the bundle was built and packaged with: the config's, with the serving plan's derived sizes
        "build": serving_plan.build_settings(to_plain(cfg.build), ctx.capacity.settings), "capacity": build.capacity,
        "accuracy": acc.model_dump(mode="json") if acc else None,
        "bench": bench.model_dump(mode="json"),  # bundle.json holds it as the manifest does
        "eval": ev.model_dump(mode="json") if ev else None,
        "gates": gates, "lineage": lineage,
        "provenance": {"pipeline": __version__, "git_commit": _git_commit(), "host": host_info()},
        "files": files, "dirs": store_dirs(out),
        "recipe": recipe(ctx),
        "served_by": _served_by(ctx.inputs["bench"] / "bench.json", ctx.manifests["bench"].get("versions")),
    })
    (out / "bundle.json").write_text(manifest.model_dump_json(indent=2, by_alias=True) + "\n")
    signature = sign_bundle(out, cfg.publish.sign)  # bundle.sig over bundle.json (publish.sign.method != none)
    return PublishResult(signed=signature is not None, files=len(files), bytes=sum(f["size"] for f in files),
                         version=manifest.version, gates=gates)


def upload(local, dest: str, *, lock_dir=None, config_differs: list[str] | None = None,
           move_latest: bool | None = None) -> dict[str, Any]:
    """Upload an assembled bundle to ``publish.dest`` (after every build: a complete version already there is
    checked, and only its missing or damaged files are uploaded). ``latest`` moves only when every gate passed and
    the config is its matrix entry's (``config_differs`` empty); ``move_latest=True`` moves it for an ad-hoc config
    too, ``False`` never. Not part of the cached stage: the destination is no property of the bundle, and its
    version must not depend on it."""
    doc = json.loads((local / "bundle.json").read_text())
    passed = gates_passed(doc["gates"], doc.get("quant"))
    move = passed and move_latest is not False and (move_latest is True or not config_differs)
    why = None
    if not move:
        why = (f"a gate did not pass: {gates_line(doc['gates'], doc.get('quant'))}" if not passed
               else "publish.move_latest=false" if move_latest is False else
               f"the config differs from its matrix entry ({'; '.join(config_differs[:3])}); "
               f"publish.move_latest=true moves it")
    with status(f"publishing {doc['version']} to {dest}"):
        return {**publish_bundle(local, dest, move_latest=move, lock_dir=lock_dir), "gates_passed": passed,
                "gates": gates_line(doc["gates"], doc.get("quant")), "latest_not_moved": why}


def after(cfg, out) -> dict[str, Any]:
    """After every build: upload the bundle to ``publish.dest`` (with the full config; the destination is no
    property of the bundle). ``latest`` follows :func:`pipeline.matrix.differences` (the bundle's recipe against
    its matrix entry) unless ``publish.move_latest`` says otherwise."""
    from pipeline import matrix
    from pipeline.bundle import recipe_settings

    choice = cfg.publish.get("move_latest")
    doc = json.loads((out / "bundle.json").read_text())
    differs = [] if choice is not None else matrix.differences(cfg, recipe_settings(doc))[1]
    return upload(out, str(cfg.publish.dest), lock_dir=resolved_paths(cfg)["store"] / "locks",
                  config_differs=differs, move_latest=choice)


STAGE = Stage(
    read_only=True,  # published files are read-only
    after=after,
    name="publish",
    run=run,
    check=lambda cfg: sign_problems(cfg.publish.sign, environment=False),
    env_check=lambda cfg: sign_problems(cfg.publish.sign, environment=True),
    reads=("publish.link", "publish.sign", "model.name", "model.source", "target", "runtime", "build",
           "quant.format", "quant.kv_cache"),
    inputs=("fetch", "quantize", "build", "package", "bench", "eval_baseline", "evaluate"),
    capacity=("settings",),  # bundle.json's build settings as rendered (serving_plan)
    libs=("fsspec", "pydantic"),
    root="bundles",
    label=lambda cfg: ArtifactKey.of(cfg).label,
)
