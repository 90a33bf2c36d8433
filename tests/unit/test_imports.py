"""The import rules of the ``pipeline`` package, read from the source (nothing imported): nothing below the CLI imports
``pipeline.cli``, no import cycle joins the package's modules, no arrow runs back up the floors that ``pyproject.toml``
lists (import-linter's layers contract), no layout imports the OpenAI front end (a forbidden contract: both sides build
on ``pipeline.triton.layouts.contract``) and no stage imports another. Every import statement counts: at module level,
inside a function, or under ``if TYPE_CHECKING:``."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pipeline

PACKAGE = Path(pipeline.__file__).parent


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file of the package at ``root`` (``__init__.py`` names
    its package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _target(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` imports: itself, else its longest prefix that is a module of the package."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports. ``from a.b import c`` is an edge to ``a.b.c`` when that is a module,
    else to ``a.b``; relative imports are resolved against the importing module's package. A parent package is not
    counted as imported by its submodules' imports (its ``__init__`` importing them would otherwise be a cycle)."""
    known = modules(root)
    graph: dict[str, set[str]] = {m: set() for m in known}
    for mod, path in known.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for name in names:
                target = _target(name, known)
                if target is not None and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) for each strongly connected group of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    found = []
    for group in groups:  # a shortest path back to the group's first module, through the group only
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in {w for v in frontier for w in graph[v]}:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & group):
                    if w not in paths:
                        paths[w] = [*paths[v], w]
                        nxt.append(w)
            frontier = nxt
        last = min(v for v in frontier if start in graph[v])
        found.append([*paths[last], start])
    return sorted(found)


def cli_importers(graph: dict[str, set[str]], cli: str) -> list[str]:
    """Modules outside ``cli`` (and its submodules) that import it or one of its submodules."""
    inside = lambda m: m == cli or m.startswith(cli + ".")  # noqa: E731
    return sorted(m for m, targets in graph.items() if not inside(m) and any(inside(t) for t in targets))


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "planted"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_nothing_below_the_cli_imports_it():
    graph = import_graph(PACKAGE)
    assert "pipeline.cli" in graph and "pipeline.runner" in graph, sorted(graph)
    assert cli_importers(graph, "pipeline.cli") == ["pipeline.__main__"]  # the entry point, above the CLI


def test_no_import_cycle_among_the_package_modules():
    found = cycles(import_graph(PACKAGE))
    assert found == [], "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_graph_finds_a_planted_cycle_and_a_planted_cli_import(tmp_path):
    """Negative control: a planted package whose ``a`` imports ``b`` at module level and ``b`` imports ``a`` inside a
    function (relatively), and whose ``core`` imports its ``cli`` inside a function; both are reported."""
    root = _plant(tmp_path, {
        "__init__.py": "",
        "a.py": "from planted import b\n",
        "sub/__init__.py": "from planted.sub import c\n",  # a package importing its submodule: no cycle
        "sub/c.py": "import os\n\ndef f():\n    from .. import a\n    from . import d\n",
        "sub/d.py": "",
        "b.py": "def f():\n    from .sub import c\n",
        "core.py": "def main():\n    from planted.cli.verbs import run\n",
        "cli/__init__.py": "from planted import core\n",
        "cli/verbs.py": "run = 1\n",
    })
    graph = import_graph(root)
    assert graph["planted.a"] == {"planted.b"} and graph["planted.b"] == {"planted.sub.c"}
    assert graph["planted.sub.c"] == {"planted.a", "planted.sub.d"} and graph["planted.sub"] == {"planted.sub.c"}
    assert cycles(graph) == [["planted.a", "planted.b", "planted.sub.c", "planted.a"]]
    assert cli_importers(graph, "planted.cli") == ["planted.core"]


def test_the_graph_reports_nothing_for_a_planted_acyclic_package(tmp_path):
    """The control's counterpart: the same shapes without the back edges report no cycle and no CLI importer."""
    root = _plant(tmp_path, {
        "__init__.py": "",
        "a.py": "from planted import b\n",
        "b.py": "def f():\n    from .sub import c\n",
        "sub/__init__.py": "from planted.sub import c\n",
        "sub/c.py": "import json\n",
        "cli/__init__.py": "from planted import a\n",
    })
    graph = import_graph(root)
    assert graph["planted.cli"] == {"planted.a"} and graph["planted.b"] == {"planted.sub.c"}
    assert cycles(graph) == []
    assert cli_importers(graph, "planted.cli") == []


