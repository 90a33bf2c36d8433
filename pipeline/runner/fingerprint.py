"""A stage's fingerprint inputs that come from its code and its machine: the digest of its module's source and of
every package module it imports, found by walking the imports with ``ast`` (nothing is imported), and the capacity
fields it declares. The executor (``pipeline.runner.executor``) hashes these with the config slice, the inputs'
fingerprints and the library versions (``contract.lib_versions``).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import re
from pathlib import Path

from omegaconf import DictConfig

from pipeline import store
from pipeline.runner.contract import Stage

# Modules that cannot change what a stage writes (presentation, errors, orchestration of the stage loop): their
# source stays out of every code digest, and the import walk does not pass through them.
CODE_EXCLUDED = ("pipeline.ui", "pipeline.errors", "pipeline.report", "pipeline.cli", "pipeline.runner.contract",
                 "pipeline.runner.executor", "pipeline.runner.fingerprint")
PACKAGE_ROOT = Path(__file__).resolve().parents[2] # the directory holding the ``pipeline`` package
_MODULE_NAME = re.compile(r"pipeline(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _module_file(name: str, root: Path) -> Path | None:
    """The source file of module ``name`` of the ``pipeline`` package under ``root``, found without importing."""
    parts = name.split(".")
    if parts[0] != "pipeline":
        return None
    base = root.joinpath(*parts)
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _excluded(name: str) -> bool:
    return any(name == e or name.startswith(e + ".") for e in CODE_EXCLUDED)


_Import = tuple[int, str, tuple[str, ...]]  # (relative level, module, names imported from it)


@functools.lru_cache(maxsize=1024)
def _scan(path: Path, mtime_ns: int, size: int) -> tuple[str, tuple[_Import, ...], tuple[str, ...], bool]:
    """(sha256 of the source, its imports as (level, module, names), its string constants that look like module
    names, whether it discovers the modules of its package: it calls ``pkgutil.iter_modules`` and reads
    ``__path__``); cached by file identity."""
    text = path.read_bytes()
    tree = ast.parse(text, filename=str(path))
    imports: list[_Import] = []
    strings: list[str] = []
    lists = reads_path = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imports.extend((0, a.name, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imports.append((node.level, node.module or "", tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_NAME.fullmatch(node.value):
            strings.append(node.value)
        elif isinstance(node, ast.Call) and "iter_modules" in (getattr(node.func, "attr", None),
                                                               getattr(node.func, "id", None)):
            lists = True
        elif isinstance(node, ast.Name) and node.id == "__path__":
            reads_path = True
    return hashlib.sha256(text).hexdigest(), tuple(imports), tuple(strings), lists and reads_path


def _imports_of(name: str, path: Path, root: Path) -> set[str]:
    """The ``pipeline`` modules module ``name`` (at ``path``) names: its imports, at any level of the file (function
    bodies included), module names written as strings (``python -m pipeline.x`` children, ``find_spec``
    lookups of files it copies), and, for a package that discovers its modules at import (``pkgutil.iter_modules``
    over its ``__path__``: the format registry), every module of its directory."""
    st = path.stat()
    _, imports, strings, discovers = _scan(path, st.st_mtime_ns, st.st_size)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set(strings)
    if discovers and path.name == "__init__.py":
        found.update(f"{name}.{p.stem}" for p in path.parent.glob("*.py") if p.name != "__init__.py")
        found.update(f"{name}.{p.parent.name}" for p in path.parent.glob("*/__init__.py"))
    for level, module, names in imports:
        if level:  # relative: from .x import y / from .. import y
            base = ".".join(package.split(".")[: len(package.split(".")) - level + 1])
            module = f"{base}.{module}" if module else base
        if not names:
            found.add(module)
            continue
        for n in names:  # ``from pkg import mod`` names the module; ``from mod import attr`` the module itself
            found.add(f"{module}.{n}" if _module_file(f"{module}.{n}", root) else module)
    return {m for m in found if not _excluded(m) and _module_file(m, root) is not None}


def code_modules(module: str, path: Path, root: Path = PACKAGE_ROOT) -> dict[str, Path]:
    """``module`` (source at ``path``) and every ``pipeline`` module it imports, transitively, parsed with ``ast``
    (nothing is imported), without :data:`CODE_EXCLUDED`."""
    seen = {module: path}
    todo = [module]
    while todo:
        name = todo.pop()
        for dep in _imports_of(name, seen[name], root):
            if dep not in seen:
                seen[dep] = _module_file(dep, root)  # type: ignore[assignment]
                todo.append(dep)
    return seen


def code_digest(module: str, path: Path, root: Path = PACKAGE_ROOT) -> str:
    """The digest of the source of ``module`` and of every package module it imports (:func:`code_modules`)."""
    mods = code_modules(module, path, root)
    srcs = []
    for name in sorted(mods):
        st = mods[name].stat()
        srcs.append((name, _scan(mods[name], st.st_mtime_ns, st.st_size)[0]))
    return store.digest(srcs)


def stage_code_digest(stage: Stage) -> str:
    """A stage's code: its module and the package modules it imports, transitively (plan must stay cheap: the source
    is hashed, never imported)."""
    name = stage.run.__module__
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        raise RuntimeError(f"stage {stage.name}: module {name} not found")
    return code_digest(name, Path(spec.origin))


def capacity_fields(cfg: DictConfig, st: Stage) -> tuple[str, ...]:
    """The fields of the resolved capacity plan stage ``st`` declares for ``cfg``."""
    return tuple(st.capacity(cfg) if callable(st.capacity) else st.capacity)
