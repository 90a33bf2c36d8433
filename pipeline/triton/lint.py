"""``python -m pipeline lint REPO``: check a Triton model repository for TensorRT-LLM, generated or hand-edited.

Rules (each finding is one line naming the file and the fix):

1. every ``config.pbtxt`` parses against Triton's protobuf ``ModelConfig`` and has no unfilled ``${placeholder}``;
2. every model of the repository's layout (its folder's ``detect``, ``pipeline/triton/layouts``: NVIDIA's
   ``inflight_batcher_llm`` or ``llmapi``, recorded in ``pipeline/upstream`` for the repository's TensorRT-LLM line;
   another layout of the registry against the ``interface.yaml`` in its folder) has upstream's backend, inputs and
   outputs, with upstream's data type, dims, optional flag, ragged batching and reshape, an ensemble upstream's steps
   and tensor maps, and sets (non-empty) every parameter its backend or ``model.py`` reads without a fallback
   (``gpt_model_path``, ``tokenizer_dir``, ``xgrammar_tokenizer_info_path``, ``guided_decoding_backend``, ...);
3. every ensemble step names a model in the repository, maps tensors that exist with matching data types, feeds
   every required input, and the ensemble's outputs are produced;
4. batch sizes agree: an ensemble's ``max_batch_size`` is at most each step model's, and the ``tensorrt_llm`` model's
   at most the engine's ``build_config.max_batch_size``;
5. decoupled and unary repositories are both valid (upstream's quick start is unary); the backend's ``decoupled_mode``
   parameter agrees with the transaction policy;
6. path parameters (``gpt_model_path``, ``tokenizer_dir``, the reference runtime's ``engine_dir``,
   ``xgrammar_tokenizer_info_path`` with the keys the C++ backend reads) exist, and the engine holds
   ``rank{N}.engine`` for its world size; ``guided_decoding_backend`` is one the backend takes, with a tokenizer
   info file named beside it (``pipeline/upstream`` ``guided_decoding``); a path is relative to the repository
   root, or absolute under the repository itself or under the repository's mount in the serving container
   (``repo_mount``, ``serve.repo_mount``), and any other absolute path is a finding;
7. the engine's TRT-LLM version (its ``config.json``) is the serving container's (``trtllm_version``, or the version
   upstream pairs with ``container``);
8. the repository loads (:func:`loadability`, also run by ``verify`` on a bundle): every model directory has a
   version directory (Triton: "at least one version must be available"), every top-level directory is a model,
   ``tensorrt_llm`` and ``tensorrt_llm_bls`` share one transaction policy (the BLS calls the model with its own
   ``decoupled`` flag: a decoupled BLS over a unary model cannot stream) and the BLS's ``max_batch_size`` is at most
   the model's;
9. an ``llmapi`` model takes ``max_batch_size`` and decoupled mode from ``model.yaml``'s ``triton_config`` (not from
   ``config.pbtxt``, as upstream), its ``model`` is an absolute path that exists in the repository, its
   ``guided_decoding_backend`` is one the LLM API takes, and N instances name N GPU sets in ``gpu_device_ids``.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pipeline import upstream
from pipeline.errors import UserError
from pipeline.triton.render import parse_model_config
from pipeline.triton import layouts

REPO_MOUNT = "/models"  # serve.repo_mount's default: where the serving container mounts the repository
PATH_PARAMS = ("tokenizer_dir", "gpt_model_path", "engine_dir", "xgrammar_tokenizer_info_path")


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
        raise UserError(f"{repo}: no */config.pbtxt here; {_where_the_repository_is(repo)}")
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


def _where_the_repository_is(path: Path) -> str:
    """The fix for a path that is no model repository: a bundle holds it at ``triton_repo/``, a published model's
    directory at ``<version>/triton_repo`` (``latest`` names the version to serve)."""
    if (path / "triton_repo").is_dir():
        return f"it is a bundle: give its repository, {path / 'triton_repo'}"
    latest = path / "latest"
    named = latest.read_text().strip() if latest.is_file() else None
    versions = sorted(p.parent.name for p in path.glob("*/triton_repo") if p.is_dir())
    if named or versions:
        pick = named if named in versions else (versions[-1] if versions else named)
        return (f"it is a published model: each version's repository is at <version>/triton_repo, e.g. "
                f"{path / str(pick) / 'triton_repo'}{' (the one latest names)' if pick == named else ''}")
    return "give the model repository's root directory"


def _params(cfg) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


layout_of = layouts.of_repository  # each layout's own detect (llmapi: tensorrt_llm has a 1/model.yaml)


# ------------------------------------------------------------------------------------------ upstream conformance
def _tensor_view(t, is_input: bool) -> dict[str, Any]:
    v: dict[str, Any] = {"data_type": _dtype(t.data_type), "dims": [int(d) for d in t.dims],
                         "reshape": [int(d) for d in t.reshape.shape] if t.HasField("reshape") else None}
    if is_input:
        v["optional"] = bool(t.optional)
        v["allow_ragged_batch"] = bool(t.allow_ragged_batch)
    return v


def _steps(cfg) -> list[dict[str, Any]]:
    return [{"model_name": s.model_name, "input_map": dict(s.input_map), "output_map": dict(s.output_map)}
            for s in cfg.ensemble_scheduling.step]


def _step_differences(rel: str, got: list[dict[str, Any]], want: list[dict[str, Any]]) -> list[str]:
    """The ensemble's steps against upstream's: the same models in order, each with upstream's tensor maps."""
    if [s["model_name"] for s in got] != [s["model_name"] for s in want]:
        return [f"{rel}: steps run {[s['model_name'] for s in got]}, upstream runs "
                f"{[s['model_name'] for s in want]}"]
    out = []
    for i, (g, w) in enumerate(zip(got, want)):
        for kind in ("input_map", "output_map"):
            have, need = g[kind], dict(w.get(kind) or {})
            for key in sorted(need.keys() - have.keys()):
                out.append(f"{rel}: step {i} ({g['model_name']}) lacks upstream's {kind} {key} -> {need[key]}")
            for key in sorted(have.keys() - need.keys()):
                out.append(f"{rel}: step {i} ({g['model_name']}) has {kind} {key} -> {have[key]}, which upstream "
                           f"does not map")
            for key in sorted(k for k in have.keys() & need.keys() if have[k] != need[k]):
                out.append(f"{rel}: step {i} ({g['model_name']}) maps {kind} {key} -> {have[key]}, upstream "
                           f"-> {need[key]}")
    return out


