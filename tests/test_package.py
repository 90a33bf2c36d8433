"""Strict template rendering, the protobuf schema check, and the server launcher's error paths."""
from __future__ import annotations

import pytest

from pipeline.errors import UserError
from pipeline.triton import server
from pipeline.triton.render import MODELS_DIR, parse_model_config, render


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

    for tmpl in MODELS_DIR.glob("*/config.pbtxt.tmpl"):
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
        with server.running(tmp_path / "repo", host="127.0.0.1", server_bin=None, work_dir=tmp_path / "w",
                            timeout_s=60):
            pass
    assert "no_such_backend" in str(err.value)
    leftover = [p for p in psutil.process_iter(["name"]) if p.pid not in before and p.info["name"] == "tritonserver"]
    assert leftover == []
