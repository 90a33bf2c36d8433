"""``python -m pipeline lint REPO``: check a Triton model repository for TensorRT-LLM, generated or hand-edited.

Rules (each finding is one line naming the file and the fix):

1. every ``config.pbtxt`` parses against Triton's protobuf ``ModelConfig`` and has no unfilled ``${placeholder}``;
2. every ensemble step names a model in the repository, maps tensors that exist with matching data types, feeds
   every required input, and the ensemble's outputs are produced;
3. batch sizes agree: an ensemble's ``max_batch_size`` is at most each step model's, and the ``tensorrt_llm`` model's
   at most the engine's ``build_config.max_batch_size``;
4. streaming implies decoupled: a model with a ``stream``/``streaming`` input is decoupled, an ensemble streams only
   through a decoupled step, and the backend's ``decoupled_mode`` parameter agrees with the transaction policy;
5. ``tokenizer_dir`` and ``engine_dir`` exist, and the engine holds ``rank{N}.engine`` for its world size; a path is
   relative to the repository root, or absolute under the repository itself or under the repository's mount in the
   serving container (``repo_mount``, ``serve.repo_mount``), and any other absolute path is a finding;
6. the engine's TRT-LLM version (its ``config.json``) is the serving container's, when that is known;
7. an ``llmapi`` model's ``model.yaml`` points at a checkpoint that exists and agrees with ``config.pbtxt``.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from pipeline.triton.render import parse_model_config

STREAM_INPUTS = ("stream", "streaming")
REPO_MOUNT = "/models"  # serve.repo_mount's default: where the serving container mounts the repository
PATH_PARAMS = ("tokenizer_dir", "engine_dir")


def _resolve(repo: Path, value: str, mount: str) -> Path | None:
    """Where a path parameter points in ``repo``: a relative path is relative to the repository root; an absolute one
    must lie under the repository itself or under ``mount`` (the repository's path in the serving container). None
    for any other absolute path."""
    p = Path(os.path.normpath(value))
    if not p.is_absolute():
        return repo / p
    for root in (repo.absolute(), repo.resolve(), Path(os.path.normpath(mount))):
        if p == root or root in p.parents:
            return repo / p.relative_to(root)
    return None


def _outside(rel: str, key: str, value: str, repo: Path, mount: str) -> str:
    return (f"{rel}: {key} {value} is outside the repository; make it relative to the repository root, or absolute "
            f"under {repo.absolute()} or under the container mount {mount} (serve.repo_mount)")


def _tensors(cfg) -> tuple[dict[str, tuple[int, bool]], dict[str, int]]:
    inputs = {i.name: (i.data_type, i.optional) for i in cfg.input}
    outputs = {o.name: o.data_type for o in cfg.output}
    return inputs, outputs


def _dtype(code: int) -> str:
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2.DataType.Name(code)


def load(repo: Path) -> tuple[dict[str, Any], dict[str, Path], list[str]]:
    configs, dirs, findings = {}, {}, []
    files = sorted(repo.glob("*/config.pbtxt"))
    if not files:
        raise UserError(f"{repo}: no */config.pbtxt here; give the model repository's root directory")
    for f in files:
        rel = f.relative_to(repo).as_posix()
        text = f.read_text(errors="replace")
        left = re.findall(r"\$\{(\w+)\}", text)
        if left:
            findings.append(f"{rel}: unfilled placeholder ${{{left[0]}}}; render it (never leave ${{...}} in a config)")
            continue
        try:
            cfg = parse_model_config(text, name=rel)
        except UserError as exc:
            findings.append(str(exc))
            continue
        name = cfg.name or f.parent.name
        if name != f.parent.name:
            findings.append(f"{rel}: name \"{name}\" differs from its directory \"{f.parent.name}\"; Triton refuses it")
        configs[f.parent.name] = cfg
        dirs[f.parent.name] = f.parent
    return configs, dirs, findings


def _params(cfg) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


def check_ensemble(name: str, cfg, configs: dict[str, Any]) -> list[str]:
    out = []
    rel = f"{name}/config.pbtxt"
    e_inputs, e_outputs = _tensors(cfg)
    available = {k: v[0] for k, v in e_inputs.items()}
    for i, step in enumerate(cfg.ensemble_scheduling.step):
        model = configs.get(step.model_name)
        if model is None:
            out.append(f"{rel}: step {i} uses model \"{step.model_name}\", which is not in the repository")
            continue
        m_inputs, m_outputs = _tensors(model)
        if 0 < model.max_batch_size < cfg.max_batch_size or (cfg.max_batch_size and model.max_batch_size == 0):
            out.append(f"{rel}: max_batch_size {cfg.max_batch_size} exceeds step model \"{step.model_name}\"'s "
                       f"{model.max_batch_size}; lower the ensemble's or raise the model's")
        for key, value in step.input_map.items():
            if key not in m_inputs:
                out.append(f"{rel}: step \"{step.model_name}\" maps input \"{key}\", which the model does not have")
            elif value not in available:
                out.append(f"{rel}: step \"{step.model_name}\" reads \"{value}\", which no ensemble input or earlier "
                           f"step provides")
            elif available[value] != m_inputs[key][0]:
                out.append(f"{rel}: \"{value}\" is {_dtype(available[value])} but \"{step.model_name}\" input "
                           f"\"{key}\" is {_dtype(m_inputs[key][0])}")
            if key in STREAM_INPUTS and value in e_inputs and not model.model_transaction_policy.decoupled:
                out.append(f"{rel}: streams through \"{step.model_name}\", which is not decoupled; set "
                           f"model_transaction_policy {{ decoupled: true }} there")
        for key, (_, optional) in m_inputs.items():
            if not optional and key not in step.input_map:
                out.append(f"{rel}: step \"{step.model_name}\" does not feed its required input \"{key}\"")
        for key, value in step.output_map.items():
            if key not in m_outputs:
                out.append(f"{rel}: step \"{step.model_name}\" maps output \"{key}\", which the model does not have")
                continue
            available[value] = m_outputs[key]
    for oname, dtype in e_outputs.items():
        if oname not in available:
            out.append(f"{rel}: output \"{oname}\" is produced by no step")
        elif available[oname] != dtype:
            out.append(f"{rel}: output \"{oname}\" is {_dtype(dtype)} but its step produces {_dtype(available[oname])}")
    return out


def check_model(repo: Path, name: str, cfg, mdir: Path, trtllm_version: str | None,
                repo_mount: str = REPO_MOUNT) -> list[str]:
    out = []
    rel = f"{name}/config.pbtxt"
    inputs, _ = _tensors(cfg)
    params = _params(cfg)
    decoupled = cfg.model_transaction_policy.decoupled
    if any(s in inputs for s in STREAM_INPUTS) and not decoupled:
        out.append(f"{rel}: has a streaming input but is not decoupled; set model_transaction_policy "
                   f"{{ decoupled: true }} (streaming needs decoupled mode)")
    if "decoupled_mode" in params and params["decoupled_mode"].lower() != str(decoupled).lower():
        out.append(f"{rel}: parameter decoupled_mode={params['decoupled_mode']} disagrees with the transaction "
                   f"policy (decoupled: {str(decoupled).lower()})")
    paths = {}
    for key in PATH_PARAMS:
        if key in params:
            paths[key] = _resolve(repo, params[key], repo_mount)
            if paths[key] is None:
                out.append(_outside(rel, key, params[key], repo, repo_mount))
    tok = paths.get("tokenizer_dir")
    if tok is not None and not (tok / "tokenizer_config.json").is_file() and not (tok / "tokenizer.json").is_file():
        out.append(f"{rel}: tokenizer_dir {params['tokenizer_dir']} has no tokenizer")
    if paths.get("engine_dir") is not None:
        out += _check_engine(paths["engine_dir"], rel, cfg, params, trtllm_version)
    if cfg.backend == "python" and not (mdir / "1" / "model.py").is_file():
        out.append(f"{name}/1/model.py is missing (backend python)")
    if (mdir / "1" / "model.yaml").is_file():
        out += _check_llmapi(repo, mdir, cfg, repo_mount)
    return out


def _check_engine(engine: Path, rel: str, cfg, params: dict[str, str], trtllm_version: str | None) -> list[str]:
    if not engine.is_dir():
        return [f"{rel}: engine_dir {params['engine_dir']} does not exist"]
    if cfg.backend != "tensorrtllm":
        return []  # the reference runtime's engine dir is a checkpoint
    cfg_file = engine / "config.json"
    if not cfg_file.is_file():
        return [f"{rel}: engine_dir {params['engine_dir']} has no config.json"]
    ec = json.loads(cfg_file.read_text())
    out = []
    mapping = (ec.get("pretrained_config") or {}).get("mapping") or {}
    world = int(mapping.get("world_size") or int(mapping.get("tp_size", 1)) * int(mapping.get("pp_size", 1)))
    missing = [f"rank{r}.engine" for r in range(world) if not (engine / f"rank{r}.engine").is_file()]
    if missing:
        out.append(f"{rel}: engine_dir lacks {', '.join(missing)} for world size {world}")
    engine_bs = (ec.get("build_config") or {}).get("max_batch_size")
    if engine_bs is not None and cfg.max_batch_size > int(engine_bs):
        out.append(f"{rel}: max_batch_size {cfg.max_batch_size} exceeds the engine's {engine_bs}; set it to at "
                   f"most {engine_bs}")
    if trtllm_version and ec.get("version") and ec["version"] != trtllm_version:
        out.append(f"{rel}: engine built by TensorRT-LLM {ec['version']}, serving container has {trtllm_version}; "
                   f"rebuild with {trtllm_version}")
    return out


def _check_llmapi(repo: Path, mdir: Path, cfg, repo_mount: str) -> list[str]:
    """``model`` is relative to the model.yaml's folder (as the llmapi model reads it), or absolute under the
    repository or its container mount."""
    import yaml

    where = f"{mdir.name}/1/model.yaml"
    doc = yaml.safe_load((mdir / "1" / "model.yaml").read_text()) or {}
    out = []
    model = doc.get("model")
    if not model:
        out.append(f"{where}: no model; set it to the checkpoint directory (relative to {mdir.name}/1/)")
    elif not Path(model).is_absolute():
        if not (mdir / "1" / model).exists():
            out.append(f"{where}: model {model!r} does not exist next to it")
    else:
        located = _resolve(repo, model, repo_mount)
        if located is None:
            out.append(_outside(where, "model", model, repo, repo_mount))
        elif not located.exists():
            out.append(f"{where}: model {model!r} does not exist in the repository")
    tc = doc.get("triton_config") or {}
    if tc.get("max_batch_size") != cfg.max_batch_size:
        out.append(f"{where}: triton_config.max_batch_size {tc.get('max_batch_size')} differs from "
                   f"config.pbtxt's {cfg.max_batch_size}")
    if bool(tc.get("decoupled")) != cfg.model_transaction_policy.decoupled:
        out.append(f"{where}: triton_config.decoupled disagrees with config.pbtxt "
                   f"(decoupled: {str(cfg.model_transaction_policy.decoupled).lower()})")
    return out


def lint(repo: Path | str, *, trtllm_version: str | None = None, repo_mount: str = REPO_MOUNT) -> list[str]:
    """Every finding, one line each. ``repo_mount``: the repository's path in the serving container, the one place
    besides the repository itself where an absolute path parameter may point."""
    repo = Path(repo)
    if not repo.is_dir():
        raise UserError(f"{repo}: no such directory")
    configs, dirs, findings = load(repo)
    for name, cfg in configs.items():
        if cfg.platform == "ensemble":
            findings += check_ensemble(name, cfg, configs)
        else:
            findings += check_model(repo, name, cfg, dirs[name], trtllm_version, repo_mount)
    return findings
