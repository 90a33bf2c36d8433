"""The Triton-layout registry: one folder per model-repository layout, found in this package's directory.

Discovery: every sub-directory of ``pipeline/triton/layouts/`` that holds an ``__init__.py`` and whose name does not
start with ``_`` or ``.`` is a layout (:func:`pipeline.catalog.layout_names`). Layouts are read in sorted
order of their folder names, so :data:`LAYOUTS`, the config's ``serve.layout`` choices (``schema.Layout``), the
entry-point choices and every message that lists layouts are the same on every machine. Adding a layout is adding one
folder; nothing outside it names it.

A layout folder ``<name>/`` holds:

- ``__init__.py``: ``LAYOUT = Layout(name="<name>", ...)`` (:class:`pipeline.triton.layouts.record.Layout`, keyword
  arguments): its templates per runtime, entry points, the text request's tensors, ``detect(model_dirs)`` (whether a
  written repository is of this layout), the runtimes ``serve.layout=auto`` picks it for, the templates that run the
  reference runtime;
- ``models/<template>/``: ``config.pbtxt.tmpl`` and the python models (``1/*.py``) of each template; the reference
  runtime's self-contained copies (``pipeline/runtime/reference.py``, ``decode_engine.py``,
  ``pipeline/triton/models/reference_common.py``) go beside the ``model.py`` of the templates ``LAYOUT.reference``
  names;
- ``placeholders.py``: ``values(cfg, engine_cfg, capacity)`` -> ``{template: {placeholder: value}}``,
  ``max_batch_size(cfg, capacity)``, and optionally ``files(cfg, repo, capacity)`` (files besides the configs, such
  as ``llmapi``'s ``model.yaml``);
- ``served.py``: ``read(repo, model_dirs)`` -> ``contract.Reading`` (the tokenizer directory, the context length,
  whether text prompts are tokenized with special tokens), for the front end;
- ``openai_codec.py``: ``Codec`` (a ``contract.Codec``), the front end's mapping of an OpenAI request onto the entry
  point's tensors and of a response onto a ``Delta`` (and token-level requests where the layout has them);

``contract.py`` is everything those two build on (``pipeline.triton.layouts.contract``): the reading, the codec base,
the request and delta types and the API error. A layout imports it and never the front end (``pipeline.serving``),
which imports the layouts (an import-linter contract in ``pyproject.toml``);
- ``interface.yaml`` for a layout that is not NVIDIA's: its models' tensors and parameters in the form of
  ``pipeline/upstream/trtllm-<line>.yaml``'s ``layouts.<name>`` (under ``models``) and ``reads.<name>`` (under
  ``reads``); ``pipeline lint`` checks a repository of it against that. NVIDIA's layouts have none: their interface
  is the upstream record of the TensorRT-LLM line.

:func:`problems` checks a folder against its record (``tests/unit/test_layouts.py`` runs it on every layout; the
package stage runs it on the one it renders, at plan time).

API::

    lay = layouts.get("llmapi")
    lay.entry_points            # ("tensorrt_llm",): models a request may go to, the default first
    lay.text_input, lay.max_tokens, lay.stream, lay.output   # tensor names of one text request and its answer
    lay.sampling                # {"temperature": "sampling_param_temperature", ...}: sampling-table row -> tensor
    lay.guide                   # ("guided_decoding_guide_type", "guided_decoding_guide"): the guided-decoding inputs
    lay.exclude_input           # optional BOOL input that leaves the prompt out of text_output
    lay.cumulative              # True: each streamed response repeats the whole text so far
    lay.input_types(model)      # {"text_input": "TYPE_STRING", ...} from its interface
    layouts.of_repository(dirs) # the layout of a written repository, by each layout's detect
"""
from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Mapping

from pipeline.errors import UserError
from pipeline import catalog
from pipeline.triton.layouts.record import ENGINE_REL, LLM_MODEL, Layout

