"""The performance model's side of :mod:`pipeline.perfmodel`: run in the performance model's own environment
(``make perfmodel-env``: aiconfigurator-core and numpy 2, which the project's environment cannot hold beside the
bundled Triton's numpy < 2), as a script, never imported by the project. Standard library and aiconfigurator-core only.

Reads one JSON document on stdin, ``{"queries": [...]}``, writes ``{"results": [...]}`` on stdout, one result per
query in order: the figures, or ``{"error": "..."}`` (one line) where the tables have no data for it.

Each query is one aggregated (in-flight batching) estimate, the path ``aiconfigurator cli estimate --estimate-mode agg``
takes (aiconfigurator 0.12.0, ``aiconfigurator/cli/api.py`` ``_run_agg_estimate``), done here with aiconfigurator-core's
own modules: ``config_builders.build_model_config``, ``models.helpers.resolve_context_fmha_by_data`` and
``resolve_nvfp4_for_system``, ``models.get_model``, ``perf_database.get_database_view`` (the system's latest table
version, ``get_latest_database_version``), ``backends.factory.get_backend(...).run_agg`` with the context-token
budget the CLI defaults to (the input length). Databases and models are loaded once per process.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import tempfile

_DBS: dict = {}
_MODELS: dict = {}


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
        d = tempfile.mkdtemp(prefix="perfmodel-")
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(q["config"], f)
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
    mc = build_model_config(int(q["tp"]), 1, 1, None, None, q["gemm"], q["kv"], None, None, None)
    resolve_context_fmha_by_data(mc, path, db, "trtllm", is_context_role=True)
    resolve_nvfp4_for_system(mc, system, path, backend_name="trtllm")
    model = get_model(path, mc, "trtllm")
    isl, osl, bs = int(q["isl"]), int(q["osl"]), int(q["batch"])
    summary = get_backend("trtllm").run_agg(model, db, RuntimeConfig(isl=isl, osl=osl, batch_size=bs),
                                            ctx_tokens=isl, max_seq_len=None, free_gpu_memory_fraction=None)
    if summary.check_oom():
        return {"error": f"does not fit in {system} memory at TP={q['tp']}", "version": version}
    r = summary.get_result_dict()
    if r is None:
        return {"error": "the estimate produced no result", "version": version}
    return {"version": version, "ttft_ms": float(r["ttft"]), "tpot_ms": float(r["tpot"]),
            "tokens_per_s_per_gpu": float(r["tokens/s/gpu"]), "tokens_per_s_per_user": float(r["tokens/s/user"]),
            "request_latency_ms": float(r["request_latency"]), "memory_gb": float(r["memory"]),
            "kv_cache_oom": bool(summary.check_kv_cache_oom()), "gemm": str(r.get("gemm")),
            "kvcache": str(r.get("kvcache")), "fmha": str(r.get("fmha"))}


def main() -> None:
    logging.disable(logging.WARNING)  # the tables' loading notes; errors come back per query
    doc = json.load(sys.stdin)
    out = []
    for q in doc["queries"]:
        try:
            out.append(estimate(q))
        except Exception as exc:  # one line per query: the model's own words (missing table rows, unknown model)
            import aiconfigurator_core

            here = os.path.dirname(os.path.dirname(aiconfigurator_core.__file__))  # no local paths in the line
            msg = " ".join(str(exc).replace(here + os.sep, "").split())
            out.append({"error": (msg[:300] or type(exc).__name__)})
    import aiconfigurator_core

    json.dump({"results": out, "aiconfigurator_core": getattr(aiconfigurator_core, "__version__", None)}, sys.stdout)


if __name__ == "__main__":
    main()