def conformance(name: str, cfg, recorded: dict[str, Any], reads: dict[str, Any],
                owner: str = "upstream") -> list[str]:
    """Differences between one model's config and upstream's recorded interface for it (``owner``: whose interface
    it is, in the messages; a layout that is not NVIDIA's has its own): missing, extra or different tensors (data
    type, dims, reshape, optional, ragged batching), another backend or platform, an ensemble's steps other than
    upstream's, required parameters that are absent or empty."""
    rel = f"{name}/config.pbtxt"
    src = recorded.get("source") or {}
    commit = str(src.get("commit") or "")[:10]
    where = " ".join(filter(None, (src.get("repo") or owner, src.get("path"), commit and f"@ {commit}")))
    out = []
    for kind, have in (("inputs", cfg.input), ("outputs", cfg.output)):
        is_input = kind == "inputs"
        want = {t["name"]: t for t in recorded.get(kind, [])}
        got = {t.name: t for t in have}
        for tname in want:
            if tname not in got:
                who = (f"this project's {kind[:-1]} \"{tname}\" is missing (its front end sends it; pipeline/upstream "
                       f"extensions)") if want[tname].get("extension") else \
                    f"{owner} {kind[:-1]} \"{tname}\" is missing (clients of {where} send/expect it)"
                out.append(f"{rel}: {who}; add it with data_type {want[tname]['data_type']} dims "
                           f"{want[tname]['dims']}")
                continue
            w, g = want[tname], _tensor_view(got[tname], is_input)
            if not str(w["data_type"]).startswith("${") and w["data_type"] != g["data_type"]:
                out.append(f"{rel}: {kind[:-1]} \"{tname}\" is {g['data_type']}, {owner} has {w['data_type']}")
            if list(w["dims"]) != g["dims"]:
                out.append(f"{rel}: {kind[:-1]} \"{tname}\" dims {g['dims']}, {owner} has {list(w['dims'])}")
            if (list(w["reshape"]) if "reshape" in w else None) != g["reshape"]:
                out.append(f"{rel}: {kind[:-1]} \"{tname}\" reshape {g['reshape']}, {owner} has {w.get('reshape')}")
            if is_input and bool(w.get("optional")) != g["optional"]:
                out.append(f"{rel}: input \"{tname}\" optional={str(g['optional']).lower()}, {owner} has "
                           f"optional={str(bool(w.get('optional'))).lower()}")
            if is_input and bool(w.get("allow_ragged_batch")) != g["allow_ragged_batch"]:
                out.append(f"{rel}: input \"{tname}\" allow_ragged_batch={str(g['allow_ragged_batch']).lower()}, "
                           f"{owner} has allow_ragged_batch={str(bool(w.get('allow_ragged_batch'))).lower()}")
        for tname in got:
            if tname not in want:
                out.append(f"{rel}: {kind[:-1]} \"{tname}\" is not in {owner}'s interface ({where}); remove it")
    for key in ("backend", "platform"):
        want_value = recorded.get(key)
        if want_value is not None and not str(want_value).startswith("${") and getattr(cfg, key) != want_value:
            out.append(f"{rel}: {key} \"{getattr(cfg, key)}\", {owner} has \"{want_value}\"")
    if recorded.get("steps") is not None:
        out += _step_differences(rel, _steps(cfg), recorded["steps"])
    params = _params(cfg)
    for key in reads.get("required", []):
        if key not in params:
            out.append(f"{rel}: required parameter \"{key}\" is missing; the {cfg.backend or cfg.platform} model "
                       f"reads it unconditionally ({(reads.get('source') or {}).get('path', where)}); set it")
        elif not params[key].strip() and key not in reads.get("empty_means_unset", []) and key != "gpt_model_path":
            out.append(f"{rel}: required parameter \"{key}\" is empty; the {cfg.backend or cfg.platform} model "
                       f"uses its value as given ({(reads.get('source') or {}).get('path', where)}); set it")
    out += _guided_problems(rel, cfg, params)
    if name == "tensorrt_llm" and "gpt_model_path" in params and not params["gpt_model_path"].strip() \
            and not params.get("encoder_model_path", "").strip():
        out.append(f"{rel}: gpt_model_path is empty (\"Both encoder and decoder model paths are empty\"); set it to "
                   f"the engine directory")
    return out


