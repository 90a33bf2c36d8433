"""``verify``'s checksum comparison, in process, on a small local bundle (``tests/helpers/bundles.py``): every file
matches its recorded sha256, and each planted damage (a flipped byte, a truncated, missing or swapped file, a
manifest entry edited) fails the ``checksums`` check naming the file. A manifest that lists no files compares
nothing and must not pass."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from pipeline import bundle
from tests.helpers.bundles import FILES, make_bundle, rewrite_manifest

MODEL = "checkpoint/model.safetensors"
CONFIG = "checkpoint/config.json"


def checks(where: Path) -> dict[str, tuple[bool | None, str]]:
    return {name: (ok, msg) for name, ok, msg in bundle.verify(str(where))}


@pytest.fixture
def local(tmp_path) -> Path:
    out = make_bundle(tmp_path)
    for p in out.rglob("*"):
        if p.is_file():
            p.chmod(0o644)
    return out


def test_an_untouched_bundle_passes_every_file(local):
    ok, msg = checks(local)["checksums"]
    assert ok is True and msg == f"{len(FILES)} files match their sha256"
    assert checks(local)["manifest"][0] is True


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("offset", [0, -1, 24 << 10])
def test_one_flipped_bit_anywhere_in_a_file_fails_naming_it(local, offset):
    _flip(local / MODEL, offset)
    ok, msg = checks(local)["checksums"]
    want = hashlib.sha256((local / MODEL).read_bytes()).hexdigest()
    assert ok is False and msg.startswith(f"{MODEL} has sha256 {want[:12]}…, the manifest says "), msg


def test_a_truncated_file_fails(local):
    (local / MODEL).write_bytes((local / MODEL).read_bytes()[:-1])
    ok, msg = checks(local)["checksums"]
    assert ok is False and msg.startswith(f"{MODEL} has sha256"), msg


def test_a_missing_file_fails_naming_it(local):
    (local / CONFIG).unlink()
    ok, msg = checks(local)["checksums"]
    assert ok is False and msg == f"{CONFIG} is missing"


def test_two_swapped_files_fail_naming_both(local):
    a, b = (local / CONFIG).read_bytes(), (local / MODEL).read_bytes()
    (local / CONFIG).write_bytes(b)
    (local / MODEL).write_bytes(a)
    ok, msg = checks(local)["checksums"]
    assert ok is False and [x.split(" ")[0] for x in msg.split("; ")] == [CONFIG, MODEL], msg


def test_an_edited_manifest_entry_fails(local):
    def edit(doc):
        entry = next(f for f in doc["files"] if f["path"] == CONFIG)
        entry["sha256"] = hashlib.sha256(b"something else").hexdigest()

    rewrite_manifest(local / "bundle.json", edit)
    ok, msg = checks(local)["checksums"]
    assert ok is False and msg.startswith(f"{CONFIG} has sha256 "), msg


def test_a_manifest_that_lists_no_files_does_not_pass(local):
    rewrite_manifest(local / "bundle.json", lambda doc: doc.update(files=[]))
    ok, msg = checks(local)["checksums"]
    assert ok is False and "lists no files" in msg, msg


def test_a_reference_bundle_needs_no_gpu_or_trtllm(local):
    got = checks(local)
    assert got["gpu"][0] is None and got["runtime"][0] is None
