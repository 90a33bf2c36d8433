"""``tools/wheelhouse.py``'s comparison with the project's virtual environment: a package resolved at another version
than the venv's is found (pip's silent backtracking past a version whose dependency is published as source only:
lm_eval 0.4.1 for 0.4.9), and the venv's own versions are read from it."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("wheelhouse_tool", ROOT / "tools" / "wheelhouse.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _item(name: str, version: str) -> dict:
    return {"metadata": {"name": name, "version": version}}


def test_a_backtracked_version_is_a_difference_and_equal_versions_are_not():
    wh = _tool()
    venv = {"lm-eval": "0.4.9", "hydra-core": "1.3.2", "numpy": "1.26.4"}
    items = [_item("lm_eval", "0.4.1"), _item("hydra-core", "1.3.2"), _item("numpy", "1.26.4"),
             _item("word2number", "1.1"), _item("llm-pipeline", "0.0.1")]
    assert wh.differences(items, venv) == {"lm-eval": ("0.4.1", "0.4.9")}
    # negative control: the same resolution at the venv's version has no difference
    assert wh.differences([_item("lm_eval", "0.4.9"), *items[1:]], venv) == {}
    # a newer version differs too (the wheelhouse carries what the tests ran with), and "1.3.2.0" is 1.3.2
    assert wh.differences([_item("numpy", "2.1.0"), _item("hydra-core", "1.3.2.0")], venv) == {
        "numpy": ("2.1.0", "1.26.4")}


def test_the_venvs_versions_are_read_from_its_own_python(tmp_path):
    wh = _tool()
    venv = Path(sys.prefix)  # the venv running the tests is the project's
    versions = wh.venv_versions(venv)
    import hydra
    import omegaconf

    assert versions["hydra-core"] == hydra.__version__ and versions["omegaconf"] == omegaconf.__version__
    assert wh.venv_versions(tmp_path) is None  # no Python there