def _guided_problems(rel: str, cfg, params: dict[str, str]) -> list[str]:
    """A model with ``guided_decoding_backend`` set: one of the backends the record names (the C++ backend takes
    ``xgrammar`` only), with ``xgrammar_tokenizer_info_path`` set too (else the backend builds no guided decoding and
    every guided request is refused). The file itself is checked with the paths (:func:`check_model`)."""
    gd = (upstream.guided_decoding().get("triton_backend") or {})
    backend = params.get("guided_decoding_backend", "").strip()
    if not gd or not backend:
        return []
    out = []
    if backend not in gd["backends"]:
        out.append(f"{rel}: guided_decoding_backend {backend!r} is not one TensorRT-LLM's Triton backend takes "
                   f"({', '.join(gd['backends'])}; {gd['sources'][0]['path']})")
    if not params.get("xgrammar_tokenizer_info_path", "").strip():
        out.append(f"{rel}: guided_decoding_backend is set but xgrammar_tokenizer_info_path is empty: the backend "
                   f"then has no guided decoding; write {gd['tokenizer_info_file']} (generate_xgrammar_tokenizer_"
                   f"info.py) and name it")
    return out


def _tokenizer_info_problems(rel: str, path: Path, value: str) -> list[str]:
    """``xgrammar_tokenizer_info_path``'s file: JSON with every key the C++ backend reads."""
    if not path.is_file():
        return [f"{rel}: xgrammar_tokenizer_info_path {value} does not exist (the C++ backend refuses to load)"]
    keys = (upstream.guided_decoding().get("triton_backend") or {}).get("tokenizer_info_keys", [])
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return [f"{rel}: xgrammar_tokenizer_info_path {value} is not JSON ({exc})"]
    missing = [k for k in keys if k not in (doc if isinstance(doc, dict) else {})]
    return [f"{rel}: xgrammar_tokenizer_info_path {value} lacks {', '.join(missing)}; write it from the tokenizer "
            f"(generate_xgrammar_tokenizer_info.py, or re-run package)"] if missing else []


