"""Scheduled rebuilds: the build matrix, which entries are outdated, and garbage collection of stage outputs."""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.config import compose_many, resolved_paths
from pipeline.errors import UserError
from pipeline.matrix import AXES, load_matrix  # noqa: F401 - part of this module's interface


def entries(name: str, extra: list[str] | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(buildable entries, excluded entries with the reason). Each entry carries its composed config."""
    from pipeline.runner import executor
    from pipeline.stages import STAGES

    doc = load_matrix(name)
    combos = [{}]
    for key, group in AXES:
        combos = [{**c, group: v} for c in combos for v in doc.get(key, [])]
    jobs = [[f"{k}={v}" for k, v in c.items()] + list(doc.get("overrides") or []) + list(extra or [])
            for c in combos]
    keep, drop = [], []
    for combo, job, cfg in zip(combos, jobs, compose_many(jobs)):
        if isinstance(cfg, UserError):
            drop.append({**combo, "reason": str(cfg)})
            continue
        problems = executor.plan_checks(cfg, STAGES, environment=False)
        if problems:
            drop.append({**combo, "reason": problems[0]})
            continue
        sm = int(cfg.target.sm)
        machine = ["self-hosted", f"sm{sm}"] if cfg.target.device.value == "cuda" else ["self-hosted", "cpu"]
        keep.append({**combo, "runner": machine, "overrides": job, "_cfg": cfg})
    return keep, drop


def ci_matrix(keep: list[dict[str, Any]], drop: list[dict[str, Any]]) -> dict[str, Any]:
    """The GitHub Actions ``strategy.matrix``: only ``include`` (any other key would become a matrix axis). Each
    excluded entry goes to stderr as one line with its reason, for the job log and summary."""
    for e in drop:
        print(f"excluded {' '.join(f'{g}={e[g]}' for _, g in AXES if g in e)}: {e['reason']}", file=sys.stderr)
    return {"include": [{k: v for k, v in e.items() if not k.startswith("_")} for e in keep]}


def published_bundle(cfg) -> tuple[str | None, dict[str, Any] | None]:
    """(version, bundle.json) of the entry's ``latest`` published bundle, or of its newest complete version when
    none passed. A version without ``bundle.json`` (an interrupted upload) counts as absent."""
    from pipeline.bundle import read_published, store_errors

    with store_errors(f"publish.dest={cfg.publish.dest}", "reading the published bundles"):
        try:
            _, version, raw = read_published(cfg)
            return (version, json.loads(raw)) if version is not None else (None, None)
        except (FileNotFoundError, json.JSONDecodeError):
            return None, None


def entry_status(cfg) -> dict[str, Any]:
    """Whether the entry's current fingerprint has a published version: ``{"version", "published", "outdated",
    "why"}``. The version name derives from the publish stage's fingerprint, which covers every upstream
    fingerprint: a changed config, code, library version (TRT-LLM included) or input changes it."""
    from pipeline.runner import executor
    from pipeline.stages import STAGES

    planned = executor.plan(cfg, list(STAGES))
    version = f"v{planned[-1].fingerprint[:12]}"
    from pipeline.bundle import published_base, store_errors

    fs, base = published_base(cfg)
    why = _hub_changes(cfg)
    with store_errors(f"publish.dest={cfg.publish.dest}", "reading the published bundles"):
        published = fs.exists(f"{base}/{version}/bundle.json")
    if published and not why:
        return {"version": version, "published": version, "outdated": False, "why": []}
    last, doc = published_bundle(cfg)
    lineage = (doc or {}).get("lineage")
    if lineage is None:
        why.append("never published")
    else:
        changed = [p.stage.name for p in planned if lineage.get(p.stage.name) not in (None, p.fingerprint)]
        source = _source_changes(cfg, planned[0], lineage.get("fetch")) if changed[:1] == ["fetch"] else None
        if source:
            why.append(f"model.source={cfg.model.source} changed since {last}: {source}")
        elif changed:
            why.append(f"{changed[0]} changed since {last} (its config, code, library versions or inputs)")
        else:
            why.append(f"publish settings changed since {last}")
    return {"version": version, "published": last, "outdated": True, "why": why}


def outdated(keep: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Entries with no published version for their current fingerprint, with what changed since the last one."""
    out = []
    for e in keep:
        st = entry_status(e["_cfg"])
        if st["outdated"]:
            if not judged_here(e["_cfg"]):
                st["why"].append("judged here without its GPU: library versions can differ on its runner")
            out.append({**{k: v for k, v in e.items() if not k.startswith("_")}, "published": st["published"],
                        "version": st["version"], "why": st["why"]})
    return out


def judged_here(cfg) -> bool:
    """Whether this machine computes the entry's fingerprints as the entry's runner will. Library versions enter
    them (torch's CUDA build, TRT-LLM), so a GPU entry is judged only on a machine with the target's GPU; the
    scheduled workflow checks the others on their own runner (``outdated --entry``)."""
    if cfg.target.device.value != "cuda":
        return True
    from pipeline.hardware import local_gpu

    gpu = local_gpu()
    return gpu is not None and gpu["sm"] == int(cfg.target.sm)


