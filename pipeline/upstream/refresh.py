"""Verify or refresh the recorded interface against an upstream checkout, or against an installed ``tensorrt_llm``.

``python -m pipeline.upstream verify --checkout PATH [--line 1.2.1] [--layout inflight_batcher_llm]``
    parses every ``<layout>/<model>/config.pbtxt`` under PATH (a TensorRT-LLM checkout, its ``triton_backend``, a
    tensorrtllm_backend checkout, or an ``all_models`` folder) and prints one line per difference from the record;
    exit status 1 when there is any.
``python -m pipeline.upstream refresh --checkout PATH --line L --layout X --commit SHA [--repo OWNER/NAME]``
    rewrites that layout's models in the record from the checkout (hand-recorded parts, the parameters each
    backend reads and the build surface, are kept).
``python -m pipeline.upstream containers``
    prints every recorded serving image with each figure and the page, file and commit it was read from.
``python -m pipeline.upstream rules``
    prints TensorRT-LLM's build and load rules the plan applies (``rules.yaml``), each with its upstream source.
``python -m pipeline.upstream refresh --matrix PATH --commit SHA``
    re-reads the ``trtllm-python-py3`` table of NVIDIA's compatibility matrix (``docs/introduction/compatibility.md``
    of a triton-inference-server/server checkout, at commit SHA) into ``containers.yaml``: the matrix's figures of
    every recorded tag are replaced, new tags from 24.12 on are added (their ``triton`` and ``min_driver`` unknown
    until recorded by hand), and each difference is printed.
``python -m pipeline.upstream verify --installed [--line L]``
    compares the recorded ``BuildConfig`` fields, ``trtllm-build`` flags and LLM-API argument names with the
    installed ``tensorrt_llm`` (needs TensorRT-LLM; refuses with the reason otherwise).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from pipeline import upstream
from pipeline.errors import UserError
from pipeline.upstream.pbtxt import parse_template

TENSOR_KEYS = ("data_type", "dims", "optional", "reshape", "allow_ragged_batch")


def find_layout_dir(checkout: Path, layout: str) -> Path:
    for cand in (checkout / "all_models" / layout, checkout / "triton_backend" / "all_models" / layout,
                 checkout / layout):
        if cand.is_dir() and any(cand.glob("*/config.pbtxt")):
            return cand
    raise UserError(f"{checkout}: no {layout}/ (looked in ., all_models/, triton_backend/all_models/); give an "
                    f"upstream checkout of TensorRT-LLM or tensorrtllm_backend")


def parse_checkout(checkout: Path, layout: str) -> dict[str, dict[str, Any]]:
    """``{model: parsed config}`` for every model folder of ``layout`` in the checkout."""
    root = find_layout_dir(Path(checkout), layout)
    out = {}
    for f in sorted(root.glob("*/config.pbtxt")):
        out[f.parent.name] = parse_template(f.read_text(), name=str(f))
    if not out:
        raise UserError(f"{root}: no */config.pbtxt")
    return out


def _by_name(tensors: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in tensors}


def _norm(t: dict[str, Any]) -> dict[str, Any]:
    return {k: t.get(k, False if k in ("optional", "allow_ragged_batch") else None) for k in TENSOR_KEYS}


def diff_model(where: str, recorded: dict[str, Any], found: dict[str, Any]) -> list[str]:
    """One line per difference between a recorded model and one parsed from upstream."""
    out = []
    for kind in ("inputs", "outputs"):
        rec, got = _by_name(recorded.get(kind, [])), _by_name(found.get(kind, []))
        for name in sorted(got.keys() - rec.keys()):
            out.append(f"{where}: upstream {kind[:-1]} {name!r} is not recorded")
        for name in sorted(rec.keys() - got.keys()):
            out.append(f"{where}: recorded {kind[:-1]} {name!r} is not upstream")
        for name in sorted(rec.keys() & got.keys()):
            a, b = _norm(rec[name]), _norm(got[name])
            if kind == "outputs":
                for k in ("optional", "allow_ragged_batch"):
                    a.pop(k), b.pop(k)
            for k in a:
                if a[k] != b[k]:
                    out.append(f"{where}: {kind[:-1]} {name!r} {k} recorded {a[k]!r}, upstream {b[k]!r}")
    rec_p, got_p = set(recorded.get("parameters", {})), set(found.get("parameters", {}))
    out += [f"{where}: upstream parameter {k!r} is not recorded" for k in sorted(got_p - rec_p)]
    out += [f"{where}: recorded parameter {k!r} is not upstream" for k in sorted(rec_p - got_p)]
    for key in ("platform", "backend", "max_batch_size", "decoupled", "instance_group", "dynamic_batching"):
        if recorded.get(key) != found.get(key):
            out.append(f"{where}: {key} recorded {recorded.get(key)!r}, upstream {found.get(key)!r}")
    rec_s, got_s = recorded.get("steps") or [], found.get("steps") or []
    if [s["model_name"] for s in rec_s] != [s["model_name"] for s in got_s]:
        out.append(f"{where}: steps recorded {[s['model_name'] for s in rec_s]}, "
                   f"upstream {[s['model_name'] for s in got_s]}")
    else:
        for a, b in zip(rec_s, got_s):
            for m in ("input_map", "output_map"):
                for k in sorted(set(a[m]) | set(b[m])):
                    if a[m].get(k) != b[m].get(k):
                        out.append(f"{where}: step {a['model_name']} {m}[{k!r}] recorded {a[m].get(k)!r}, "
                                   f"upstream {b[m].get(k)!r}")
    return out


def verify_checkout(checkout: Path, line: str, layouts: list[str] | None = None) -> list[str]:
    rec = upstream.record(line)
    out = []
    for layout in layouts or list(rec["layouts"]):
        found = parse_checkout(checkout, layout)
        recorded = rec["layouts"][layout]
        for model in sorted(set(recorded) | set(found)):
            if model not in found:
                out.append(f"{layout}/{model}: recorded, but the checkout has no {layout}/{model}/config.pbtxt")
            elif model not in recorded:
                continue  # upstream ships more models (multimodal encoders, ...) than the layout uses
            else:
                out += diff_model(f"{layout}/{model}", recorded[model], found[model])
    return out


def refresh_checkout(checkout: Path, line: str, layout: str, commit: str, repo: str = "NVIDIA/TensorRT-LLM",
                     root: str = "triton_backend/all_models") -> Path:
    path = upstream.DATA / upstream.record_file(line)
    doc = yaml.safe_load(path.read_text())
    found = parse_checkout(checkout, layout)
    models = doc["layouts"].setdefault(layout, {})
    for name in list(models) or sorted(found):
        if name not in found:
            raise UserError(f"{checkout}: the checkout lacks {layout}/{name}/config.pbtxt")
        models[name] = {"source": {"repo": repo, "commit": commit, "path": f"{root}/{layout}/{name}/config.pbtxt"},
                        **found[name]}
    path.write_text(dump(doc))
    return path


MATRIX_COLUMNS = ("tag", "image", "python", "torch", "tensorrt", "trtllm", "cuda", "cuda_driver", "size")
FIRST_TAG = (24, 12)


def parse_matrix(text: str) -> dict[str, dict[str, str]]:
    """``{image: {column: value}}`` from the ``trtllm-python-py3`` table of NVIDIA's compatibility matrix (Markdown).
    Refuses a table whose header is not the nine columns this record reads."""
    if "## Container Name: trtllm-python-py3" not in text:
        raise UserError("no 'Container Name: trtllm-python-py3' section: not NVIDIA's compatibility matrix")
    sec = text.split("## Container Name: trtllm-python-py3", 1)[1].split("## Container Name:", 1)[0]
    lines = [ln for ln in sec.splitlines() if ln.strip().startswith("|")]
    if not lines:
        raise UserError("the trtllm-python-py3 section has no table")
    header = [c.strip().lower() for c in lines[0].strip().strip("|").split("|")]
    want = ["triton release version", "ngc tag", "python version", "torch version", "tensorrt version",
            "tensorrt-llm version", "cuda version", "cuda driver version", "size"]
    if header != want:
        raise UserError(f"the trtllm-python-py3 table's columns are {header}, expected {want}; the matrix changed "
                        f"shape: update MATRIX_COLUMNS")
    out = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if len(cells) != len(MATRIX_COLUMNS):
            raise UserError(f"matrix row {ln.strip()!r} has {len(cells)} cells, expected {len(MATRIX_COLUMNS)}")
        row = dict(zip(MATRIX_COLUMNS, cells))
        row["python"] = row["python"].removeprefix("Python ").strip()
        out[row["image"]] = row
    return out


def refresh_containers(matrix: Path, commit: str) -> tuple[Path, list[str]]:
    """Rewrite the matrix's figures in ``containers.yaml`` from a compatibility.md; returns the file and one line
    per figure that changed or tag that was added."""
    rows = parse_matrix(Path(matrix).read_text())
    path = upstream.DATA / "containers.yaml"
    doc = yaml.safe_load(path.read_text())
    changes = []
    for image, row in rows.items():
        y, m = (int(p) for p in row["tag"].split("."))
        if (y, m) < FIRST_TAG:
            continue
        entry = doc["pairs"].setdefault(image, {"tag": row["tag"], "triton": None, "min_driver": None})
        if "trtllm" not in entry:
            changes.append(f"{image}: new tag (triton and min_driver unknown until recorded)")
        for k in ("trtllm", "tensorrt", "cuda", "torch", "python", "cuda_driver"):
            if str(entry.get(k)) != row[k]:
                if k in entry:
                    changes.append(f"{image}: {k} {entry.get(k)} -> {row[k]}")
                entry[k] = row[k]
    for image in sorted(set(doc["pairs"]) - set(rows)):
        changes.append(f"{image}: recorded, but not in the matrix (kept)")
    doc["source"]["matrix"]["commit"] = commit
    doc["pairs"] = dict(sorted(doc["pairs"].items(), key=lambda kv: upstream._tag_key(kv[0]), reverse=True))
    path.write_text(yaml.safe_dump(doc, sort_keys=False, width=120))
    return path, changes


def show_containers() -> str:
    lines = []
    for image, figs in upstream.container_pairs().items():
        src = upstream.container_source(image)
        lines.append(image)
        for k in upstream.FIGURES:
            lines.append(f"  {k:<12} {figs[k] if figs[k] is not None else 'unknown':<30} {src[k]}")
    return "\n".join(lines)


def verify_installed(line: str) -> list[str]:
    """Recorded build surface vs the installed tensorrt_llm."""
    try:
        import tensorrt_llm  # noqa: F401
    except ImportError as exc:
        raise UserError(f"tensorrt_llm is not installed here ({exc}); run this in NVIDIA's TensorRT-LLM container")
    build = upstream.record(line).get("build") or {}
    out = []
    import dataclasses

    if build.get("build_config_fields"):
        from tensorrt_llm.builder import BuildConfig

        have = ({f.name for f in dataclasses.fields(BuildConfig)} if dataclasses.is_dataclass(BuildConfig)
                else set(getattr(BuildConfig, "model_fields", {})))
        out += [f"BuildConfig has no field {f!r}" for f in build["build_config_fields"] if f not in have]
    if build.get("trtllm_build_flags"):
        from tensorrt_llm.commands.build import parse_arguments

        flags = {s for a in parse_arguments()._actions for s in a.option_strings}
        out += [f"trtllm-build has no flag {f}" for f in build["trtllm_build_flags"] if f not in flags]
    if build.get("llm_args"):
        from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

        have = set(TorchLlmArgs.model_fields)
        out += [f"LLM-API (TorchLlmArgs) has no argument {a!r}" for a in build["llm_args"] if a not in have]
    import tensorrt_llm as t

    if str(t.__version__) != str(upstream.record(line).get("trtllm")) and line != "main":
        out.append(f"installed tensorrt_llm is {t.__version__}, the record is for {line}")
    return out


class _Flow(list):
    pass


def _flow_repr(dumper, data):
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


class _FlowMap(dict):
    pass


def _flowmap_repr(dumper, data):
    return dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=True)


def dump(doc: dict[str, Any]) -> str:
    """YAML with one line per tensor (``- {name: ..., data_type: ..., dims: [...], optional: ...}``)."""
    class D(yaml.SafeDumper):
        pass

    D.add_representer(_Flow, _flow_repr)
    D.add_representer(_FlowMap, _flowmap_repr)

    def walk(x, key=None):
        if isinstance(x, dict):
            if "name" in x and "data_type" in x:
                return _FlowMap({k: (_Flow(v) if isinstance(v, list) else v) for k, v in x.items()})
            return {k: walk(v, k) for k, v in x.items()}
        if isinstance(x, list):
            items = [walk(v) for v in x]
            if all(not isinstance(v, (dict, list)) for v in x):
                return _Flow(items)
            return items
        return x

    return yaml.dump(walk(doc), Dumper=D, sort_keys=False, width=120)


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m pipeline.upstream")
    p.add_argument("verb", choices=("verify", "refresh", "show", "containers", "rules"))
    p.add_argument("--matrix")
    p.add_argument("--checkout")
    p.add_argument("--installed", action="store_true")
    p.add_argument("--line", default="1.2.1")
    p.add_argument("--layout", action="append")
    p.add_argument("--commit")
    p.add_argument("--repo", default="NVIDIA/TensorRT-LLM")
    p.add_argument("--root", default="triton_backend/all_models")
    a = p.parse_args(argv)
    try:
        if a.verb == "show":
            print(dump(upstream.record(a.line)), end="")
            return 0
        if a.verb == "verify":
            if a.installed:
                findings = verify_installed(a.line)
            elif a.checkout:
                findings = verify_checkout(Path(a.checkout), a.line, a.layout)
            else:
                raise UserError("verify needs --checkout PATH or --installed")
            for f in findings:
                print(f)
            print(f"{len(findings)} difference(s) from the record for TensorRT-LLM {a.line}")
            return 1 if findings else 0
        if a.verb == "rules":
            from pipeline.upstream import rules

            print(rules.describe())
            return 0
        if a.verb == "containers":
            print(show_containers())
            return 0
        if a.matrix:
            if not a.commit:
                raise UserError("refresh --matrix needs --commit SHA (the server commit the file was read at)")
            path, changes = refresh_containers(Path(a.matrix), a.commit)
            for c in changes:
                print(c)
            print(f"{path}: {len(changes)} change(s)")
            return 0
        if not (a.checkout and a.commit and a.layout):
            raise UserError("refresh needs --checkout PATH --layout NAME --commit SHA")
        for layout in a.layout:
            print(refresh_checkout(Path(a.checkout), a.line, layout, a.commit, a.repo, a.root))
        return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
