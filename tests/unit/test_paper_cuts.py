"""The first hour's paper cuts, each against the code that printed it: the nvfp4 refusal's advice, the build
summary's serve lines and port, `diff` on recorded effective values and task intervals, `lint` on a published
directory. `plan`'s account of `auto` is in tests/e2e/test_cli_faults.py."""
from __future__ import annotations

import pytest

from pipeline import bundle, compat, report


def test_the_nvfp4_refusal_advises_what_plans_on_that_runtime():
    """On a TensorRT engine with the FP8 KV cache, int4_awq is refused by the paged-context-FMHA rule, so the
    advice names the KV setting that makes it plan; on the reference runtime int4_awq plans as it is."""
    engine = compat.problems("nvfp4", "fp8", "h100", 90, "cuda", "trtllm_engine")
    assert engine == ["nvfp4 needs Blackwell (sm100/sm120); for h100 use fp8 or int4_awq with quant.kv_cache=none, "
                      "or target=b200 to calibrate here for Blackwell"]
    ref = compat.problems("nvfp4", "fp8", "h100", 90, "cuda", "reference")
    assert ref == ["nvfp4 needs Blackwell (sm100/sm120); for h100 use fp8 or int4_awq, or target=b200 to calibrate "
                   "here for Blackwell"]
    none = compat.problems("nvfp4", "none", "h100", 90, "cuda", "trtllm_engine")
    assert "with quant.kv_cache=none" not in none[0]  # nothing to add when the KV cache is not FP8


def _summary(port_stages=None):
    return {"model": "m", "stages": [{"stage": "publish", "output": "/b/x"}], "published": None}


def test_the_serve_lines_carry_a_port_the_build_was_given():
    default = report.serve_lines(_summary(), {"host": "127.0.0.1", "port": 9000})
    assert default[0] == "serve it: python -m pipeline serve /b/x"
    assert "http://127.0.0.1:9000/v1" in default[1] and "serve.openai.port=N" in default[1]
    other = report.serve_lines(_summary(), {"host": "127.0.0.1", "port": 9100})
    assert other[0] == "serve it: python -m pipeline serve /b/x serve.openai.port=9100"
    assert "http://127.0.0.1:9100/v1" in other[1]


def _rows(text: str) -> dict[str, list[str]]:
    out = {}
    for line in text.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0]] = cells[1:]
    return out


def test_diff_compares_recorded_effective_values_and_task_bounds_by_difference(tmp_path):
    from tests.helpers.bundles import make_bundle, rewrite_manifest

    a, b = make_bundle(tmp_path / "a"), make_bundle(tmp_path / "b", version="v0000000000bb")
    calib = lambda rows: {"dataset": "builtin", "rows": rows, "seq_len": 128, "tokens": rows * 128,  # noqa: E731
                          "short": False, "short_reasons": [], "basis": "model config"}
    task = lambda q, lo: {"baseline": 0.5, "quantized": q, "difference": q - 0.5, "ci_low": lo,  # noqa: E731
                          "items": 100, "verdict": "pass"}

    def old(d):
        d["quant"]["calibration"] = calib(24)
        d["recipe"] = {"quantize": {"quant": {"calib": {"num_samples": None, "seq_len": 128}}}}
        d["eval"] = {"verdict": "pass", "tasks": {"t": task(0.5, -0.02)}}

    def new(d):
        d["quant"]["calibration"] = calib(16)
        d["recipe"] = {"quantize": {"quant": {"calib": {"num_samples": 16, "seq_len": 128}}}}
        d["eval"] = {"verdict": "pass", "tasks": {"t": task(0.49, -0.04)}}

    rewrite_manifest(a / "bundle.json", old)
    rewrite_manifest(b / "bundle.json", new)
    rows = _rows(bundle.diff(str(a), str(b)))
    assert rows["config quant.calib.num_samples"] == ["24 (resolved)", "16", ""]
    assert rows["task t ci_low"] == ["-0.02", "-0.04", "-0.02"]  # absolute, not "+100.0%"
    # the same effective value on both sides is no difference: the old build resolved auto to what the new one names
    rewrite_manifest(b / "bundle.json", lambda d: d["quant"].update(calibration=calib(24)) or
                     d["recipe"]["quantize"]["quant"]["calib"].update(num_samples=24))
    assert "config quant.calib.num_samples" not in _rows(bundle.diff(str(a), str(b)))


def test_lint_of_a_published_directory_says_where_the_repository_is(tmp_path):
    from pipeline.errors import UserError
    from pipeline.triton import lint

    base = tmp_path / "published" / "m" / "fp8-kvfp8" / "cpu" / "reference"
    (base / "v1" / "triton_repo" / "ensemble").mkdir(parents=True)
    (base / "latest").write_text("v1\n")
    with pytest.raises(UserError, match=r"each version's repository is at <version>/triton_repo, e\.g\. .*/v1/"
                                        r"triton_repo \(the one latest names\)"):
        lint.lint(base)
    with pytest.raises(UserError, match=r"it is a bundle: give its repository, .*/v1/triton_repo"):
        lint.lint(base / "v1")
    with pytest.raises(UserError, match=r"give the model repository's root directory$"):  # negative control
        lint.lint(tmp_path)
