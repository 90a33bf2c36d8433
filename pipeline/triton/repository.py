"""A Triton model repository of the config's layout, written from the layout folder (``pipeline/triton/layouts/<name>/``)
around a build output already linked in at ``tensorrt_llm/1/engine``: every template rendered strictly and
schema-checked, the layout's python models and the reference runtime's self-contained copies beside them, the
layout's other files (``llmapi``'s ``model.yaml``), and an empty ``__pycache__`` file that keeps serving from writing
byte code into it. The package stage writes its output with it; the evaluation renders the unquantized baseline's
repository with it too.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

from pipeline import planning, store
from pipeline.catalog import ENGINE_REL
from pipeline.errors import StageFailed, UserError
from pipeline.triton import layouts
from pipeline.triton.layouts import REFERENCE_TEMPLATES
from pipeline.triton.render import MODELS_DIR, parse_model_config, render

REFERENCE_SRC = Path(importlib.util.find_spec("pipeline.runtime.reference").origin)  # copied next to model.py
DECODE_ENGINE_SRC = Path(importlib.util.find_spec("pipeline.runtime.decode_engine").origin)
GUIDED_SRC = Path(importlib.util.find_spec("pipeline.runtime.guided").origin)  # XGrammar for guided decoding
REFERENCE_COPIES = {"reference_runtime.py": REFERENCE_SRC, "reference_decode_engine.py": DECODE_ENGINE_SRC,
                    "reference_guided.py": GUIDED_SRC,
                    "reference_common.py": MODELS_DIR / "reference_common.py"}  # what both reference model.py share
# Packages copied beside them (their .py files, never __pycache__): the format registry, which the reference model.py
# passes to reference_runtime.load (pipeline is not importable in the serving container)
FORMATS_SRC = Path(importlib.util.find_spec("pipeline.formats").origin).parent
REFERENCE_PACKAGES = {"reference_formats": FORMATS_SRC}
MODELS = {(runtime, name): lay.templates(runtime) for name, lay in layouts.LAYOUTS.items() for runtime in lay.runtimes}
LAYOUTS_DIR = Path(layouts.__file__).resolve().parent  # every layout folder: records, templates, python models, codecs


def layout(cfg) -> str:
    """The repository layout: ``serve.layout``, with ``auto`` resolved from the runtime."""
    runtime = cfg.runtime.name.value
    chosen = getattr(cfg.serve.layout, "value", cfg.serve.layout)
    if chosen == "auto":
        return layouts.default_for(runtime)
    if (runtime, chosen) not in MODELS:
        fits = [name for name, lay in layouts.LAYOUTS.items() if runtime in lay.models]
        raise UserError(f"serve.layout={chosen} cannot serve runtime {runtime} (it has no templates for it; "
                        f"{', '.join(fits)} {'does' if len(fits) == 1 else 'do'}); set serve.layout="
                        f"{layouts.default_for(runtime)} or auto")
    return chosen


def reference_files() -> dict[str, Path]:
    """Every file the package stage copies into a reference model's version directory (``<model>/1/``): its path
    there -> its origin. A package's ``__init__.py`` is always listed, so a missing package fails the copy."""
    out = dict(REFERENCE_COPIES)
    for dst, src in REFERENCE_PACKAGES.items():
        out[f"{dst}/__init__.py"] = src / "__init__.py"
        for p in sorted(src.rglob("*.py")):
            rel = p.relative_to(src)
            if "__pycache__" not in rel.parts:
                out[f"{dst}/{rel.as_posix()}"] = p
    return out


def templates_digest(cfg=None, store_dir=None) -> dict[str, Any]:
    """The layout folders are code too: their records, templates, python models, placeholders, readers and codecs
    (which the registry imports by folder, out of sight of the import graph the code digest follows), and the
    shared python-model files beside them (``pipeline/triton/models/``); their bytes enter the fingerprint, and so do
    the files copied beside the reference models (:func:`reference_files`)."""
    files = [(f"layouts/{p.relative_to(LAYOUTS_DIR).as_posix()}", p) for p in LAYOUTS_DIR.rglob("*")]
    files += [(f"models/{p.relative_to(MODELS_DIR).as_posix()}", p) for p in MODELS_DIR.rglob("*")]
    files = sorted((rel, p) for rel, p in files if p.is_file() and "__pycache__" not in p.parts)
    copies = sorted(reference_files().items())
    return {"templates": store.digest([(rel, store.sha256_file(p)) for rel, p in files]),
            "reference_copies": store.digest([(dst, store.sha256_file(p) if p.is_file() else None)
                                              for dst, p in copies])}


