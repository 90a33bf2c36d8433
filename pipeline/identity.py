"""What one artifact is: model, quantization, KV-cache format, target and runtime, and the ModelOpt recipe that
quantized it (``quant.recipe``; none for a format's own preset).

Its two spellings name things on disk: the label ``<model>.<quant>-kv<kv>.<target>.<runtime>`` (per-target stage
outputs, build reports) and the publish prefix ``<model>/<quant>-kv<kv>/<target>/<runtime>`` (where a bundle's
versions live under ``publish.dest``). A recipe build adds ``.recipe-<name>`` after ``kv<kv>`` in both
(``tiny-qwen3.fp8-kvfp8_cast.recipe-fp8_default-kv_fp8_cast.cpu.reference``), so that it never shares a label,
an output or a published entry with the preset build of the same format; the prefix keeps its four levels.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

RECIPE_PREFIX = "general/ptq/"  # pipeline.quant.recipes.PREFIX: the only recipes quant.recipe takes
RECIPE_SUFFIXES = (".yaml", ".yml")


def _text(value: Any) -> str:
    """A config value as text: enum members (typed configs) give their ``.value``."""
    return str(getattr(value, "value", value))


def recipe_tag(value: Any) -> str | None:
    """``quant.recipe`` as the label spells it: the recipe's name without ``general/ptq/`` and ``.yaml``
    (``general/ptq/fp8_default-kv_fp8_cast.yaml`` -> ``fp8_default-kv_fp8_cast``), any character other than a
    letter, digit, ``_`` or ``-`` as ``_`` (filesystem- and URL-safe, no ``.`` or ``/``); None for no recipe."""
    if value is None or not str(value).strip():
        return None
    v = str(value).strip().strip("/")
    for s in RECIPE_SUFFIXES:
        if v.endswith(s):
            v = v[: -len(s)]
    v = v[len(RECIPE_PREFIX):] if v.startswith(RECIPE_PREFIX) else v
    return re.sub(r"[^A-Za-z0-9_-]", "_", v)


@dataclass(frozen=True)
class ArtifactKey:
    model: str
    quant: str
    kv: str
    target: str
    runtime: str
    recipe: str | None = None  # recipe_tag of quant.recipe

    @classmethod
    def of(cls, cfg: Any) -> "ArtifactKey":
        """From a config (or a stage's view of one): reads model.name, quant.format, quant.kv_cache, target.name,
        runtime.name and quant.recipe, nothing else. A view without quant.recipe reads as no recipe (a stage that
        names outputs by the key must declare it)."""
        return cls(model=_text(cfg.model.name), quant=_text(cfg.quant.format), kv=_text(cfg.quant.kv_cache),
                   target=_text(cfg.target.name), runtime=_text(cfg.runtime.name),
                   recipe=recipe_tag(cfg.quant.get("recipe")))

    @classmethod
    def of_manifest(cls, doc: Mapping[str, Any]) -> "ArtifactKey":
        """From a bundle's ``bundle.json`` (``model.name``, ``quant.format``/``kv_cache``/``recipe.name``,
        ``target.name``, ``runtime.name``)."""
        recipe = doc["quant"].get("recipe") or {}
        return cls(model=doc["model"]["name"], quant=doc["quant"]["format"], kv=doc["quant"]["kv_cache"],
                   target=doc["target"]["name"], runtime=doc["runtime"]["name"], recipe=recipe_tag(recipe.get("name")))

    @classmethod
    def of_report(cls, summary: Mapping[str, Any]) -> "ArtifactKey":
        """From a build report (``reports/<label>.json``: top-level model, quant, kv_cache, target, runtime; the
        recipe from a top-level ``recipe``, else the quantize stage's result in its rows)."""
        recipe = summary.get("recipe")
        if recipe is None:
            rows = [r for r in summary.get("stages") or () if r.get("stage") == "quantize"]
            recipe = ((rows[0].get("result") or {}).get("recipe") or {}).get("name") if rows else None
        return cls(model=summary["model"], quant=summary["quant"], kv=summary["kv_cache"], target=summary["target"],
                   runtime=summary["runtime"], recipe=recipe_tag(recipe))

    @property
    def quant_label(self) -> str:
        """``<quant>-kv<kv>``, with ``.recipe-<name>`` for a recipe build."""
        return f"{self.quant}-kv{self.kv}" + (f".recipe-{self.recipe}" if self.recipe else "")

    @property
    def checkpoint_label(self) -> str:
        """``<model>.<quant>-kv<kv>``: the quantized checkpoint, shared by every target and runtime."""
        return f"{self.model}.{self.quant_label}"

    @property
    def label(self) -> str:
        """``<model>.<quant>-kv<kv>.<target>.<runtime>``: per-target stage outputs and the build report."""
        return f"{self.checkpoint_label}.{self.target}.{self.runtime}"

    @property
    def publish_prefix(self) -> str:
        """``<model>/<quant>-kv<kv>/<target>/<runtime>``: the entry's directory under ``publish.dest``."""
        return f"{self.model}/{self.quant_label}/{self.target}/{self.runtime}"