ROOT = PACKAGE.parent


def _lint_imports(config: Path) -> tuple[int, str]:
    """import-linter's ``lint-imports`` on ``config`` -> (exit status, its report)."""
    import contextlib
    import io

    from importlinter.cli import lint_imports

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = lint_imports(config_filename=str(config), no_cache=True)
    return code, out.getvalue()


def test_no_arrow_runs_back_up_the_floors_and_no_stage_imports_another():
    code, report = _lint_imports(ROOT / "pyproject.toml")
    assert code == 0, report
    assert "3 kept, 0 broken" in report, report
    assert "No layout imports the front end" in report, report


def test_the_floor_contract_sees_a_planted_upward_import(tmp_path, monkeypatch):
    """Negative control: a planted package whose bottom floor imports its top one, inside a function, and whose two
    stages import each other; the same contracts, on it, are broken and name both arrows."""
    root = _plant(tmp_path, {
        "__init__.py": "",
        "cli.py": "from planted import core\n",
        "core.py": "def f():\n    from planted import cli\n",
        "stages/__init__.py": "",
        "stages/a.py": "from planted.stages import b\n",
        "stages/b.py": "",
    })
    (tmp_path / "lint.toml").write_text(
        '[tool.importlinter]\nroot_package = "planted"\n\n'
        '[[tool.importlinter.contracts]]\nname = "floors"\ntype = "layers"\nlayers = ["planted.cli", "planted.core"]\n\n'
        '[[tool.importlinter.contracts]]\nname = "stages"\ntype = "independence"\n'
        'modules = ["planted.stages.a", "planted.stages.b"]\n')
    monkeypatch.syspath_prepend(str(root.parent))
    code, report = _lint_imports(tmp_path / "lint.toml")
    assert code != 0 and "0 kept, 2 broken" in report, report
    assert "planted.core -> planted.cli" in report and "planted.stages.a -> planted.stages.b" in report, report


# the project's own contract that keeps the layouts off the front end, read from pyproject.toml
def _layout_contract() -> str:
    import tomllib

    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in doc["tool"]["importlinter"]["contracts"] if c["type"] == "forbidden"]
    assert contract["source_modules"] == ["pipeline.triton.layouts"], contract
    assert contract["forbidden_modules"] == ["pipeline.serving"], contract
    return contract["name"]


def _layout_package(tmp_path: Path, codec: str) -> Path:
    """A planted package shaped like this one: the front end importing a layout at module level, and a layout codec
    whose source is ``codec``."""
    return _plant(tmp_path, {
        "__init__.py": "",
        "serving/__init__.py": "",
        "serving/driver.py": "from planted.triton.layouts.ifb import openai_codec\n",
        "serving/protocol.py": "",
        "triton/__init__.py": "",
        "triton/layouts/__init__.py": "",
        "triton/layouts/contract.py": "class APIError(Exception):\n    pass\n",
        "triton/layouts/ifb/__init__.py": "",
        "triton/layouts/ifb/openai_codec.py": codec,
    })


@pytest.mark.parametrize("codec, broken", [
    ("from planted.triton.layouts.contract import APIError\n", False),
    ("def call():\n    from planted.serving.protocol import APIError\n", True),  # the planted import the other way
])
def test_the_layout_contract_sees_a_planted_import_of_the_front_end(tmp_path, monkeypatch, codec, broken):
    """Negative control: the project's own forbidden contract (its name and modules read from ``pyproject.toml``), on a
    planted package of the same shape, keeps a layout codec that imports the contract and breaks on one that imports
    the front end (inside a function), naming that import."""
    name = _layout_contract()
    root = _layout_package(tmp_path, codec)
    (tmp_path / "lint.toml").write_text(
        '[tool.importlinter]\nroot_package = "planted"\n\n'
        f'[[tool.importlinter.contracts]]\nname = "{name}"\ntype = "forbidden"\n'
        'source_modules = ["planted.triton.layouts"]\nforbidden_modules = ["planted.serving"]\n')
    monkeypatch.syspath_prepend(str(root.parent))
    code, report = _lint_imports(tmp_path / "lint.toml")
    if broken:
        assert code != 0 and "0 kept, 1 broken" in report, report
        assert "planted.triton.layouts.ifb.openai_codec -> planted.serving.protocol" in report, report
    else:
        assert code == 0 and "1 kept, 0 broken" in report, report
