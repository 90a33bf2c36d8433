"""The serving stack's upstream interface, recorded as data read from NVIDIA's sources.

Every data file here names the upstream repository, commit and path each part was read from:

- ``containers.yaml``: serving container image <-> TensorRT-LLM / TensorRT / Triton versions;
- ``trtllm-<line>.yaml``: for one TensorRT-LLM line, the Triton model repository layouts (``inflight_batcher_llm``,
  ``llmapi``): every model's inputs and outputs (name, data type, dims, optional, reshape), the parameters the
  backend or ``model.py`` reads (required ones marked), batching and instance settings; plus the ``trtllm-build``
  flags, ``BuildConfig`` fields and LLM-API argument names of that line.

``python -m pipeline.upstream verify --checkout PATH`` compares the record with an upstream checkout's
``config.pbtxt`` files (or the installed ``tensorrt_llm``); ``refresh`` rewrites the tensor lists from the checkout.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

from pipeline.errors import UserError

DATA = Path(__file__).resolve().parent
LAYOUTS = ("inflight_batcher_llm", "llmapi")


@functools.lru_cache(maxsize=None)
def _load(name: str) -> dict[str, Any]:
    path = DATA / name
    if not path.is_file():
        raise UserError(f"no upstream record {name} in {DATA}; reinstall the package")
    return yaml.safe_load(path.read_text()) or {}


def container_pairs() -> dict[str, dict[str, str]]:
    """``{image: {"trtllm": ..., "tensorrt": ..., "triton": ...}}`` for every recorded serving container."""
    return {image: {k: str(v[k]) for k in ("trtllm", "tensorrt", "triton")}
            for image, v in _load("containers.yaml")["pairs"].items()}


def container_source(image: str) -> dict[str, str]:
    """Where the pair of ``image`` was read: ``{"repo", "path", "commit"}``."""
    doc = _load("containers.yaml")
    if image not in doc["pairs"]:
        raise UserError(f"container {image} is not in the recorded pairs ({', '.join(doc['pairs'])})")
    return {**doc["source"], "commit": str(doc["pairs"][image]["commit"])}


def container_for(trtllm_version: str) -> str:
    """The serving image upstream pairs with ``trtllm_version`` (the newest one when several do)."""
    matches = [image for image, v in container_pairs().items() if v["trtllm"] == str(trtllm_version)]
    if not matches:
        known = ", ".join(sorted({v["trtllm"] for v in container_pairs().values()}))
        raise UserError(f"no serving container recorded for TensorRT-LLM {trtllm_version} (recorded: {known}); "
                        f"set runtime.container explicitly")
    return sorted(matches, key=_tag_key)[-1]


def trtllm_for(image: str) -> str | None:
    """The TensorRT-LLM version upstream pairs with ``image``; None for an image not recorded."""
    pair = container_pairs().get(image)
    return pair["trtllm"] if pair else None


def _tag_key(image: str) -> tuple[int, ...]:
    tag = image.rsplit(":", 1)[-1].split("-", 1)[0]
    try:
        return tuple(int(p) for p in tag.split("."))
    except ValueError:
        return (0,)


RECORD_FILES = {"1.2.1": "trtllm-1.2.1.yaml", "main": "trtllm-main.yaml"}
DEFAULT_LINE = "1.2.1"


def lines() -> tuple[str, ...]:
    """The TensorRT-LLM lines with a recorded interface."""
    return tuple(RECORD_FILES)


def record_file(line: str) -> str:
    if line not in RECORD_FILES:
        raise UserError(f"no recorded upstream interface for TensorRT-LLM {line!r} (recorded: {', '.join(RECORD_FILES)})")
    return RECORD_FILES[line]


def record(line: str = DEFAULT_LINE) -> dict[str, Any]:
    """The whole record of one TensorRT-LLM line (``layouts``, ``reads``, ``build``, sources)."""
    return _load(record_file(line))


def line_for(trtllm_version: str | None) -> str:
    """The recorded line that describes ``trtllm_version``: 1.2.x (and earlier engine-era versions) -> "1.2.1",
    anything newer than 1.2 -> "main"; None -> the default line."""
    if not trtllm_version:
        return DEFAULT_LINE
    v = str(trtllm_version)
    if v == "main":
        return "main"
    try:
        major, minor = (int(p) for p in v.split(".")[:2])
    except ValueError:
        raise UserError(f"TensorRT-LLM version {v!r} is not MAJOR.MINOR[.PATCH]") from None
    return DEFAULT_LINE if (major, minor) <= (1, 2) else "main"


def interface(line: str = DEFAULT_LINE, layout: str = "inflight_batcher_llm") -> dict[str, dict[str, Any]]:
    """``{model: {inputs, outputs, parameters, max_batch_size, decoupled, instance_group, ..., source}}`` of one layout
    as upstream ships it for ``line``."""
    layouts = record(line)["layouts"]
    if layout not in layouts:
        raise UserError(f"TensorRT-LLM {line} has no {layout} layout upstream (it has: {', '.join(layouts)})")
    return layouts[layout]


def reads(line: str = DEFAULT_LINE, layout: str = "inflight_batcher_llm") -> dict[str, dict[str, Any]]:
    """``{model: {required: [...], optional: [...], source}}``: the parameters each backend / model.py reads."""
    return (record(line).get("reads") or {}).get(layout, {})


def tensor_names(line: str, layout: str, model: str, kind: str = "inputs") -> list[str]:
    seen: list[str] = []
    for t in interface(line, layout)[model][kind]:
        if t["name"] not in seen:
            seen.append(t["name"])
    return seen
