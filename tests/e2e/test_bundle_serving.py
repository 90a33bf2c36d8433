"""A published bundle is served where it lands, on the real Triton server: from ``<dest>/.../latest``, from a copy
synced to another directory file by file (as ``aws s3 sync`` or an fsspec copy carries it: files only), and from an
S3 destination (moto's server mode, the real s3fs client) after download. Each one answers a generate request, and
``serve`` leaves no work directory behind. A bundle that lost its empty version directory fails with the server's
own reason in one line."""
from __future__ import annotations

import json
import shutil
import urllib.request
import uuid
from pathlib import Path

import pytest

from pipeline import bundle
from pipeline.identity import ArtifactKey
from tests.conftest import cli_env, run_cli
from tests.helpers.serving import Serve

pytestmark = pytest.mark.slow


def _local_bundle(tiny_build: Path) -> Path:
    return next(tiny_build.glob("bundles/*-publish-*/bundle.json")).parent


def _serve_and_ask(where: Path | str, tmp: Path) -> dict:
    """``pipeline serve WHERE``; one generate request to the ensemble; SIGINT. -> {"text": the generated text,
    "server": the server's own metadata (GET /v2)}. Asserts the clean stop and that the serve work directory is
    gone."""
    tmpdir = tmp / f"tmp-{uuid.uuid4().hex[:6]}"
    tmpdir.mkdir(parents=True)
    with Serve(where, "serve.openai.port=0", f"paths.root={tmp / 'root'}", cwd=tmp, env=cli_env(tmpdir)) as s:
        body = json.dumps({"text_input": "The capital of France is", "max_tokens": 4}).encode()
        req = urllib.request.Request(f"{s.http}/v2/models/ensemble/generate", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        with urllib.request.urlopen(f"{s.http}/v2", timeout=10) as r:
            meta = json.loads(r.read())
        assert s.stop() == 0
    assert list(tmpdir.glob("pipeline-serve-*")) == [], "serve left its work directory"
    assert isinstance(answer.get("text_output"), str)
    return {"text": answer["text_output"], "server": meta}


def _copy_files_only(src: Path, dst: Path) -> None:
    """What a file sync carries: every file, no directory of its own (an empty one is lost)."""
    for p in src.rglob("*"):
        if p.is_file():
            (dst / p.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, dst / p.relative_to(src))


def test_the_published_bundle_serves_from_latest_and_from_a_synced_copy(tiny_build, tmp_path):
    local = _local_bundle(tiny_build)
    # byte code a served model wrote; the package stage's empty ``__pycache__`` *file* (its block) belongs there
    litter = [p for p in local.rglob("__pycache__") if p.is_dir()] + list(local.rglob("*.pyc"))
    assert not litter, f"run-time litter in the bundle: {litter}"
    assert [p for p in local.rglob("__pycache__") if p.is_file() and p.stat().st_size == 0]
    out = bundle.publish(local, str(tmp_path / "published"), move_latest=True)
    base = Path(out["url"]).parent
    assert (base / "latest").is_file() and (base / "latest").read_text().strip() == Path(out["url"]).name
    assert (Path(out["url"]) / "triton_repo/ensemble/1").is_dir()
    served = _serve_and_ask(base, tmp_path)  # follows latest
    doc = json.loads((local / "bundle.json").read_text())
    # the recipe and the server it was benched on, as that server reports itself
    assert doc["served_by"]["name"] == served["server"]["name"] == "triton"
    assert doc["served_by"]["version"] == served["server"]["version"]
    assert doc["served_by"]["launcher"] == "local" and doc["served_by"]["binary"].endswith("tritonserver")
    assert set(doc["recipe"]) == {"fetch", "quantize", "build", "package", "bench", "eval_baseline", "evaluate", "publish"}
    assert doc["recipe"]["package"]["serve"]["torch_threads"] == 1
    moved = tmp_path / "elsewhere" / "bundle"
    _copy_files_only(Path(out["url"]), moved)
    checks = {n: ok for n, ok, _ in bundle.verify(str(moved))}
    assert checks["tree"] and checks["loadable"] and checks["checksums"], checks
    _serve_and_ask(moved, tmp_path)
    # serving leaves the bundle as it was: no byte code from the python models, the exact tree
    assert not [p for p in moved.rglob("__pycache__") if p.is_dir()], "serving wrote byte code into the bundle"
    checks = {n: ok for n, ok, _ in bundle.verify(str(moved))}
    assert checks["tree"] and checks["checksums"], checks
    # negative control: the byte code the python backend would write, had the block not been there, is seen by the
    # tree check
    litter = moved / "triton_repo" / "preprocessing" / "1" / "__pycache__"
    litter.unlink()
    litter.mkdir()
    (litter / "model.cpython-311.pyc").write_bytes(b"\0")
    assert not {n: ok for n, ok, _ in bundle.verify(str(moved))}["tree"]


def test_the_bundle_serves_after_an_s3_round_trip(tiny_build, tmp_path, monkeypatch):
    pytest.importorskip("s3fs", reason="pip install -e '.[test]' (s3fs, moto[server])")
    moto_server = pytest.importorskip("moto.server", reason="pip install 'moto[server]'")
    import fsspec
    import s3fs

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for k, v in {"AWS_ACCESS_KEY_ID": "AKIDTESTONLY", "AWS_SECRET_ACCESS_KEY": "test-only",
                     "AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(k, v)
        s3fs.S3FileSystem.clear_instance_cache()
        fs, _ = fsspec.core.url_to_fs("s3://bkt")
        fs.mkdir("bkt")
        local = _local_bundle(tiny_build)
        out = bundle.publish(local, "s3://bkt/published", move_latest=True)
        prefix = ArtifactKey.of_manifest(json.loads((local / "bundle.json").read_text())).publish_prefix
        version = fs.cat_file(f"bkt/published/{prefix}/latest").decode().strip()
        assert out["url"].endswith(version)
        fs.invalidate_cache()
        got = tmp_path / "downloaded"
        fs.get(f"bkt/published/{prefix}/{version}/", str(got), recursive=True)
        assert (got / "triton_repo/ensemble/1").is_dir()
        _serve_and_ask(got, tmp_path)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def test_a_bundle_without_its_version_directory_is_refused_before_triton_starts(tiny_build, tmp_path):
    """serve's preflight (lint's rules) names the model and Triton's own words for it, in one line."""
    copy = tmp_path / "bundle"
    _copy_files_only(_local_bundle(tiny_build), copy)
    shutil.rmtree(copy / "triton_repo/ensemble/1")
    proc = run_cli("serve", str(copy), "serve.openai.port=0", root=tmp_path / "root", env=cli_env(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and f"{copy}/triton_repo/ensemble/: no version directory" in err[0], proc.stderr
    assert "at least one version must be available" in err[0] and "HTTP" not in proc.stdout
    assert list(tmp_path.glob("pipeline-serve-*")) == []


def test_a_stray_file_in_a_bundle_is_refused_before_triton_starts(tiny_build, tmp_path):
    """serve's preflight applies `verify`'s exact-tree rule: a file the manifest does not list is named, in one line,
    and nothing is served. Control: the same copy without it passes `verify`'s tree check."""
    copy = tmp_path / "bundle"
    _copy_files_only(_local_bundle(tiny_build), copy)
    assert {n: ok for n, ok, _ in bundle.verify(str(copy))}["tree"]
    (copy / "triton_repo/preprocessing/1/helper.py").write_text("print('not listed')\n")
    proc = run_cli("serve", str(copy), "serve.openai.port=0", root=tmp_path / "root", env=cli_env(tmp_path),
                   timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "triton_repo/preprocessing/1/helper.py is not in the manifest" in err[0], proc.stderr
    assert "HTTP" not in proc.stdout
