"""Which tritonserver ``serve.launcher=local`` starts, the refusal where the bundled one cannot serve, and the one
readiness wait every launcher uses.

A fake ``tritonserver`` script on PATH stands in for the binary of NVIDIA's Triton containers in the discovery tests
only (lookup order); nothing is started. The numpy check reads package metadata, with planted stub environments."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.triton import server, stubenv


def _fake_tritonserver(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / "tritonserver"
    p.write_text("#!/bin/sh\nexit 0\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return p


def test_a_tritonserver_on_path_wins_over_the_bundled_one(tmp_path, monkeypatch):
    fake = _fake_tritonserver(tmp_path / "ngc" / "bin")
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}/usr/bin:/bin")
    assert server.find_server(None) == (fake, False)


def test_without_one_on_path_the_bundled_server_is_used(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # negative control of the test above: no fake on PATH
    binary, bundled = server.find_server(None)
    assert bundled and binary.parts[-3:] == ("tritonserver", "bin", "tritonserver")


def test_serve_server_bin_wins_over_path(tmp_path, monkeypatch):
    on_path = _fake_tritonserver(tmp_path / "a")
    given = _fake_tritonserver(tmp_path / "b")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert server.find_server(str(given)) == (given.resolve(), False)


def test_no_server_anywhere_names_the_extra(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(server, "_pytriton_root", lambda: None)
    with pytest.raises(UserError, match=r"pip install -e '\.\[cpu-server\]'"):
        server.find_server(None)


@pytest.mark.parametrize("env_numpy,stub_numpy,refused", [
    ("1.26.4", None, False), ("2.5.2", None, True), ("2.5.2", "1.26.4", False), ("2.5.2", "2.1.0", True),
    (None, None, False)])
def test_the_bundled_server_under_numpy_2_needs_a_stub_env(env_numpy, stub_numpy, refused):
    problem = server.bundled_numpy_problem(env_numpy, stub_numpy)
    assert (problem is not None) == refused
    if refused:
        assert "cannot read text tensors under numpy" in problem and "make stub-env" in problem
        assert "tritonserver on PATH" in problem and "\n" not in problem


def _planted_env(root: Path, numpy_version: str) -> Path:
    site = stubenv.site_packages(root)
    info = site / f"numpy-{numpy_version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: numpy\nVersion: {numpy_version}\n")
    return root


def test_find_server_refuses_the_bundled_server_under_numpy_2_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    real = server._dist_version  # the stub env's numpy is read from its metadata; this environment's is planted
    monkeypatch.setattr(server, "_dist_version", lambda name, path=None: "2.5.2" if path is None else real(name, path))
    monkeypatch.setattr(stubenv, "path", lambda: tmp_path / "none")
    with pytest.raises(UserError, match="numpy 2.5.2"):
        server.find_server(None)
    monkeypatch.setattr(stubenv, "path", lambda: _planted_env(tmp_path / "np1", "1.26.4"))
    assert server.find_server(None)[1] is True  # a numpy<2 stub env: served
    monkeypatch.setattr(stubenv, "path", lambda: _planted_env(tmp_path / "np2", "2.0.1"))
    with pytest.raises(UserError, match="numpy 2.5.2"):  # a stub env with numpy 2 does not help
        server.find_server(None)
    # NVIDIA's binary on PATH needs none of this
    fake = _fake_tritonserver(tmp_path / "ngc")
    monkeypatch.setenv("PATH", str(fake.parent))
    assert server.find_server(None) == (fake, False)


def test_dist_version_reads_the_environment_given():
    assert server._dist_version("numpy") is not None
    assert server._dist_version("numpy", Path("/nonexistent")) is None


# ----------------------------------------------------------------------------------------------- readiness wait
def _http_health(status: int):
    """A loopback HTTP endpoint answering ``/v2/health/ready`` with ``status``: it stands in for Triton's health
    endpoint here only (the e2e server tests wait on the real one)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server API
            self.send_response(status if self.path == "/v2/health/ready" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return httpd


@pytest.mark.parametrize("status,expected", [(200, "ready"), (503, "timeout")])
def test_wait_ready_needs_the_health_endpoint_to_say_ready(tmp_path, status, expected):
    import subprocess

    httpd = _http_health(status)
    proc = subprocess.Popen(["sleep", "30"])
    try:
        s = server.Server(proc, "127.0.0.1", httpd.server_address[1], 1, tmp_path / "log")
        waits = []
        assert server.wait_ready(s, 0.3, on_wait=lambda: waits.append(1), poll_s=0.05) == expected
        assert (len(waits) > 0) == (expected == "timeout")
        assert s.responsive(0.1) == (expected == "ready")
    finally:
        proc.kill()
        proc.wait()
        httpd.shutdown()


def test_wait_ready_stops_at_once_when_the_process_exits(tmp_path):
    import subprocess
    import time

    proc = subprocess.Popen(["sh", "-c", "exit 3"])
    s = server.Server(proc, "127.0.0.1", server.free_ports("127.0.0.1", 1)[0], 1, tmp_path / "log")
    t0 = time.monotonic()
    assert server.wait_ready(s, 30) == "exited" and proc.returncode == 3
    assert time.monotonic() - t0 < 5
