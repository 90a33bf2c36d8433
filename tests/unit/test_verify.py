"""``verify``'s checksum comparison, in process, on a small local bundle (``tests/helpers/bundles.py``): every file
matches its recorded sha256, and each planted damage (a flipped byte, a truncated, missing or swapped file, a
manifest entry edited) fails the ``checksums`` check naming the file. A manifest that lists no files compares
nothing and must not pass."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from pipeline import bundle
from pipeline.bundle import remote, verifying
from pipeline.errors import UserError
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


def test_a_file_turned_into_a_directory_fails_naming_it(local):
    """A listed file replaced by a directory (byte code where the package stage's empty ``__pycache__`` file was)."""
    (local / CONFIG).unlink()
    (local / CONFIG).mkdir()
    (local / CONFIG / "x.pyc").write_bytes(b"\0")
    ok, msg = checks(local)["checksums"]
    assert ok is False and msg == f"{CONFIG} is a directory; the manifest lists a file"
    assert checks(local)["tree"][0] is False


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


# ------------------------------------------------------------------------------------ where verify finds the bundle
def test_a_bundle_is_found_from_its_directory_its_bundle_json_or_a_published_latest(local, tmp_path):
    assert checks(local / "bundle.json")["checksums"][0] is True
    base = tmp_path / "published"
    shutil.copytree(local, base / "v0123456789ab")
    (base / "latest").write_text("v0123456789ab\n")
    assert checks(base)["checksums"] == (True, f"{len(FILES)} files match their sha256")


def test_a_latest_naming_an_unfinished_version_and_a_directory_without_a_bundle_are_refused(tmp_path):
    base = tmp_path / "published"
    (base / "v1").mkdir(parents=True)
    (base / "latest").write_text("v1\n")
    with pytest.raises(UserError, match=r"latest names v1, which has no bundle.json \(its upload has not finished\)"):
        bundle.verify(str(base))
    with pytest.raises(UserError, match="no bundle.json there"):
        bundle.verify(str(base / "v1"))
    (base / "v1" / "bundle.json").write_text("{not json")
    with pytest.raises(UserError, match=r"bundle.json is not valid JSON \(damaged bundle\)"):
        bundle.verify(str(base / "v1"))


def test_a_manifest_off_the_schema_fails_the_manifest_check(local):
    rewrite_manifest(local / "bundle.json", lambda doc: doc.pop("lineage"))
    ok, msg = checks(local)["manifest"]
    assert ok is False and msg.startswith("bundle.json does not match the schema: "), msg


def test_an_unknown_container_is_refused_before_any_hashing(local):
    with pytest.raises(UserError, match=r"--container nvcr.io/x:1: not a recorded serving image; recorded: "):
        bundle.verify(str(local), container="nvcr.io/x:1")


def test_a_required_signature_that_is_absent_fails(local):
    got = {n: (ok, m) for n, ok, m in bundle.verify(str(local), require_signature=True)}
    assert got["signature"] == (False, "bundle is not signed (no bundle.sig) and a signature is required")
    assert checks(local)["signature"][0] is None  # not required: reported, not failed


# ------------------------------------------------------------------------------------------------ GPU and runtime
H200 = {"name": "NVIDIA H200", "sm": 90, "memory_gb": 150.0, "count": 1}


def _gpu_bundle(local: Path, runtime: str = "trtllm_llmapi", versions: dict | None = None) -> Path:
    def edit(doc):
        doc["target"] = {"name": "h200", "device": "cuda", "sm": 90}
        doc["runtime"] = {"name": runtime}
        doc["runtime_versions"] = versions if versions is not None else {"tensorrt_llm": "1.2.1",
                                                                         "tensorrt": "10.14.1.48"}
    rewrite_manifest(local / "bundle.json", edit)
    return local


@pytest.mark.parametrize("gpu, expected", [
    (None, (False, "bundle is for sm90 (h200); this machine has no GPU")),
    (H200, (True, "bundle sm90 = local NVIDIA H200 (sm90)")),
    ({**H200, "name": "NVIDIA B200", "sm": 100}, (False, "bundle sm90 ≠ local NVIDIA B200 (sm100)")),
])
def test_the_gpu_check_compares_the_bundles_sm_with_the_local_gpu(local, monkeypatch, gpu, expected):
    from pipeline import hardware

    monkeypatch.setattr(hardware, "local_gpu", lambda: gpu)
    assert checks(_gpu_bundle(local))["gpu"] == expected
    assert checks(local)["checksums"][0] is True  # the target edit went through bundle.json only


@pytest.mark.parametrize("installed, expected", [
    ((None, None), (False, "bundle needs TensorRT-LLM 1.2.1; none installed here (give --container TAG to check "
                           "against a serving image)")),
    (("1.2.1", "10.14.1.48"), (True, "bundle TensorRT-LLM 1.2.1/TensorRT 10.14.1.48; installed 1.2.1/10.14.1.48")),
    (("1.2.1", "10.13.3.9"), (False, "bundle TensorRT-LLM 1.2.1/TensorRT 10.14.1.48; installed 1.2.1/10.13.3.9")),
    (("1.1.0", "10.14.1.48"), (False, "bundle TensorRT-LLM 1.2.1/TensorRT 10.14.1.48; installed 1.1.0/10.14.1.48")),
])
def test_the_runtime_check_compares_the_installed_trtllm_and_tensorrt(local, monkeypatch, installed, expected):
    from pipeline import hardware
    from pipeline.runtime import trtllm

    monkeypatch.setattr(hardware, "local_gpu", lambda: H200)
    monkeypatch.setattr(trtllm, "detect", lambda: trtllm.TrtllmInfo(*installed, True, None))
    assert checks(_gpu_bundle(local))["runtime"] == expected


def test_a_bundle_recording_no_tensorrt_version_checks_trtllm_alone(local, monkeypatch):
    from pipeline import hardware
    from pipeline.runtime import trtllm

    monkeypatch.setattr(hardware, "local_gpu", lambda: H200)
    monkeypatch.setattr(trtllm, "detect", lambda: trtllm.TrtllmInfo("1.2.1", "10.0.0", True, None))
    ok, msg = checks(_gpu_bundle(local, versions={"tensorrt_llm": "1.2.1"}))["runtime"]
    assert ok is True and msg.startswith("bundle TensorRT-LLM 1.2.1/TensorRT None"), msg


def test_a_container_check_without_recorded_versions_cannot_pass():
    from pipeline import upstream

    image = next(iter(upstream.container_pairs()))
    want = upstream.container_pairs()[image]
    name, ok, msg = bundle.container_check({"container": "nvcr.io/unknown:1"}, image)
    assert name == "runtime" and ok is False and msg == (f"bundle records no TensorRT-LLM version; cannot check it against {image} "
                                   f"(TensorRT-LLM {want['trtllm']})")
    name, ok, msg = bundle.container_check({"tensorrt_llm": want["trtllm"]}, image)
    assert name == "runtime" and ok is True and msg == (f"bundle TensorRT-LLM {want['trtllm']}/TensorRT ?; {image} has {want['trtllm']}/"
                                  f"{want['tensorrt']}")


# -------------------------------------------------------------------------- republish: which files need uploading
def test_damaged_names_the_missing_resized_and_rehashed_files(local):
    import json

    import fsspec

    files = json.loads((local / "bundle.json").read_text())["files"]
    fs = fsspec.filesystem("file")
    assert remote._damaged(fs, str(local), files, local_dest=True) == []
    assert remote._damaged(fs, str(local), files, local_dest=False) == []
    (local / CONFIG).unlink()
    data = bytearray((local / MODEL).read_bytes())
    data[5] ^= 1  # same size, new modification time: hashed again
    (local / MODEL).write_bytes(bytes(data))
    bench = local / "reports" / "bench.json"
    bench.write_bytes(bench.read_bytes() + b" ")
    for local_dest in (True, False):
        got = [f["path"] for f in remote._damaged(fs, str(local), files, local_dest=local_dest)]
        assert got == [CONFIG, MODEL, "reports/bench.json"], (local_dest, got)


# ------------------------------------------------------------------------------------------- messages, exactly
def test_a_reference_cpu_bundle_says_why_no_gpu_or_trtllm_is_checked(local):
    got = checks(local)
    assert got["gpu"] == (None, "target cpu needs no GPU")
    assert got["runtime"] == (None, "reference runtime: no TensorRT-LLM needed")


def test_a_gpu_bundle_is_checked_against_the_given_container(local, monkeypatch):
    from pipeline import hardware, upstream

    monkeypatch.setattr(hardware, "local_gpu", lambda: H200)
    image = next(iter(upstream.container_pairs()))
    want = {"tensorrt_llm": "1.2.1", "tensorrt": "10.14.1.48"}
    got = {n: (ok, m) for n, ok, m in bundle.verify(str(_gpu_bundle(local, versions=want)), container=image)}
    _, ok, msg = bundle.container_check(want, image)
    assert got["runtime"] == (ok, msg)


def test_a_manifest_missing_its_sections_is_reported_not_crashed_on(local):
    def strip(doc):
        for key in ("target", "runtime", "runtime_versions", "files"):
            doc.pop(key)
    rewrite_manifest(local / "bundle.json", strip)
    got = checks(local)
    assert got["manifest"][0] is False and got["gpu"] == (None, "target None needs no GPU")
    assert got["checksums"] == (False, "bundle.json lists no files, so nothing was checked (a damaged or hand-made "
                                       "manifest)")


def test_the_schema_failure_quotes_the_first_line_of_the_validation_error(local):
    import json

    rewrite_manifest(local / "bundle.json", lambda doc: doc.pop("lineage"))
    try:
        bundle.BundleManifest.model_validate(json.loads((local / "bundle.json").read_text()))
    except Exception as exc:  # noqa: BLE001 - the message verify quotes
        first = str(exc).splitlines()[0]
    assert checks(local)["manifest"] == (False, f"bundle.json does not match the schema: {first}")


def test_every_damaged_file_is_named_with_both_digests(local):
    (local / CONFIG).unlink()
    _flip(local / MODEL, 0)
    ok, msg = checks(local)["checksums"]
    want = next(f for f in _files(local) if f["path"] == MODEL)["sha256"]
    got = hashlib.sha256((local / MODEL).read_bytes()).hexdigest()
    assert ok is False and msg == (f"{CONFIG} is missing; {MODEL} has sha256 {got[:12]}…, the manifest says "
                                   f"{want[:12]}…")


def _files(local: Path) -> list[dict]:
    import json

    return json.loads((local / "bundle.json").read_text())["files"]


def test_a_bundle_directory_with_a_stray_latest_is_verified_as_itself(local):
    (local / "latest").write_text("v-other\n")
    assert bundle.verify(str(local))  # its own bundle.json, not the version latest names


def test_an_unknown_container_names_every_recorded_one(local):
    from pipeline import upstream

    with pytest.raises(UserError) as err:
        bundle.verify(str(local), container="nvcr.io/x:1")
    assert str(err.value).endswith("recorded: " + ", ".join(upstream.container_pairs()))
    with pytest.raises(UserError) as err:
        bundle.container_check({}, "nvcr.io/x:1")
    assert str(err.value).endswith("recorded: " + ", ".join(upstream.container_pairs()))


def test_a_container_check_names_each_version_that_differs():
    from pipeline import upstream

    image, pair = next(iter(upstream.container_pairs().items()))
    _, ok, msg = bundle.container_check({"tensorrt_llm": "0.1.0", "tensorrt": "1.0"}, image)
    assert ok is False and msg.startswith(f"TensorRT-LLM 0.1.0 ≠ {pair['trtllm']}; TensorRT 1.0 ≠ {pair['tensorrt']} (")


@pytest.mark.parametrize("a, b, same", [("10.13.3", "10.13.3.9", True), ("10.13", "10.13.3.9", True),
                                        ("10.13.4", "10.13.3.9", False), ("10", "10.1", False),
                                        (None, "10.13", False), ("10.13", None, False), (None, None, False)])
def test_versions_compare_on_the_components_both_give(a, b, same):
    assert verifying._same_version(a, b) is same


def test_an_unchanged_local_file_is_trusted_by_size_and_time(local):
    """Locally, uploads keep each file's modification time: a file of the listed size and time is not hashed again
    (what makes a republish of a large bundle cheap); elsewhere every file is hashed."""
    import os

    import fsspec

    files = _files(local)
    path = local / MODEL
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    data[7] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    fs = fsspec.filesystem("file")
    assert remote._damaged(fs, str(local), files, local_dest=True) == []
    assert [f["path"] for f in remote._damaged(fs, str(local), files, local_dest=False)] == [MODEL]


def test_an_unreadable_destination_is_one_line_naming_it():
    with pytest.raises(UserError) as err:
        bundle.verify("nosuchproto://bucket/x")
    assert "nosuchproto://bucket/x" in str(err.value) and "\n" not in str(err.value)


def test_a_gpu_bundle_without_an_sm_does_not_match_any_gpu(local, monkeypatch):
    from pipeline import hardware

    monkeypatch.setattr(hardware, "local_gpu", lambda: H200)
    bundle = _gpu_bundle(local)
    rewrite_manifest(bundle / "bundle.json", lambda doc: doc["target"].pop("sm"))
    assert checks(bundle)["gpu"] == (False, "bundle smNone ≠ local NVIDIA H200 (sm90)")


def test_a_file_of_the_bundle_other_than_its_manifest_is_not_a_bundle(local):
    where = str(local / "reports" / "bench.json")
    with pytest.raises(UserError) as err:
        bundle.verify(where)
    assert str(err.value).startswith(f"{where}: ") and f"{where}/bundle.json" in str(err.value)  # not its folder's


def test_a_store_error_while_reading_names_the_bundle_and_what_failed(tmp_path):
    (tmp_path / "bundle.json").mkdir()  # read as a file: the filesystem's own error
    with pytest.raises(UserError) as err:
        bundle.verify(str(tmp_path))
    assert str(err.value).startswith(f"{tmp_path}: reading the bundle failed (IsADirectoryError")


def test_the_checksum_message_names_the_first_five_damaged_files(local):
    def edit(doc):
        doc["files"] += [{**doc["files"][0], "path": f"gone/{i}.bin"} for i in range(6)]

    rewrite_manifest(local / "bundle.json", edit)
    ok, message = checks(local)["checksums"]
    assert ok is False and message == "; ".join(f"gone/{i}.bin is missing" for i in range(5)), message


def test_a_local_bundle_may_hold_the_stage_stores_manifest(local):
    (local / "manifest.json").write_text("{}")  # the local stage store's own record, next to bundle.json
    assert checks(local)["tree"][0] is True
