"""The bundled server's python stub runs from the stub environment when there is one (numpy<2 beside a numpy 2
environment), and from the running environment otherwise (negative control).

A python-backend model records, from inside the stub, the environment it runs in and whether the stub
environment's start-up module ran; the server is the real bundled tritonserver. Making the stub environment installs
numpy<2 from PyPI, as ``make setup`` does (skipped where PyPI is unreachable)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipeline.triton import server, stubenv

pytestmark = [pytest.mark.slow, pytest.mark.network]

MODEL = '''
import json, os, sys
import numpy
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        with open(os.environ["STUB_ENV_PROBE"], "w") as f:
            json.dump({"prefix": sys.prefix, "numpy": numpy.__file__, "shim": "long" in vars(numpy)}, f)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                              .as_numpy())]) for r in requests]
'''
CONFIG = '''name: "probe"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
'''


@pytest.fixture(scope="module")
def stub_env(tmp_path_factory) -> Path:
    from pipeline.errors import UserError

    try:
        return stubenv.create(tmp_path_factory.mktemp("stub") / "env")
    except UserError as exc:
        pytest.skip(f"could not install numpy<2 (PyPI unreachable?): {exc}")


def _serve_probe(tmp_path: Path, monkeypatch) -> dict:
    repo = tmp_path / "repo"
    (repo / "probe" / "1").mkdir(parents=True)
    (repo / "probe" / "config.pbtxt").write_text(CONFIG)
    (repo / "probe" / "1" / "model.py").write_text(MODEL)
    probe = tmp_path / "probe.json"
    monkeypatch.setenv("STUB_ENV_PROBE", str(probe))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:/usr/bin:/bin")  # the bundled server, not one on PATH
    import numpy as np
    import tritonclient.http as httpclient

    with server.local_server(repo, host="127.0.0.1", server_bin=None, work_dir=tmp_path / "w", timeout_s=120) as s:
        client = httpclient.InferenceServerClient(s.http_url.removeprefix("http://"))
        inp = httpclient.InferInput("IN", [1], "BYTES")
        inp.set_data_from_numpy(np.array(["ready ✓".encode()], dtype=object))
        assert client.infer("probe", [inp]).as_numpy("OUT").tolist() == ["ready ✓".encode()]
    return json.loads(probe.read_text())


def test_the_stub_runs_from_the_stub_env(stub_env, tmp_path, monkeypatch):
    monkeypatch.setattr(stubenv, "path", lambda: stub_env)
    seen = _serve_probe(tmp_path, monkeypatch)
    assert Path(seen["prefix"]) == stub_env
    assert Path(seen["numpy"]).is_relative_to(stubenv.site_packages(stub_env))
    assert seen["shim"] is True


def test_without_a_stub_env_the_stub_runs_from_this_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(stubenv, "path", lambda: tmp_path / "no-stub-env")
    seen = _serve_probe(tmp_path, monkeypatch)
    assert Path(seen["prefix"]).resolve() == Path(sys.prefix).resolve()
    assert seen["shim"] is ("long" in vars(__import__("numpy")))  # the start-up module did not run here
