"""Strict template rendering, the protobuf schema check, and the server launcher's error paths."""
from __future__ import annotations

import pytest

from pipeline.errors import UserError
from pipeline.triton import server
from pipeline.triton.render import parse_model_config, render


def test_missing_placeholder_is_an_error():
    with pytest.raises(UserError, match="no value for placeholder.*engine_dir"):
        render("a: ${engine_dir} b: ${x}", {"x": 1}, name="t")


def test_unknown_value_is_an_error():
    with pytest.raises(UserError, match="unknown placeholder.*typo"):
        render("a: ${x}", {"x": 1, "typo": 2}, name="t")


def test_bools_render_as_pbtxt_bools():
    assert render("d: ${d}", {"d": True}) == "d: true"


def test_every_shipped_template_names_its_placeholders_and_parses_when_filled():
    import string

    from pipeline.triton import layouts

    found = [t for lay in layouts.LAYOUTS.values() for t in (lay.folder / "models").glob("*/config.pbtxt.tmpl")]
    assert len(found) == sum(len({t for ts in lay.models.values() for t in ts}) for lay in layouts.LAYOUTS.values())
    for tmpl in found:
        ids = string.Template(tmpl.read_text()).get_identifiers()
        values = {k: ("true" if "mode" in k else "TYPE_FP32" if k.endswith(("_datatype", "_data_type"))
                      else "x" if "dir" in k or k in ("dtype", "device", "triton_backend", "batching_strategy",
                                                      "batch_scheduler_policy", "guided_decoding_backend",
                                                      "xgrammar_tokenizer_info_path", "gpu_device_ids")
                      else 1) for k in ids}
        cfg = parse_model_config(render(tmpl.read_text(), values, name=tmpl.parent.name))
        assert cfg.name == tmpl.parent.name.split(".")[0]  # tensorrt_llm.<layout> renders model tensorrt_llm


def test_schema_check_rejects_unknown_fields_and_bad_values():
    with pytest.raises(UserError, match="not a valid Triton model config"):
        parse_model_config('name: "m" max_batch_size: "eight"')
    with pytest.raises(UserError, match="not a valid Triton model config"):
        parse_model_config('name: "m" not_a_field: 1')
    with pytest.raises(UserError, match="not a valid Triton model config"):
        parse_model_config('name: "m" max_batch_size: ${triton_max_batch_size}')


def test_missing_server_binary_names_the_fix(tmp_path):
    with pytest.raises(UserError, match="serve.server_bin=.*not an executable file"):
        server.find_server(str(tmp_path / "nope"))


