"""The bundle's manifest (``bundle.json``): its schema (:class:`BundleManifest`, ``SCHEMA``), the files beside it
(``bundle.sig``, ``.keep``), and the bundle's tree as the publish stage writes it (run-time litter removed, every
directory kept)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from pipeline.results import Gates, RecipeRecord

SCHEMA = "llm-pipeline/bundle/v2"


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    size: int
    mtime_ns: Optional[int] = Field(None, description="modification time when listed (local integrity hint)")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class ModelInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    source: str
    revision: Optional[str] = Field(None, description="resolved commit sha for hf:// sources")


class QuantInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Optional[str]
    kv_cache: Optional[str]
    quant_algo: Optional[str]
    kv_cache_quant_algo: Optional[str]
    group_size: Optional[int]
    exclude_modules: Optional[list[str]]
    calibration_sha256: Optional[str]
    # dataset, rows, seq_len, tokens, short and short_reasons of the quantize stage's calibration
    calibration: Optional[dict[str, Any]] = None
    recipe: Optional[RecipeRecord] = Field(
        None, description="quant.recipe: the ModelOpt recipe the checkpoint was calibrated with, what its export was "
                          "derived to carry and the formats it maps to (the quantize stage's record); null: the "
                          "format's own preset")


class RuntimeVersions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tensorrt_llm: Optional[str] = None
    tensorrt: Optional[str] = None
    cuda: Optional[str] = None
    driver: Optional[str] = None
    torch: Optional[str] = None
    transformers: Optional[str] = None
    container: Optional[str] = Field(None, description="the Triton container tag the bundle is meant for")


class Provenance(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pipeline: str
    git_commit: Optional[str]
    host: dict[str, Any]


class BundleManifest(BaseModel):
    """``bundle.json``: what a bundle is, how it was made, how it did, and every file's checksum."""

    model_config = ConfigDict(extra="forbid")
    schema_: str = Field(SCHEMA, alias="schema")
    version: str
    model: ModelInfo
    quant: QuantInfo
    target: dict[str, Any] = Field(description="name, SM, GPU, memory per GPU, GPUs per node")
    runtime: dict[str, Any]
    runtime_versions: RuntimeVersions
    build: dict[str, Any]
    capacity: Optional[dict[str, Any]]
    accuracy: Optional[dict[str, Any]]
    bench: dict[str, Any]
    eval: Optional[dict[str, Any]] = Field(None, description="task accuracy vs the unquantized baseline, per task "
                                           "(the evaluate stage's result)")
    gates: Gates
    lineage: dict[str, str] = Field(description="stage -> fingerprint")
    provenance: Provenance
    files: list[FileEntry]
    recipe: Optional[dict[str, dict[str, Any]]] = Field(
        None, description="stage -> the resolved config that stage ran with (its manifest's config): the whole recipe")
    served_by: Optional[dict[str, Any]] = Field(
        None, description="the server the bench ran on: launcher, binary or image, and the name and version the "
                          "server reported (KServe v2 server metadata)")
    dirs: Optional[list[str]] = Field(None, description="every directory of the bundle (relative, sorted): the tree "
                                                        "verify checks exactly, empty version directories included")


SIGNATURE = "bundle.sig"
KEEP = ".keep"  # an empty file that keeps a directory that must exist but has no files (a model's version directory)
LITTER_DIRS = ("__pycache__",)  # written by a Python process that imported from the tree
LITTER_SUFFIXES = (".pyc", ".pyo")


def is_litter(path: Path, root: Path) -> bool:
    """Whether ``path`` (under ``root``) is run-time litter that never belongs in a bundle: a byte-code cache
    directory or file. The empty ``__pycache__`` *file* the package stage puts beside each model's python files
    (``pipeline.triton.repository.block_bytecode``: it keeps the server from writing byte code) is part of the bundle."""
    parts = path.relative_to(root).parts
    if path.name.endswith(LITTER_SUFFIXES):
        return True
    return any(p in LITTER_DIRS for p in parts[:-1]) or (path.name in LITTER_DIRS and path.is_dir())


def bundle_tree(out: Path, source: Path, rel: str) -> None:
    """Make the bundle's copy ``out/rel`` of the directory ``source`` keep its structure and nothing else: run-time
    litter (``__pycache__``, ``*.pyc``) copied with it is removed, every directory of ``source`` exists (a Triton
    model's empty version directory included: Triton refuses a model without one, "at least one version must be
    available"), and a directory left without files gets an empty ``.keep``, so that every transport keeps it
    (object stores have no directories; ``aws s3 sync`` and fsspec copies carry files only)."""
    dst = out / rel
    for p in sorted(dst.rglob("*"), reverse=True):
        if p.exists() and is_litter(p, dst):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    for d in sorted(source.rglob("*")):
        if d.is_dir() and not is_litter(d, source):
            (dst / d.relative_to(source)).mkdir(parents=True, exist_ok=True)
    for d in [dst, *sorted(dst.rglob("*"))]:
        if d.is_dir() and not any(d.iterdir()):
            (d / KEEP).write_bytes(b"")


def store_dirs(root: Path) -> list[str]:
    """Every directory under ``root``, relative and sorted (what ``bundle.json`` records as ``dirs``)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_dir() and not p.is_symlink())


def schema_json() -> str:
    return json.dumps(BundleManifest.model_json_schema(by_alias=True), indent=2) + "\n"
