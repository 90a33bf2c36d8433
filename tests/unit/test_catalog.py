"""The catalog (the bottom floor's names) and the registries above it agree: the stage registry runs the catalog's
stages in its order, the layout registry loads the catalog's layouts, and the format registry's own copy of the SM and
runtime tuples (it is copied into model repositories, where it cannot import the catalog) is the catalog's."""
from __future__ import annotations

from pipeline import catalog, schema
from pipeline.formats import _base


def test_the_registries_above_read_the_catalogs_names():
    from pipeline.stages import STAGES
    from pipeline.triton import layouts

    assert tuple(s.name for s in STAGES) == catalog.STAGE_NAMES
    assert tuple(layouts.LAYOUTS) == catalog.layout_names()
    assert tuple(r.value for r in schema.RuntimeName) == catalog.RUNTIMES
    assert layouts.ENGINE_REL == catalog.ENGINE_REL and layouts.LLM_MODEL == catalog.LLM_MODEL


def test_the_format_registrys_copy_of_the_sm_and_runtime_tables_is_the_catalogs():
    assert _base.ALL_GPUS == catalog.ALL_GPUS and _base.BLACKWELL == catalog.BLACKWELL
    assert tuple(_base.RUNTIMES) == catalog.RUNTIMES and set(_base.ALL_RUNTIMES) == set(catalog.RUNTIMES)


def test_a_layout_folder_is_one_with_an_init_file(tmp_path, monkeypatch):
    """Negative control of the folder rule: a folder without ``__init__.py``, or named with a leading ``_`` or ``.``,
    is no layout; one with it is, in sorted order."""
    for name, init in (("zeta", True), ("alpha", True), ("_private", True), (".hidden", True), ("notes", False)):
        (tmp_path / name).mkdir()
        if init:
            (tmp_path / name / "__init__.py").write_text("")
    monkeypatch.setattr(catalog, "LAYOUTS_DIR", tmp_path)
    assert catalog.layout_names() == ("alpha", "zeta")
    (tmp_path / "zeta" / catalog.LAYOUT_INTERFACE).write_text("{}")
    assert catalog.nvidia_layouts() == ("alpha",)