CAPACITY = ("tp", "pp", "world", "kv_tokens", "settings")  # what the repository takes from the resolved capacity plan


def values(cfg, engine_cfg: dict[str, Any], capacity) -> dict[str, dict[str, Any]]:
    """Every placeholder of every template of the config's layout (its folder's ``placeholders.values``), from the
    config, the build record and the resolved capacity plan (:data:`CAPACITY` of a ``planning.Capacity``)."""
    return layouts.get(layout(cfg)).values(cfg, engine_cfg, capacity)


def render_repository(cfg, repo: Path, capacity=None, engine_cfg: dict[str, Any] | None = None) -> list[str]:
    """Write every model of the layout into ``repo``, whose ``tensorrt_llm/1/engine`` already holds the build
    output. Returns the model names. Nothing is written for a template that fails rendering or the schema.
    ``capacity``: the build's resolved capacity plan (``Context.capacity``); outside a build it is resolved from
    the full ``cfg``. ``engine_cfg``: the engine's ``config.json`` (read from the build output when None; ``{}``
    for a repository rendered before its build, ``python -m pipeline render``)."""
    if capacity is None:
        capacity = planning.resolve(cfg)
    runtime, lay = cfg.runtime.name.value, layouts.get(layout(cfg))
    if engine_cfg is None:
        engine_cfg = json.loads((repo / ENGINE_REL / "config.json").read_text()) if runtime == "trtllm_engine" else {}
    vals = lay.values(cfg, engine_cfg, capacity)
    rendered = []
    for tmpl in MODELS[(runtime, lay.name)]:
        name = lay.model_name(tmpl)
        text = render((lay.template_dir(tmpl) / "config.pbtxt.tmpl").read_text(), vals[tmpl],
                      name=f"{name}/config.pbtxt")
        parse_model_config(text, name=f"{name}/config.pbtxt")  # schema check before anything is written
        rendered.append((tmpl, name, text))
    for tmpl, name, text in rendered:
        src = lay.template_dir(tmpl)
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "config.pbtxt").write_text(text)
        for f in sorted((src / "1").glob("*.py")):
            shutil.copy2(f, repo / name / "1" / f.name)
        if tmpl in REFERENCE_TEMPLATES:
            for dst, origin in reference_files().items():
                if not origin.is_file():
                    raise StageFailed(f"{origin} is missing; the reference runtime cannot be packaged without it")
                (repo / name / "1" / dst).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, repo / name / "1" / dst)
    for rel, text in lay.files(cfg, repo, capacity).items():  # llmapi: tensorrt_llm/1/model.yaml
        (repo / rel).write_text(text)
    block_bytecode(repo, [name for _, name, _ in rendered])
    return [name for _, name, _ in rendered]


BYTECODE_BLOCK = "__pycache__"


def block_bytecode(repo: Path, models: list[str]) -> None:
    """An empty file named ``__pycache__`` beside the python files of every model, so that serving writes no byte
    code into the repository: a served bundle stays byte-identical, a stage output stays as its manifest lists it.
    Triton's python backend runs its stubs' interpreter isolated (``PYTHONDONTWRITEBYTECODE`` does not reach it);
    with a file where the ``__pycache__`` directory would go, Python's import system skips writing its cache."""
    for name in models:
        version = repo / name / "1"
        for d in sorted({p.parent for p in version.rglob("*.py")}):
            if d.is_relative_to(repo / ENGINE_REL):  # the build output, hard-linked: not ours to add to
                continue
            (d / BYTECODE_BLOCK).write_bytes(b"")


ENGINE_TEMPLATE = "tensorrt_llm.engine"  # inflight_batcher_llm's tensorrt_llm on the C++ backend


def rendered_engine_parameters(cfg, capacity=None) -> dict[str, str]:
    """The ``tensorrt_llm`` parameters rendered for ``trtllm_engine``, from the config alone (the engine's own batch
    size, known after the build, can only lower ``triton_max_batch_size``)."""
    import string

    from pipeline.triton.render import _pbtxt_value
    from pipeline.upstream.pbtxt import parse_template

    lay = layouts.get(layout(cfg))
    vals = lay.values(cfg, {}, capacity if capacity is not None else planning.resolve(cfg))[ENGINE_TEMPLATE]
    text = (lay.template_dir(ENGINE_TEMPLATE) / "config.pbtxt.tmpl").read_text()
    params = parse_template(text, name=ENGINE_TEMPLATE).get("parameters", {})
    fill = {k: _pbtxt_value(v) for k, v in vals.items()}
    return {k: string.Template(str(v)).safe_substitute(fill) for k, v in params.items()}