# --------------------------------------------------------------------------------------------------- ensembles
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


# ------------------------------------------------------------------------------------------------------ models
def check_model(repo: Path, name: str, cfg, mdir: Path, trtllm_version: str | None,
                repo_mount: str = REPO_MOUNT, engine: bool = True) -> list[str]:
    """One model's findings. ``engine`` False: a repository rendered without its build (``python -m pipeline
    render``), whose engine directory (``tensorrt_llm/1/engine``: the engine or checkpoint, and the tokenizer) is not
    there yet; a path into it is not looked for, every other check is made."""
    out = []
    from pipeline.catalog import ENGINE_REL

    def pending(p: Path | None) -> bool:  # a path into the build output, which a rendered repository has not yet
        return not engine and p is not None and p.resolve().is_relative_to((repo / ENGINE_REL).resolve())

    rel = f"{name}/config.pbtxt"
    params = _params(cfg)
    decoupled = cfg.model_transaction_policy.decoupled
    if "decoupled_mode" in params and params["decoupled_mode"].lower() != str(decoupled).lower():
        out.append(f"{rel}: parameter decoupled_mode={params['decoupled_mode']} disagrees with the transaction "
                   f"policy (decoupled: {str(decoupled).lower()})")
    paths = {}
    for key in PATH_PARAMS:
        if params.get(key, "").strip():
            paths[key] = _resolve(repo, params[key], repo_mount)
            if paths[key] is None:
                out.append(_outside(rel, key, params[key], repo, repo_mount))
    tok = paths.get("tokenizer_dir")
    if tok is not None and not pending(tok) and not (tok / "tokenizer_config.json").is_file() and not (
            tok / "tokenizer.json").is_file():
        out.append(f"{rel}: tokenizer_dir {params['tokenizer_dir']} has no tokenizer")
    for key in ("gpt_model_path", "engine_dir"):
        if paths.get(key) is not None and not pending(paths[key]) and not paths[key].is_dir():
            out.append(f"{rel}: {key} {params[key]} does not exist")
    info = paths.get("xgrammar_tokenizer_info_path")
    if info is not None and (engine or info.is_file()):  # made from the build's tokenizer at package time
        out += _tokenizer_info_problems(rel, info, params["xgrammar_tokenizer_info_path"])
    if cfg.backend == "tensorrtllm":  # every value against what the C++ backend accepts (upstream/rules.yaml)
        from pipeline.upstream import rules

        out += [f"{rel}: {p}" for p in rules.parameter_problems(params)]
    if cfg.backend == "tensorrtllm" and paths.get("gpt_model_path") is not None and paths["gpt_model_path"].is_dir():
        out += _check_engine(paths["gpt_model_path"], rel, cfg, params, trtllm_version)
    if cfg.backend == "python" and not (mdir / "1" / "model.py").is_file():
        out.append(f"{name}/1/model.py is missing (backend python)")
    if (mdir / "1" / "model.yaml").is_file():
        out += _check_llmapi(repo, mdir, cfg, repo_mount, pending)
    return out