__all__ = ["ENGINE_REL", "LLM_MODEL", "Layout", "LAYOUTS", "ENTRY_POINTS", "REFERENCE_TEMPLATES", "IFB", "LLMAPI",
           "get", "default_for", "of_repository", "entry_point_names", "problems"]

IFB, LLMAPI = "inflight_batcher_llm", "llmapi"  # NVIDIA's two layouts, by name (tests and messages name them)


def _load(name: str) -> Layout:
    mod = importlib.import_module(f"{__name__}.{name}")
    lay = getattr(mod, "LAYOUT", None)
    if not isinstance(lay, Layout):
        raise ImportError(f"{mod.__file__}: a layout folder's __init__.py defines LAYOUT = Layout(...)")
    if lay.name != name:
        raise ImportError(f"{mod.__file__}: LAYOUT.name is {lay.name!r}, its folder {name!r}")
    return dataclasses.replace(lay, folder=Path(mod.__file__).resolve().parent, package=mod.__name__)


LAYOUTS: dict[str, Layout] = {name: _load(name) for name in catalog.layout_names()}
# The templates that run the reference runtime (they get its self-contained copies beside model.py).
REFERENCE_TEMPLATES = tuple(t for lay in LAYOUTS.values() for t in lay.reference)
ENTRY_POINTS = {name: lay.entry_points for name, lay in LAYOUTS.items()}


def entry_point_names() -> tuple[str, ...]:
    """Every layout's entry points, each once, in registry order (the ``serve.openai.entry_point`` and ``bench.model``
    choices besides ``auto``)."""
    return tuple(dict.fromkeys(e for lay in LAYOUTS.values() for e in lay.entry_points))


def get(name: str) -> Layout:
    """The layout called ``name``; a :class:`UserError` naming the known ones otherwise."""
    if name not in LAYOUTS:
        raise UserError(f"unknown Triton layout '{name}' (known: {', '.join(LAYOUTS)})")
    return LAYOUTS[name]


def default_for(runtime: str) -> str:
    """The layout ``serve.layout=auto`` picks for a runtime: the one whose ``auto_for`` names it, else the first (in
    registry order) that serves it."""
    named = [name for name, lay in LAYOUTS.items() if runtime in lay.auto_for]
    if named:
        return named[0]
    return next(name for name, lay in LAYOUTS.items() if runtime in lay.models)


def of_repository(model_dirs: Mapping[str, object]) -> str:
    """The layout of a written repository from its model directories (``{model name: directory}``): the one whose
    ``detect`` says so; the ``fallback`` layout when none does. Two that both claim it is a :class:`UserError`."""
    dirs = {k: Path(v) for k, v in model_dirs.items()}
    found = [name for name, lay in LAYOUTS.items() if lay.detect(dirs)]
    if len(found) > 1:
        raise UserError(f"the repository's models ({', '.join(sorted(dirs))}) fit the layouts {', '.join(found)} "
                        f"alike; their detect functions must tell them apart")
    if found:
        return found[0]
    return next(name for name, lay in LAYOUTS.items() if lay.fallback)


def problems() -> list[str]:
    """Every layout folder checked against its record (:meth:`Layout.problems`), and the registry's own rules: one
    fallback layout, each runtime picked by ``auto`` for at most one layout."""
    out = [p for lay in LAYOUTS.values() for p in lay.problems()]
    fallbacks = [n for n, lay in LAYOUTS.items() if lay.fallback]
    if len(fallbacks) != 1:
        out.append(f"layouts: exactly one layout is the fallback of of_repository, found {fallbacks or 'none'}")
    autos: dict[str, list[str]] = {}
    for n, lay in LAYOUTS.items():
        for r in lay.auto_for:
            autos.setdefault(r, []).append(n)
    out += [f"layouts: serve.layout=auto picks {', '.join(ns)} for runtime {r}; one only" for r, ns in autos.items()
            if len(ns) > 1]
    return out
