"""What one artifact is: model, quantization, KV-cache format, target and runtime.

Its two spellings name things on disk: the label ``<model>.<quant>-kv<kv>.<target>.<runtime>`` (per-target stage
outputs, build reports) and the publish prefix ``<model>/<quant>-kv<kv>/<target>/<runtime>`` (where a bundle's
versions live under ``publish.dest``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


def _text(value: Any) -> str:
    """A config value as text: enum members (typed configs) give their ``.value``."""
    return str(getattr(value, "value", value))


@dataclass(frozen=True)
class ArtifactKey:
    model: str
    quant: str
    kv: str
    target: str
    runtime: str

    @classmethod
    def of(cls, cfg: Any) -> "ArtifactKey":
        """From a config (or a stage's view of one): reads model.name, quant.format, quant.kv_cache, target.name
        and runtime.name, nothing else."""
        return cls(model=_text(cfg.model.name), quant=_text(cfg.quant.format), kv=_text(cfg.quant.kv_cache),
                   target=_text(cfg.target.name), runtime=_text(cfg.runtime.name))

    @classmethod
    def of_manifest(cls, doc: Mapping[str, Any]) -> "ArtifactKey":
        """From a bundle's ``bundle.json`` (``model.name``, ``quant.format``/``kv_cache``, ``target.name``,
        ``runtime.name``)."""
        return cls(model=doc["model"]["name"], quant=doc["quant"]["format"], kv=doc["quant"]["kv_cache"],
                   target=doc["target"]["name"], runtime=doc["runtime"]["name"])

    @classmethod
    def of_report(cls, summary: Mapping[str, Any]) -> "ArtifactKey":
        """From a build report (``reports/<label>.json``: top-level model, quant, kv_cache, target, runtime)."""
        return cls(model=summary["model"], quant=summary["quant"], kv=summary["kv_cache"], target=summary["target"],
                   runtime=summary["runtime"])

    @property
    def checkpoint_label(self) -> str:
        """``<model>.<quant>-kv<kv>``: the quantized checkpoint, shared by every target and runtime."""
        return f"{self.model}.{self.quant}-kv{self.kv}"

    @property
    def label(self) -> str:
        """``<model>.<quant>-kv<kv>.<target>.<runtime>``: per-target stage outputs and the build report."""
        return f"{self.checkpoint_label}.{self.target}.{self.runtime}"

    @property
    def publish_prefix(self) -> str:
        """``<model>/<quant>-kv<kv>/<target>/<runtime>``: the entry's directory under ``publish.dest``."""
        return f"{self.model}/{self.quant}-kv{self.kv}/{self.target}/{self.runtime}"