def _check_engine(engine: Path, rel: str, cfg, params: dict[str, str], trtllm_version: str | None) -> list[str]:
    cfg_file = engine / "config.json"
    if not cfg_file.is_file():
        return [f"{rel}: gpt_model_path {params['gpt_model_path']} has no config.json"]
    ec = json.loads(cfg_file.read_text())
    out = []
    mapping = (ec.get("pretrained_config") or {}).get("mapping") or {}
    world = int(mapping.get("world_size") or int(mapping.get("tp_size", 1)) * int(mapping.get("pp_size", 1)))
    missing = [f"rank{r}.engine" for r in range(world) if not (engine / f"rank{r}.engine").is_file()]
    if missing:
        out.append(f"{rel}: gpt_model_path lacks {', '.join(missing)} for world size {world}")
    engine_bs = (ec.get("build_config") or {}).get("max_batch_size")
    if engine_bs is not None and cfg.max_batch_size > int(engine_bs):
        out.append(f"{rel}: max_batch_size {cfg.max_batch_size} exceeds the engine's {engine_bs}; set it to at "
                   f"most {engine_bs}")
    if trtllm_version and ec.get("version") and ec["version"] != trtllm_version:
        out.append(f"{rel}: engine built by TensorRT-LLM {ec['version']}, serving container has {trtllm_version}; "
                   f"rebuild with {trtllm_version} or serve with {_container_hint(ec['version'])}")
    return out


def _container_hint(version: str) -> str:
    try:
        return upstream.container_for(version)
    except UserError:
        return f"a container with TensorRT-LLM {version}"


def _check_llmapi(repo: Path, mdir: Path, cfg, repo_mount: str, pending=lambda p: False) -> list[str]:
    """``model`` is absolute under the repository or its container mount (upstream's model.py passes it to ``LLM``
    as it is); ``triton_config`` carries ``max_batch_size`` and ``decoupled``, config.pbtxt neither."""
    import yaml

    where = f"{mdir.name}/1/model.yaml"
    rel = f"{mdir.name}/config.pbtxt"
    try:
        doc = yaml.safe_load((mdir / "1" / "model.yaml").read_text()) or {}
    except yaml.YAMLError as exc:
        return [f"{where}: not YAML ({str(exc).splitlines()[0]})"]
    out = []
    model = doc.get("model")
    if not model:
        out.append(f"{where}: no model; set it to the checkpoint directory (absolute, under {repo_mount})")
    elif not Path(model).is_absolute():
        out.append(f"{where}: model {model!r} is relative; upstream's model.py passes it to LLM() as is, which "
                   f"resolves it against the server's working directory: make it absolute under {repo_mount}")
    else:
        located = _resolve(repo, model, repo_mount)
        if located is None:
            out.append(_outside(where, "model", model, repo, repo_mount))
        elif not located.exists() and not pending(located):
            out.append(f"{where}: model {model!r} does not exist in the repository")
    llm_api = upstream.guided_decoding().get("llm_api") or {}
    backend = doc.get(llm_api.get("llm_arg", "guided_decoding_backend"))
    if backend is not None and backend not in llm_api.get("backends", []):
        out.append(f"{where}: guided_decoding_backend {backend!r} is not one the LLM API takes "
                   f"({', '.join(llm_api.get('backends', []))}; tensorrt_llm/llmapi/llm_args.py)")
    tc = doc.get("triton_config")
    if not isinstance(tc, dict) or "max_batch_size" not in tc or "decoupled" not in tc:
        out.append(f"{where}: triton_config needs max_batch_size and decoupled (upstream's model.py reads both)")
    if cfg.max_batch_size or cfg.HasField("model_transaction_policy"):
        out.append(f"{rel}: sets max_batch_size/model_transaction_policy; upstream takes both from model.yaml's "
                   f"triton_config (auto_complete_config): remove them from config.pbtxt")
    count = cfg.instance_group[0].count if cfg.instance_group else 1
    if count > 1:
        ids = _params(cfg).get("gpu_device_ids", "")
        if len([g for g in ids.split(";") if g.strip()]) != count:
            out.append(f"{rel}: {count} instances need {count} GPU sets in gpu_device_ids (\"0,1;2,3\"), got {ids!r}")
    return out


