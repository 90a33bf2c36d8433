"""tools/mutation.py's scope stays true to the code: every module it mutates exists, every function pattern names
functions of that module (a renamed check would otherwise drop out of the score unnoticed), every test file exists,
and every equivalent survivor recorded in tools/mutation_equivalent.yaml names a module in scope and says why."""
from __future__ import annotations

import ast
import fnmatch
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("mutation_tool", REPO / "tools" / "mutation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TOOL = _tool()


def mutmut_names(path: Path) -> set[str]:
    """The names mutmut gives a module's functions: ``x_<function>``, ``xǁ<Class>ǁ<method>``."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(f"x_{node.name}")
        elif isinstance(node, ast.ClassDef):
            names |= {f"xǁ{node.name}ǁ{f.name}" for f in node.body
                      if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


@pytest.mark.parametrize("key", list(TOOL.MODULES))
def test_every_module_function_and_test_in_scope_exists(key):
    m = TOOL.MODULES[key]
    path = REPO / m["path"]
    assert path.is_file(), m["path"]
    names = mutmut_names(path)
    for pattern in m["functions"]:
        assert fnmatch.filter(names, pattern), f"{key}: {pattern} matches no function of {m['path']}"
    for test in m["tests"]:
        assert (REPO / test).is_file(), test


def test_equivalent_survivors_name_a_module_in_scope_and_a_reason():
    stems = {TOOL.mutant_stem(m["path"]): key for key, m in TOOL.MODULES.items()}
    for name, entry in TOOL._load_equivalent().items():
        stem = name.rsplit(".", 1)[0]
        assert stem in stems, f"{name}: not a module tools/mutation.py mutates"
        assert entry.get("line") and len(entry.get("reason", "")) > 20, name
