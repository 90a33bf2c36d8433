"""The formats that calibrate on CPU beyond the original six, and the cast FP8 KV preset, through every stage up to
the bench: ``python -m pipeline build until=bench`` on tiny-qwen3 calibrates with ModelOpt, exports, passes the export
proof, builds and packages for the reference runtime, and serves the bench's requests through the real Triton server
with no error. The export-level checks of each format (its dequantizer against ModelOpt's fake quant, a planted wrong
scale) are in tests/e2e/test_export_proof.py; nvfp4_awq calibrates on CUDA only (tests/gpu/test_gpu.py)."""
from __future__ import annotations

import pytest

from pipeline.formats import FORMATS
from tests.conftest import TINY, report, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a calibration, a Triton start and a bench each (~1 min)

CASES = [("fp8_per_channel_per_token", "fp8"), ("mxfp8", "fp8"), ("w4a16_nvfp4", "fp8"),
         ("w4a8_nvfp4_fp8", "fp8"), ("fp8", "fp8_cast")]
STAGES = ["fetch", "quantize", "build", "package", "bench"]


@pytest.mark.parametrize("fmt,kv", CASES, ids=[f"{f}-kv{k}" for f, k in CASES])
def test_the_format_is_calibrated_exported_packaged_and_served(tmp_path, fmt, kv):
    proc = run_cli("build", *TINY, f"quant={fmt}", f"quant.kv_cache={kv}", "quant.calib.num_samples=8",
                   "quant.calib.seq_len=64", "until=bench", root=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["stage"]: r for r in report(tmp_path, f"tiny-qwen3.{fmt}-kv{kv}.cpu.reference")["stages"]}
    assert [s for s in STAGES if rows[s]["status"] == "ran"] == STAGES
    q = rows["quantize"]["result"]
    assert q["quant_algo"] == FORMATS[fmt].quant_algo and q["kv_cache_quant_algo"] == "FP8"
    assert q["accuracy"]["export_check"] == "pass", q["accuracy"]["export_proof"]
    bench = rows["bench"]["result"]
    levels = [lv for w in bench["workloads"].values() for lv in w]
    assert levels and all(lv["error_count"] == 0 and lv["request_count"] == 3 for lv in levels), levels
    assert "they are not a performance measurement" in proc.stdout  # the reference runtime's note