# ------------------------------------------------------------------------------------------------ loadability
def repository_problems(files: set[str], dirs: set[str], read) -> list[str]:
    """The checks ``lint``, ``verify`` (its ``loadable`` check) and ``serve``'s preflight share, from a repository's
    tree (``files``/``dirs`` relative POSIX paths, ``read(rel)`` a file's text; a local directory or a bundle through
    fsspec): every ``*/config.pbtxt`` parsed (a failure names the file), no unfilled placeholder, each config's
    name its directory's, what keeps Triton from loading it (:func:`loadability`), and every ensemble against its
    step models (:func:`check_ensemble`: tensors, types, batch sizes)."""
    out: list[str] = []
    configs: dict[str, Any] = {}
    broken: set[str] = set()
    for rel in sorted(f for f in files if f.count("/") == 1 and f.endswith("/config.pbtxt")):
        top = rel.split("/", 1)[0]
        if top.startswith("."):
            continue
        try:
            text = read(rel)
        except (OSError, UnicodeDecodeError) as exc:
            out.append(f"{rel}: cannot be read ({exc})")
            broken.add(top)
            continue
        left = re.findall(r"\$\{(\w+)\}", text)
        if left:
            out.append(f"{rel}: unfilled placeholder ${{{left[0]}}}; render it (never leave ${{...}} in a config)")
            broken.add(top)
            continue
        try:
            cfg = parse_model_config(text, name=rel)
        except UserError as exc:
            out.append(str(exc))
            broken.add(top)
            continue
        if cfg.name and cfg.name != top:
            out.append(f"{rel}: name \"{cfg.name}\" differs from its directory \"{top}\"; Triton refuses it")
        configs[top] = cfg
    out += loadability(files, dirs, read)
    for name, cfg in sorted(configs.items()):
        if cfg.platform == "ensemble" and not any(step.model_name in broken for step in cfg.ensemble_scheduling.step):
            out += check_ensemble(name, cfg, configs)
    return out


def loadability(files: set[str], dirs: set[str], read) -> list[str]:
    """What keeps the real server from loading a repository, from its tree alone: ``files`` and ``dirs`` are the
    repository's paths relative to its root (POSIX), ``read(rel)`` returns a file's text. Works on a local
    directory (:func:`tree_of`) and on a bundle read through fsspec alike. A config that does not parse is left to
    the parse check (its models are skipped here, so one error is reported once)."""
    out: list[str] = []
    tops = sorted({p.split("/", 1)[0] for p in files | dirs if "/" in p} | {d for d in dirs if "/" not in d})
    configs = {}
    for top in tops:
        if top.startswith("."):
            continue
        if f"{top}/config.pbtxt" not in files:
            out.append(f"{top}/: a directory without config.pbtxt; Triton tries to load it as a model and fails: "
                       f"remove it or add its config")
            continue
        versions = sorted(d.split("/")[1] for d in dirs if d.count("/") == 1 and d.startswith(f"{top}/")
                          and d.split("/")[1].isdigit())
        versions += sorted({f.split("/")[1] for f in files if f.count("/") >= 2 and f.startswith(f"{top}/")
                            and f.split("/")[1].isdigit()} - set(versions))
        if not versions:
            out.append(f"{top}/: no version directory ({top}/1/); Triton refuses the model (\"at least one version "
                       f"must be available\"): create {top}/1/")
        try:
            configs[top] = parse_model_config(read(f"{top}/config.pbtxt"), name=f"{top}/config.pbtxt")
        except (UserError, UnicodeDecodeError):
            continue
    llm, bls = configs.get("tensorrt_llm"), configs.get("tensorrt_llm_bls")
    if llm is not None and bls is not None:
        d_llm, d_bls = _decoupled(llm, read), bls.model_transaction_policy.decoupled
        if d_llm is not None and d_llm != d_bls:
            out.append(f"tensorrt_llm_bls/config.pbtxt: decoupled: {str(d_bls).lower()}, but tensorrt_llm is "
                       f"{'decoupled' if d_llm else 'unary'}; the BLS calls it with its own mode (streaming fails at "
                       f"run time): give both the same model_transaction_policy")
        if llm.max_batch_size and bls.max_batch_size > llm.max_batch_size:
            out.append(f"tensorrt_llm_bls/config.pbtxt: max_batch_size {bls.max_batch_size} exceeds tensorrt_llm's "
                       f"{llm.max_batch_size}; lower the BLS's or raise the model's")
    return out