def test_bundled_server_is_found_without_configuration(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    binary, bundled = server.find_server(None)
    assert bundled and binary.name == "tritonserver" and binary.is_file()


@pytest.mark.serial  # counts every tritonserver on the machine: another test's server would count as a leftover
def test_server_that_cannot_start_reports_its_log_and_is_gone(tmp_path):
    """A repository with a broken model: the server exits, the error carries the log tail, no process survives."""
    import psutil

    repo = tmp_path / "repo" / "broken" / "1"
    repo.mkdir(parents=True)
    (repo.parent / "config.pbtxt").write_text('name: "broken"\nbackend: "no_such_backend"\n')
    before = {p.pid for p in psutil.process_iter()}
    with pytest.raises(server.ServerError) as err:
        with server.local_server(tmp_path / "repo", host="127.0.0.1", server_bin=None, work_dir=tmp_path / "w",
                            timeout_s=60):
            pass
    assert "no_such_backend" in str(err.value)
    leftover = [p for p in psutil.process_iter(["name"]) if p.pid not in before and p.info["name"] == "tritonserver"]
    assert leftover == []


# ------------------------------------------------------------------------------------ python -m pipeline serve
def test_serve_finds_the_repository_of_a_bundle_and_refuses_anything_else(tmp_path):
    from pipeline.cli.serve import serve_target

    repo = tmp_path / "b" / "v1" / "triton_repo"
    (repo / "ensemble").mkdir(parents=True)
    (repo / "ensemble" / "config.pbtxt").write_text('name: "ensemble"\n')
    (tmp_path / "b" / "v1" / "bundle.json").write_text("{}")
    (tmp_path / "b" / "latest").write_text("v1\n")
    assert serve_target(str(tmp_path / "b")) == serve_target(str(tmp_path / "b" / "v1")) == repo
    assert serve_target(str(repo)) == repo
    with pytest.raises(UserError, match="neither a model repository"):
        serve_target(str(tmp_path / "b" / "v1" / "triton_repo" / "ensemble"))
    with pytest.raises(UserError, match="no such directory"):
        serve_target(str(tmp_path / "nowhere"))
    (tmp_path / "b" / "latest").unlink()  # no version passed every gate: the versions are named
    with pytest.raises(UserError, match=r"no `latest` here \(no version passed every gate\); serve a version: .*/b/v1"):
        serve_target(str(tmp_path / "b"))


@pytest.mark.slow
def test_serve_stands_up_a_packaged_repository_until_interrupted(tiny_build, tmp_path):
    """The CLI prints the addresses and the ready models; the server answers; SIGINT stops it and every process it
    started."""
    import json
    import urllib.request

    import psutil

    from tests.helpers.serving import Serve

    repo = next(tiny_build.glob("triton_repo/*-package-*/manifest.json")).parent
    with Serve(repo, "serve.openai.port=0", cwd=tmp_path) as s:
        lines = s.lines
        ready = next(x for x in lines if x.startswith("ready")).split(" ", 1)[1].split(", ")
        assert set(ready) == {"ensemble", "preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls"}
        assert "entry points: ensemble, tensorrt_llm_bls" in lines[0]
        with urllib.request.urlopen(f"{s.http}/v2/models/ensemble/ready", timeout=10) as r:
            assert r.status == 200
        assert s.grpc.startswith("127.0.0.1:")
        assert s.url.startswith("http://127.0.0.1:") and s.url.endswith("/v1")
        with urllib.request.urlopen(f"{s.url}/models", timeout=10) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["tiny-qwen3"]
        started = psutil.Process(s.proc.pid).children(recursive=True)
        assert any(p.name() == "tritonserver" for p in started)
        body = json.dumps({"text_input": "The capital of France is", "max_tokens": 4, "stream": True}).encode()
        req = urllib.request.Request(f"{s.http}/v2/models/ensemble/generate_stream", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=120) as r:
            assert b"text_output" in r.read()
        assert s.stop() == 0
        assert "stopped" in s.proc.stdout.read()
        gone, alive = psutil.wait_procs(started, timeout=30)
        assert alive == []


def test_serve_of_a_non_repository_is_one_line(tmp_path):
    from tests.conftest import run_cli

    proc = run_cli("serve", str(tmp_path), root=tmp_path / "cwd")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"error: {tmp_path}: neither a model repository (*/config.pbtxt) nor a bundle "
                                   f"(triton_repo/)")


def test_docker_starts_a_multi_rank_engine_like_upstreams_launcher(tmp_path):
    """TP x PP = 2: mpirun with one tritonserver per rank (rank 1 loads only tensorrt_llm), each with its own
    python-backend shared-memory prefix; a one-rank engine keeps the plain tritonserver command."""
    import json

    repo = tmp_path / "repo"
    eng = repo / "tensorrt_llm" / "1" / "engine"
    eng.mkdir(parents=True)
    (repo / "tensorrt_llm" / "config.pbtxt").write_text('name: "tensorrt_llm"\nbackend: "tensorrtllm"\n')
    (eng / "config.json").write_text(json.dumps({"pretrained_config": {"mapping": {"world_size": 2}}}))
    cmd = server.docker_command(repo, image="img", mount="/models", host="127.0.0.1", http_port=1, grpc_port=2,
                                name="n")
    tail = cmd[cmd.index("img") + 1:]
    assert tail[:2] == ["mpirun", "--allow-run-as-root"] and tail.count("tritonserver") == 2
    ranks = " ".join(tail).split(" : ")
    assert "--load-model=tensorrt_llm" not in ranks[0] and "--load-model=tensorrt_llm" in ranks[1]
    assert "shm-region-prefix-name=prefix0_" in ranks[0] and "shm-region-prefix-name=prefix1_" in ranks[1]
    (eng / "config.json").write_text(json.dumps({"pretrained_config": {"mapping": {"world_size": 1}}}))
    one = server.docker_command(repo, image="img", mount="/models", host="127.0.0.1", http_port=1, grpc_port=2,
                                name="n")
    assert one[one.index("img") + 1] == "tritonserver" and "mpirun" not in one
