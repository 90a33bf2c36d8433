"""The serving stack's upstream interface, recorded as data read from NVIDIA's sources.

Every data file here names the upstream repository, commit and path each part was read from:

- ``containers.yaml``: serving container image <-> TensorRT-LLM / TensorRT / Triton / CUDA / torch / driver
  versions, per NGC tag, from NVIDIA's Release Compatibility Matrix;
- ``trtllm-<line>.yaml``: for one TensorRT-LLM line, the Triton model repository layouts (``inflight_batcher_llm``,
  ``llmapi``): every model's inputs and outputs (name, data type, dims, optional, reshape), the parameters the
  backend or ``model.py`` reads (required ones marked), batching and instance settings; guided decoding
  (``guided_decoding``: the Triton backend's parameters, backends, guide types and tokenizer info file, the LLM
  API's argument and ``GuidedDecodingParams`` fields); the inputs this project adds to upstream's models
  (``extensions``); plus the ``trtllm-build`` flags, ``BuildConfig`` fields and LLM-API argument names of that line.

``python -m pipeline.upstream verify --checkout PATH`` compares the record with an upstream checkout's
``config.pbtxt`` files (or the installed ``tensorrt_llm``); ``refresh`` rewrites the tensor lists from the checkout.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

from pipeline.errors import UserError
from pipeline import catalog

DATA = Path(__file__).resolve().parent
LAYOUTS = catalog.nvidia_layouts()  # the registry's layouts whose interface is recorded here (no interface.yaml of their own)


@functools.lru_cache(maxsize=None)
def _load(name: str) -> dict[str, Any]:
    path = DATA / name
    if not path.is_file():
        raise UserError(f"no upstream record {name} in {DATA}; reinstall the package")
    return yaml.safe_load(path.read_text()) or {}


FIGURES = ("trtllm", "tensorrt", "triton", "cuda", "torch", "python", "cuda_driver", "min_driver")


def container_pairs() -> dict[str, dict[str, str | None]]:
    """``{image: {"trtllm", "tensorrt", "triton", "cuda", "torch", "python", "cuda_driver", "min_driver", "tag"}}``
    for every recorded ``trtllm-python-py3`` tag (NVIDIA's Release Compatibility Matrix); a figure NVIDIA's pages do
    not give is None."""
    return {image: {k: (None if v.get(k) is None else str(v[k])) for k in ("tag", *FIGURES)}
            for image, v in _load("containers.yaml")["pairs"].items()}


def container_source(image: str) -> dict[str, str]:
    """Where each figure of ``image`` was read: ``{figure: "page / repo path @ commit"}`` (None-valued figures say
    so)."""
    doc = _load("containers.yaml")
    if image not in doc["pairs"]:
        raise UserError(f"container {image} is not in the recorded pairs ({', '.join(doc['pairs'])})")
    entry, m, t = doc["pairs"][image], doc["source"]["matrix"], doc["source"]["triton"]
    matrix = f"{m['page']} (row {entry['tag']}; {m['repo']} {m['path']} @ {m['commit'][:10]})"
    out = {k: matrix for k in ("trtllm", "tensorrt", "cuda", "torch", "python", "cuda_driver")}
    own = entry.get("sources") or {}
    tv = own.get("triton") or {}
    out["triton"] = f"{t['repo']} {t['path']} on {tv.get('ref')} @ {tv.get('commit')}"
    out["min_driver"] = (own.get("min_driver") if entry.get("min_driver") is not None
                         else "unknown: no NVIDIA page reached gives it")
    return out


def check_pair(trtllm_version: str | None, image: str, setting: str = "runtime.container") -> list[str]:
    """Problems of naming ``image`` as the container that serves TensorRT-LLM ``trtllm_version`` (empty: the pair
    exists in NVIDIA's matrix)."""
    pairs = container_pairs()
    if image not in pairs:
        return [f"{setting}={image} is not a recorded trtllm-python-py3 serving image; recorded for TensorRT-LLM "
                f"{trtllm_version}: {_for_hint(trtllm_version)}"]
    have = pairs[image]["trtllm"]
    if trtllm_version and have != str(trtllm_version):
        return [f"{setting}={image} ships TensorRT-LLM {have} (NVIDIA's compatibility matrix), not "
                f"runtime.trtllm_version={trtllm_version}; use {_for_hint(trtllm_version)}"]
    return []


def _for_hint(trtllm_version: str | None) -> str:
    try:
        return container_for(str(trtllm_version))
    except UserError:
        known = ", ".join(sorted({v["trtllm"] for v in container_pairs().values()}))
        return f"a TensorRT-LLM version with a recorded image ({known})"


def container_for(trtllm_version: str) -> str:
    """The serving image NVIDIA pairs with ``trtllm_version`` (the newest tag when several ship it)."""
    matches = [image for image, v in container_pairs().items() if v["trtllm"] == str(trtllm_version)]
    if not matches:
        known = ", ".join(sorted({v["trtllm"] for v in container_pairs().values()}))
        raise UserError(f"no serving container recorded for TensorRT-LLM {trtllm_version} (recorded: {known}); "
                        f"set runtime.container explicitly")
    return sorted(matches, key=_tag_key)[-1]


def trtllm_for(image: str) -> str | None:
    """The TensorRT-LLM version NVIDIA's matrix pairs with ``image``; None for an image not recorded."""
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


def interface(line: str = DEFAULT_LINE, layout: str = "inflight_batcher_llm",
              extended: bool = True) -> dict[str, dict[str, Any]]:
    """``{model: {inputs, outputs, parameters, max_batch_size, decoupled, instance_group, ..., source}}`` of one layout
    as upstream ships it for ``line``; with ``extended``, plus the inputs this project adds (the record's
    ``extensions``: the llmapi model's guide inputs), each marked ``extension: true``."""
    layouts = record(line)["layouts"]
    if layout not in layouts:
        raise UserError(f"TensorRT-LLM {line} has no {layout} layout upstream (it has: {', '.join(layouts)})")
    models = layouts[layout]
    added = (record(line).get("extensions") or {}).get(layout) or {} if extended else {}
    if not added:
        return models
    out = dict(models)
    for model, extra in added.items():
        base = dict(out[model])
        base["inputs"] = [*base.get("inputs", []), *({**t, "extension": True} for t in extra.get("inputs", []))]
        out[model] = base
    return out


def guided_decoding(line: str = DEFAULT_LINE) -> dict[str, Any]:
    """The record's ``guided_decoding``: the Triton backend's parameters, backends, guide inputs and types and the
    tokenizer info file (``triton_backend``, on lines with the C++ backend) and the LLM API's argument, backends and
    ``GuidedDecodingParams`` fields (``llm_api``), each with the sources it was read from."""
    return record(line).get("guided_decoding") or {}


def reads(line: str = DEFAULT_LINE, layout: str = "inflight_batcher_llm") -> dict[str, dict[str, Any]]:
    """``{model: {required: [...], optional: [...], source}}``: the parameters each backend / model.py reads."""
    return (record(line).get("reads") or {}).get(layout, {})


def tensor_names(line: str, layout: str, model: str, kind: str = "inputs") -> list[str]:
    seen: list[str] = []
    for t in interface(line, layout)[model][kind]:
        if t["name"] not in seen:
            seen.append(t["name"])
    return seen


def runtime_support() -> dict[str, Any]:
    """``runtimes.yaml``: which TensorRT-LLM releases carry the LLM API's PyTorch backend (``llm_api_pytorch``) and
    the TensorRT-engine backend (``tensorrt_engine``), with the modules that show each in an installed package and
    the pages each fact was read from."""
    return _load("runtimes.yaml")


def _major_minor(version: str) -> tuple[int, int] | None:
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(str(version))
    except InvalidVersion:
        return None
    return (v.major, v.minor)


def _line(text: str) -> tuple[int, int]:
    major, minor = (int(p) for p in str(text).split(".")[:2])
    return (major, minor)


def engine_backend_in(version: str) -> bool:
    """Whether TensorRT-LLM ``version`` is a release line the record gives the TensorRT-engine backend: up to
    ``tensorrt_engine.last_line`` (1.3 pre-releases, later lines and ``main`` are not)."""
    mm = _major_minor(version)
    return mm is not None and mm <= _line(runtime_support()["tensorrt_engine"]["last_line"])


def llm_api_default_in(version: str) -> bool:
    """Whether ``tensorrt_llm.LLM`` of TensorRT-LLM ``version`` is the PyTorch backend (``llm_api_pytorch.
    default_from`` or later; ``main`` is)."""
    if str(version) == "main":
        return True
    mm = _major_minor(version)
    return mm is not None and mm >= _line(runtime_support()["llm_api_pytorch"]["default_from"])


def llm_api_serves(version: str) -> bool:
    """Whether the LLM API of TensorRT-LLM ``version`` takes the options this project writes
    (``llm_api_pytorch.serves_from`` or later)."""
    if str(version) == "main":
        return True
    mm = _major_minor(version)
    return mm is not None and mm >= _line(runtime_support()["llm_api_pytorch"]["serves_from"])


def runtime_by_record(version: str) -> str | None:
    """The TensorRT-LLM runtime the record gives TensorRT-LLM ``version``: ``trtllm_llmapi`` where its
    ``tensorrt_llm.LLM`` is the PyTorch backend, else ``trtllm_engine`` where it has engines, else None."""
    if llm_api_default_in(version):
        return "trtllm_llmapi"
    return "trtllm_engine" if engine_backend_in(version) else None