def _source_changes(cfg, fetch, old_fp: str | None) -> str | None:
    """What changed in a local ``model.source`` since the fetch output ``old_fp``: its files, by sha256, against
    the old output's manifest in the stage store (None when that output is gone, or the source is no directory)."""
    from pipeline import store

    files = (fetch.parts.get("extra") or {}).get("files")
    if files is None or not old_fp:
        return None
    old = store.read_manifest(resolved_paths(cfg)[fetch.stage.root] / f"{fetch.stage.label(cfg)}-fetch-{old_fp[:12]}")
    if not old:
        return None
    before = {f["path"]: f["sha256"] for f in old.get("files", [])}
    diff = sorted(k for k in set(files) | set(before) if files.get(k) != before.get(k))
    return f"{', '.join(diff[:5])}{' …' if len(diff) > 5 else ''} differ from the built copy" if diff else None


def _hub_changes(cfg) -> list[str]:
    """A branch or tag on the Hub that now points elsewhere than the published bundle's commit (``hf://...@branch``
    sources; the fetch fingerprint carries the resolved commit too, so the rebuild fetches the new one)."""
    from pipeline.stages.fetch import parse_source, resolve_revision

    kind, repo, rev = parse_source(cfg.model.source)
    if kind != "hf" or (rev and len(rev) == 40):
        return []
    sha = resolve_revision(repo, rev)
    published = ((published_bundle(cfg)[1] or {}).get("model") or {}).get("revision")
    if sha == "unresolved" or published is None or sha == published:
        return []
    return [f"{repo}@{rev or 'main'} now resolves to {sha[:12]} (published from {published[:12]})"]


def gc(cfg, max_age_days: float, dry_run: bool = False) -> dict[str, Any]:
    """Remove stage outputs that no published bundle references and that are older than ``max_age_days``.

    References are the lineages of the local bundles (``paths.bundles``) and of every complete version under
    ``publish.dest``. Published bundles themselves are never touched. The temp directories of a killed build go
    too, whatever their age (:func:`pipeline.store.orphans`)."""
    paths = resolved_paths(cfg)
    referenced: set[str] = set()
    for bundle in paths["bundles"].glob("*/bundle.json"):
        try:
            referenced.update(json.loads(bundle.read_text()).get("lineage", {}).values())
        except (OSError, json.JSONDecodeError):
            continue
    referenced |= published_references(str(cfg.publish.dest))
    cutoff = time.time() - max_age_days * 86400
    removed, kept, freed = [], 0, 0
    outputs: list[tuple[Path, str, list[str]]] = []  # (manifest, fingerprint, the names of its inputs' directories)
    for root in (paths["store"], paths["engines"], paths["triton_repo"]):
        for manifest in root.glob("*/manifest.json"):
            try:
                doc = json.loads(manifest.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            outputs.append((manifest, doc.get("fingerprint"), [Path(v).name for v in (doc.get("inputs") or {}).values()]))
    # an input of a referenced output is referenced too (the task baseline behind `evaluate`, say): the closure
    by_name = {m.parent.name: (fp, ins) for m, fp, ins in outputs}
    todo = [name for name, (fp, _) in by_name.items() if fp in referenced]
    while todo:
        for dep in by_name.get(todo.pop(), (None, []))[1]:
            if dep in by_name and by_name[dep][0] not in referenced:
                referenced.add(by_name[dep][0])
                todo.append(dep)
    for manifest, fp, _ in outputs:
        out = manifest.parent
        if fp in referenced or manifest.stat().st_mtime > cutoff:
            kept += 1
            continue
        size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        if not dry_run:
            shutil.rmtree(out, ignore_errors=True)
            (out.parent / f"{out.name}.lock").unlink(missing_ok=True)
        removed.append(str(out))
        freed += size
    from pipeline import store

    for out in store.orphans([paths[k] for k in ("store", "engines", "triton_repo", "bundles")], paths["store"] / "locks"):
        size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())  # a killed build's temp directory
        if not dry_run:
            shutil.rmtree(out, ignore_errors=True)
        removed.append(str(out))
        freed += size
    return {"removed": removed, "kept": kept, "freed_bytes": freed, "dry_run": dry_run}


def published_references(dest: str) -> set[str]:
    """Every stage fingerprint named in the lineage of a complete version under ``dest``
    (``<dest>/<model>/<quant>-kv<kv>/<target>/<runtime>/<version>/bundle.json``)."""
    from pipeline.bundle import filesystem, redact

    fs, root = filesystem(dest)
    try:
        found = fs.glob(f"{root}/*/*/*/*/*/bundle.json")
    except FileNotFoundError:
        return set()
    except Exception as exc:  # an unreadable destination must not make referenced outputs look orphaned
        why = " ".join(str(exc).split())[:300]
        raise UserError(f"gc: cannot list publish.dest={redact(dest)} ({type(exc).__name__}: {why}); nothing "
                        f"removed") from exc
    out: set[str] = set()
    for path in found:
        try:
            out.update(json.loads(fs.cat_file(path)).get("lineage", {}).values())
        except (FileNotFoundError, json.JSONDecodeError):
            continue
    return out

