"""The project's own offline tasks: lm-eval task YAMLs with their data files, shipped in ``pipeline/eval/tasks``.

A task YAML names its data with ``dataset_path: json`` and ``dataset_kwargs.data_files`` relative to the YAML; lm-eval
hands ``data_files`` to ``datasets.load_dataset``, which resolves a relative path against the working directory, so
the YAMLs are copied into an include directory with those paths made absolute (:func:`include_dir`). The digest of
every shipped task file enters the evaluation stages' fingerprints (:func:`digests`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pipeline import store

TASKS_DIR = Path(__file__).resolve().parent / "tasks"


def builtin() -> list[str]:
    """The names of the shipped tasks (their YAMLs' ``task``)."""
    return sorted(yaml.safe_load(p.read_text())["task"] for p in TASKS_DIR.glob("*.yaml"))


def _yaml_of(name: str) -> Path | None:
    for p in sorted(TASKS_DIR.glob("*.yaml")):
        if yaml.safe_load(p.read_text()).get("task") == name:
            return p
    return None


def _data_files(doc: dict[str, Any]) -> dict[str, str]:
    files = (doc.get("dataset_kwargs") or {}).get("data_files") or {}
    return {files: files} if isinstance(files, str) else dict(files)


def files_of(names: list[str]) -> list[Path]:
    """The shipped files (YAML and data) of the tasks ``names`` that are the project's own."""
    out: list[Path] = []
    for name in names:
        y = _yaml_of(name)
        if y is None:
            continue
        out.append(y)
        out += [TASKS_DIR / f for f in _data_files(yaml.safe_load(y.read_text())).values()]
    return out


def digests(names: list[str]) -> dict[str, str]:
    """{file name: sha256} of the project's own task files among ``names`` (lm-eval's own tasks are identified by
    name and the lm-eval version)."""
    return {p.name: store.sha256_file(p) for p in files_of(names)}


def include_dir(dest: Path) -> Path:
    """Write every shipped task YAML into ``dest`` with its ``data_files`` as absolute paths; -> ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for p in sorted(TASKS_DIR.glob("*.yaml")):
        doc = yaml.safe_load(p.read_text())
        files = _data_files(doc)
        if files:
            doc.setdefault("dataset_kwargs", {})["data_files"] = {k: str((TASKS_DIR / v).resolve())
                                                                  for k, v in files.items()}
        (dest / p.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest
