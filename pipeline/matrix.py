"""The shipped build matrices (``conf/matrix/NAME.yaml``) and how a config differs from its entry."""
from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from pipeline.config import CONF_DIR, compose_many, conf_dir, to_plain
from pipeline.errors import UserError

AXES = (("models", "model"), ("quants", "quant"), ("targets", "target"), ("runtimes", "runtime"))


def load_matrix(name: str) -> dict[str, Any]:
    path = conf_dir() / "matrix" / f"{name}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in (CONF_DIR / "matrix").glob("*.yaml")))
        raise UserError(f"unknown matrix '{name}'; choose one of: {names}")
    doc = OmegaConf.to_container(OmegaConf.load(path)) or {}
    unknown = set(doc) - {a for a, _ in AXES} - {"overrides"}
    if unknown:
        raise UserError(f"conf/matrix/{name}.yaml: unknown key(s) {', '.join(sorted(unknown))}; use models, quants, "
                        f"targets, runtimes, overrides")
    return doc


def differences(cfg, settings: dict[str, Any]) -> tuple[str | None, list[str]]:
    """The shipped matrix entry of ``cfg``'s model x quant x target x runtime and how ``settings`` (the build's
    stage settings, flat: :func:`pipeline.bundle.recipe_settings` of its bundle) differ from the entry's values of
    the same keys (``key: entry -> this``), nearest entry first. (None, []) when no matrix holds the combination (a
    model of one's own: nothing to differ from); (name, []) when the build is the entry."""
    from pipeline.bundle import flatten
    from pipeline.identity import ArtifactKey

    key = ArtifactKey.of(cfg)
    jobs, names = [], []
    for path in sorted((conf_dir() / "matrix").glob("*.yaml")):
        doc = load_matrix(path.stem)
        if key.model in doc.get("models", []) and key.target in doc.get("targets", []) \
                and key.runtime in doc.get("runtimes", []):
            for q in doc.get("quants", []):
                jobs.append([f"model={key.model}", f"quant={q}", f"target={key.target}", f"runtime={key.runtime}",
                             *(doc.get("overrides") or [])])
                names.append(path.stem)
    best: tuple[str | None, list[str]] = (None, [])
    for name, entry in zip(names, compose_many(jobs)):
        if isinstance(entry, UserError) or ArtifactKey.of(entry) != key:
            continue
        theirs = flatten(to_plain(entry))
        diffs = [f"{k}: {theirs.get(k)!r} -> {v!r}" for k, v in sorted(settings.items()) if theirs.get(k) != v]
        if not diffs:
            return name, []
        if best[0] is None or len(diffs) < len(best[1]):
            best = (name, diffs)
    return best
