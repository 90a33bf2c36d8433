"""The store's atomic directory swap."""
from __future__ import annotations

from pipeline import store


def test_commit_dir_swaps_atomically(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old").write_text("1")
    tmp = store.new_tmp_dir(final)
    (tmp / "new").write_text("2")
    store.commit_dir(tmp, final)
    assert [p.name for p in final.iterdir()] == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