def _decoupled(cfg, read) -> bool | None:
    """A model's transaction policy: config.pbtxt's, or an llmapi model's ``triton_config.decoupled``."""
    if cfg.HasField("model_transaction_policy"):
        return cfg.model_transaction_policy.decoupled
    import yaml

    try:
        doc = yaml.safe_load(read("tensorrt_llm/1/model.yaml")) or {}
    except (OSError, FileNotFoundError, yaml.YAMLError):
        return False
    tc = doc.get("triton_config") if isinstance(doc, dict) else None
    return bool(tc.get("decoupled")) if isinstance(tc, dict) else None


def tree_of(root: Path) -> tuple[set[str], set[str]]:
    """(files, directories) under ``root``, relative POSIX paths."""
    files, dirs = set(), set()
    for p in root.rglob("*"):
        rel = p.relative_to(root).as_posix()
        (dirs if p.is_dir() else files).add(rel)
    return files, dirs


def lint(repo: Path | str, *, trtllm_version: str | None = None, repo_mount: str = REPO_MOUNT,
         container: str | None = None, line: str | None = None, layout: str | None = None,
         engine: bool = True) -> list[str]:
    """Every finding, one line each. ``trtllm_version``: the serving container's TensorRT-LLM (else the one upstream
    pairs with ``container``); it picks the recorded upstream interface (``line`` overrides). ``repo_mount``: the
    repository's path in the serving container, the one place besides the repository itself where an absolute path
    parameter may point. ``layout``: the repository's layout where the caller knows it (the package stage, which
    rendered it); else each layout's ``detect`` tells. ``engine`` False: a repository rendered without its build
    (:func:`check_model`)."""
    repo = Path(repo)
    if not repo.is_dir():
        raise UserError(f"{repo}: no such directory")
    if container and not trtllm_version:
        trtllm_version = upstream.trtllm_for(container)
    configs, dirs, parse_findings = load(repo)
    unparsed = bool(parse_findings)
    files, tree_dirs = tree_of(repo)
    findings = repository_problems(files, tree_dirs, lambda rel: (repo / rel).read_text(errors="replace"))
    lay = layouts.get(layout or layout_of(dirs))
    line = line or upstream.line_for(trtllm_version)
    recorded = lay.interface(line)
    reads = lay.reads(line)
    required = recorded if lay.required_models is None else lay.required_models
    # A config that does not parse leaves the layout unknown: its parse error is the finding, not every model the
    # guessed layout would then miss.
    for model in ([] if unparsed else recorded):
        if model not in configs and not any(f.startswith(f"{model}/") for f in findings):
            if model in required:
                owner = "upstream's" if lay.upstream else "the"
                findings.append(f"{model}/config.pbtxt: missing; {owner} {lay.name} layout has a \"{model}\" model")
    for name, cfg in configs.items():
        if name in recorded:
            findings += conformance(name, cfg, recorded[name], reads.get(name, {}),
                                    "upstream" if lay.upstream else f"the {lay.name} layout")
        if cfg.platform == "ensemble":
            continue  # checked against its steps by repository_problems
        else:
            findings += check_model(repo, name, cfg, dirs[name], trtllm_version, repo_mount, engine)
    return findings
