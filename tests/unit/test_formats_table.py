"""The formats tables of README.md and docs/formats.md are the registry's (pipeline/formats/_table.py): the committed
ones match, and a planted edit, a stale row or missing markers are each named with the fix."""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import formats
from pipeline.formats import _table

ROOT = Path(__file__).resolve().parents[2]


def _copy(tmp_path: Path) -> Path:
    for rel in _table.TARGETS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp_path / rel)
    return tmp_path


def test_the_committed_tables_are_the_registrys():
    assert _table.stale() == []
    table = _table.render()
    for name, f in formats.FORMATS.items():  # every format is a row, with its facts
        assert f"| `{name}` |" in table and (f.quant_algo is None or f"`{f.quant_algo}`" in table)
    assert "| `nvfp4_awq` | NVFP4 (block 16), AWQ-lite / NVFP4 | `NVFP4_AWQ_LITE_CFG` | `NVFP4_AWQ` | " \
           "Blackwell (sm100/sm120) | LLM API (main) |" in table
    assert "| `int8_sq` |" in table and table.split("| `int8_sq` |")[1].split("\n")[0].endswith("| engine (1.2.x) |")


def test_a_planted_edit_of_a_committed_table_is_named(tmp_path):
    root = _copy(tmp_path)
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace("`NVFP4_AWQ` | Blackwell (sm100/sm120)", "`NVFP4_AWQ` | Hopper", 1))
    assert _table.stale(root) == ["README.md: the formats table differs from the registry (pipeline/formats/); run "
                                  "python -m pipeline.formats._table --write"]
    assert _table.write(root) == ["README.md"] and _table.stale(root) == []  # the fix the message names


def test_a_registry_change_makes_the_committed_tables_stale(tmp_path):
    changed = dict(formats.FORMATS)
    changed["fp8"] = dataclasses.replace(formats.FORMATS["fp8"], sm_needs="Hopper only")
    assert [p.split(":")[0] for p in _table.stale(ROOT, _table.render(changed))] == list(_table.TARGETS)


@pytest.mark.parametrize("text", ["no markers\n", f"{_table.END}\n{_table.START}\n",
                                  f"{_table.START}\n{_table.START}\n{_table.END}\n"])
def test_missing_or_misordered_markers_are_named(tmp_path, text):
    root = _copy(tmp_path)
    (root / "docs" / "formats.md").write_text(text)
    assert _table.stale(root) == [f"docs/formats.md: needs one '{_table.START}' line followed by one "
                                  f"'{_table.END}' line around the formats table"]


def test_the_cli_check_passes_on_the_committed_tables():
    ok = subprocess.run([sys.executable, "-m", "pipeline.formats._table", "--check"], cwd=ROOT, capture_output=True,
                        text=True)
    assert ok.returncode == 0 and ok.stdout.strip() == "tables up to date", ok.stderr
