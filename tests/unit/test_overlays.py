"""Side environments are replaced whole or not at all, and a failed pip install is one line naming its purpose."""
from __future__ import annotations

import pytest

from pipeline import overlays
from pipeline.errors import UserError


def test_a_completed_block_replaces_the_old_directory(tmp_path):
    root = tmp_path / "env"
    (root / "old").mkdir(parents=True)
    with overlays.replacing(root) as tmp:
        (tmp / "new").write_text("x")
        assert not (root / "new").exists()  # nothing visible until the block completes
    assert sorted(p.name for p in root.iterdir()) == ["new"]
    assert not root.with_name("env.tmp").exists()


def test_a_failed_block_keeps_the_old_directory_and_leaves_no_temporary(tmp_path):
    root = tmp_path / "env"
    (root / "old").mkdir(parents=True)
    with pytest.raises(RuntimeError), overlays.replacing(root) as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("interrupted")
    assert sorted(p.name for p in root.iterdir()) == ["old"]
    assert not root.with_name("env.tmp").exists()


def test_a_failed_install_is_one_line_naming_what_it_was_for(tmp_path):
    empty = tmp_path / "wheelhouse"
    empty.mkdir()
    with pytest.raises(UserError) as exc:  # offline, from an empty wheelhouse: pip finds nothing
        overlays.pip_target("numpy>=2", tmp_path / "t", find_links=str(empty), purpose="the evaluation overlay")
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("could not install numpy>=2 for the evaluation overlay: ")
