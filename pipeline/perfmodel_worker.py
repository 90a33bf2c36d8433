"""The performance model's side of :mod:`pipeline.perfmodel`: run in the performance model's own environment
(``make perfmodel-env``: aiconfigurator-core and numpy 2, which the project's environment cannot hold beside the
bundled Triton's numpy < 2), as a script, never imported by the project. Standard library and aiconfigurator-core only.

A process serves a whole command (a ``plan``, a ``validate`` of every combination; the parent keeps one per database
mode, which load side by side): it reads JSON documents, one per line on stdin, and answers each with one line on
stdout, in order:

- ``{"warm": [query, ...]}``: estimate those queries now and keep their results for when they are asked (the parent
  sends one as soon as it knows the target, and goes on with its own work meanwhile: the system's tables and the
  model's attention data load here in the meantime); answered ``{"warm": n, "version": ...}``.
- ``{"queries": [...]}``: answered ``{"results": [...], "version": ...}``, one result per query in order: the figures,
  or ``{"error": "..."}`` (one line) where the tables have no data for it. ``version`` is the installed
  aiconfigurator-core's own (``importlib.metadata``), never the project's pin.

Each query is one aggregated (in-flight batching) estimate, the path ``aiconfigurator cli estimate --estimate-mode agg``
takes (aiconfigurator 0.12.0, ``aiconfigurator/cli/api.py`` ``_run_agg_estimate``), done here with aiconfigurator-core's
own modules: ``config_builders.build_model_config`` (with the query's FMHA mode, the CLI's ``--fmha-quant-mode``),
``models.helpers.resolve_context_fmha_by_data`` and ``resolve_nvfp4_for_system``, ``models.get_model``,
``perf_database.get_database_view`` (the system's latest table version, ``get_latest_database_version``) and
``backends.factory.get_backend(...).run_agg`` with the query's context-token budget (``--ctx-tokens``) and
``max_seq_len`` (``--max-seq-len``). The figures do not depend on ``max_seq_len``; the memory does (KV for every
sequence of the batch at full length), and where that memory exceeds the GPU the CLI stops with "OOM" while this
returns the figures with ``oom`` true, plus the memory at the request's own length (``max_seq_len`` = input + output,
the CLI's default). Databases and models are loaded once per process.

aiconfigurator reads its tables' YAML index with PyYAML's ``safe_load``; here that is PyYAML's own libyaml loader
(``CSafeLoader``, the same YAML subset, parsed in C), which cuts loading one system's tables from ~2.3 s to ~0.3 s.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import tempfile

_DBS: dict = {}
_MODELS: dict = {}
_TMP: list[str] = []  # where model configs go when the parent names no directory, removed when this process ends


def _tmp() -> str:
    if not _TMP:
        import atexit
        import shutil

        _TMP.append(tempfile.mkdtemp(prefix="perfmodel-"))
        atexit.register(shutil.rmtree, _TMP[0], True)
    return _TMP[0]


def _fast_yaml() -> None:
    import yaml

    if getattr(yaml, "__with_libyaml__", False):
        yaml.safe_load = lambda stream: yaml.load(stream, Loader=yaml.CSafeLoader)


def _installed() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("aiconfigurator-core")
    except metadata.PackageNotFoundError:
        return None


def _model_path(q: dict) -> str:
    """The Hub id when aiconfigurator-core bundles its config (what its CLI reads offline), else a directory holding
    the ``config.json`` the query carries."""
    import aiconfigurator_core

    hub = q.get("hub_id") or ""
    bundled = os.path.join(os.path.dirname(aiconfigurator_core.__file__), "model_configs",
                           hub.replace("/", "--") + "_config.json")
    if hub and os.path.isfile(bundled):
        return hub
    key = json.dumps(q["config"], sort_keys=True)
    if key not in _MODELS:
        import hashlib

        root = os.environ.get("PIPELINE_PERFMODEL_MODELS") or _tmp()
        d = os.path.join(root, hashlib.sha256(key.encode()).hexdigest()[:16])
        if not os.path.isfile(os.path.join(d, "config.json")):
            # written whole into a directory of its own, then renamed into place: a reader never sees half a file,
            # and two processes writing the same config agree on its content
            os.makedirs(root, exist_ok=True)
            part = tempfile.mkdtemp(prefix=".part-", dir=root)
            with open(os.path.join(part, "config.json"), "w") as f:
                json.dump(q["config"], f)
            try:
                os.rename(part, d)
            except OSError:  # another process put it there first
                import shutil

                shutil.rmtree(part, True)
        _MODELS[key] = d
    return _MODELS[key]


def _database(system: str, mode: str):
    from aiconfigurator_core.sdk import perf_database as pdb

    if (system, mode) not in _DBS:
        version = pdb.get_latest_database_version(system=system, backend="trtllm")
        if version is None:
            raise LookupError(f"no TensorRT-LLM tables for system {system}")
        db = pdb.get_database_view(system, "trtllm", version, allow_missing_data=mode != "SILICON",
                                   database_mode=mode, transfer_policy=None)
        if db is None:
            raise LookupError(f"the {system} TensorRT-LLM {version} tables did not load")
        _DBS[(system, mode)] = (version, db)
    return _DBS[(system, mode)]


def estimate(q: dict) -> dict:
    from aiconfigurator_core.sdk.backends.factory import get_backend
    from aiconfigurator_core.sdk.config import RuntimeConfig
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.models import get_model
    from aiconfigurator_core.sdk.models.helpers import resolve_context_fmha_by_data, resolve_nvfp4_for_system

    system, mode = q["system"], q.get("database_mode", "SILICON")
    version, db = _database(system, mode)
    path = _model_path(q)
    mc = build_model_config(int(q["tp"]), 1, 1, None, None, q["gemm"], q["kv"], q.get("fmha") or None, None, None)
    resolve_context_fmha_by_data(mc, path, db, "trtllm", is_context_role=True)
    resolve_nvfp4_for_system(mc, system, path, backend_name="trtllm")
    model = get_model(path, mc, "trtllm")
    isl, osl, bs = int(q["isl"]), int(q["osl"]), int(q["batch"])
    backend = get_backend("trtllm")
    rc = RuntimeConfig(isl=isl, osl=osl, batch_size=bs)
    ctx = int(q.get("ctx_tokens") or isl)
    summary = backend.run_agg(model, db, rc, ctx_tokens=ctx, max_seq_len=q.get("max_seq_len") or None,
                              free_gpu_memory_fraction=None)
    r = summary.get_result_dict()
    if r is None:
        return {"error": "the estimate produced no result", "version": version}
    at_request = float(r["memory"])
    if q.get("max_seq_len"):  # the memory of the request's own length too (the CLI's default max_seq_len)
        own = backend.run_agg(model, db, RuntimeConfig(isl=isl, osl=osl, batch_size=bs), ctx_tokens=ctx,
                              max_seq_len=None, free_gpu_memory_fraction=None).get_result_dict()
        at_request = float(own["memory"]) if own else at_request
    return {"version": version, "ttft_ms": float(r["ttft"]), "tpot_ms": float(r["tpot"]),
            "tokens_per_s_per_gpu": float(r["tokens/s/gpu"]), "tokens_per_s_per_user": float(r["tokens/s/user"]),
            "request_latency_ms": float(r["request_latency"]), "memory_gb": float(r["memory"]),
            "memory_gb_at_request": at_request, "oom": bool(summary.check_oom()),
            "kv_cache_oom": bool(summary.check_kv_cache_oom()), "gemm": str(r.get("gemm")),
            "kvcache": str(r.get("kvcache")), "fmha": str(r.get("fmha"))}


def _one_line(exc: BaseException) -> str:
    """The model's own words (missing table rows, unknown model) on one line, without local paths."""
    import aiconfigurator_core

    here = os.path.dirname(os.path.dirname(aiconfigurator_core.__file__))
    msg = " ".join(str(exc).replace(here + os.sep, "").split())
    return msg[:300] or type(exc).__name__


_DONE: dict = {}


def _answer(q: dict) -> dict:
    """One query's result, estimated once per process."""
    key = json.dumps(q, sort_keys=True)
    if key not in _DONE:
        try:
            _DONE[key] = estimate(q)
        except Exception as exc:
            _DONE[key] = {"error": _one_line(exc)}
    return _DONE[key]


def main() -> None:
    logging.disable(logging.WARNING)  # the tables' loading notes; errors come back per query
    _fast_yaml()
    version = _installed()
    for line in sys.stdin:
        if not line.strip():
            continue
        doc = json.loads(line)
        if "warm" in doc:
            for q in doc["warm"]:
                _answer(q)
            out = {"warm": len(doc["warm"]), "version": version}
        else:
            out = {"results": [_answer(q) for q in doc["queries"]], "version": version}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
