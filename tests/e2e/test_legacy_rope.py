"""What TensorRT-LLM 1.2's transformers (4.57.1, its requirements.txt pin) reads from a config.json that
transformers 5 saved: without the legacy RoPE keys it falls back to rope_theta 10000 and no scaling (the negative
control); with the keys the pipeline adds (:mod:`pipeline.hf_config`), the model's own. transformers 4.57.1 is installed
from PyPI into a virtual environment of its own (configs only: no torch needed)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline import hf_config

pytestmark = [pytest.mark.slow, pytest.mark.network]

READ = ("import json, sys; from transformers import AutoConfig; c = AutoConfig.from_pretrained(sys.argv[1]); "
        "print(json.dumps({'theta': c.rope_theta, 'scaling': c.rope_scaling}))")


@pytest.fixture(scope="module")
def transformers_457(tmp_path_factory):
    venv = tmp_path_factory.mktemp("t457")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "transformers==4.57.1"],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode and ("Could not fetch" in proc.stderr or "NewConnectionError" in proc.stderr):
        pytest.skip("PyPI is not reachable from here (transformers 4.57.1 is downloaded)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return venv / "bin" / "python"


def _read(python, path) -> dict:
    out = subprocess.run([str(python), "-c", READ, str(path.parent)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model_type, kw, theta, scaling_type", [
    ("qwen3", {"rope_theta": 1_000_000.0}, 1_000_000.0, None),
    ("llama", {"rope_theta": 500_000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192}}, 500_000.0,
     "llama3"),
])
def test_transformers_457_reads_the_models_rope_only_with_the_legacy_keys(transformers_457, tmp_path, model_type, kw,
                                                                          theta, scaling_type):
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **kw).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    unpatched = _read(transformers_457, path)
    assert unpatched == {"theta": 10000.0, "scaling": None}  # negative control: 4.57 misreads transformers 5's file
    hf_config.write_legacy_rope(path)
    patched = _read(transformers_457, path)
    assert patched["theta"] == theta
    assert (patched["scaling"] or {}).get("rope_type") == scaling_type
