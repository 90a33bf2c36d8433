"""A local checkpoint on an offline machine builds end to end with no calibration flags: ModelOpt's recipe dataset
cannot be had, so it calibrates on the shipped corpus; plan says so up front, and accuracy.json and the bundle record
the calibration as short, with the reason."""
from __future__ import annotations

import json

import pytest

from pipeline import calib
from tests.conftest import TINY, report, run_cli


@pytest.mark.slow  # a fetch of the tiny model, then a whole build of it as a local checkpoint (~60 s on 2 cores)
def test_a_local_checkpoint_offline_builds_on_the_shipped_corpus_recorded_as_short(tmp_path):
    seed = tmp_path / "seed"
    proc = run_cli("build", *TINY, "until=fetch", root=seed)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ckpt = next(p for p in (seed / ".store").glob("tiny-qwen3-fetch-*") if p.is_dir())
    local = [*TINY, "model.name=local-tiny", f"model.source={ckpt}", "model.synthetic=null", "model.calib=null"]
    root = tmp_path / "local"

    plan = run_cli("plan", "--json", *local, root=root)  # run_cli's environment has HF_HUB_OFFLINE=1
    assert plan.returncode == 0, plan.stderr
    cal = json.loads(plan.stdout)["calibration"]
    assert cal["dataset"] == "builtin" and cal["short"] and (cal["num_samples"], cal["seq_len"]) == (1024, 512)
    assert any("cnn_nemotron_v2_mix is unavailable (HF_HUB_OFFLINE=1" in r for r in cal["short_reasons"])

    proc = run_cli("build", *local, root=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    label = "local-tiny.fp8-kvfp8.cpu.reference"
    assert {r["status"] for r in report(root, label)["stages"]} == {"ran"}
    acc = json.loads(next((root / ".store").glob("local-tiny.fp8-kvfp8-quantize-*/accuracy.json")).read_text())
    c = acc["calibration"]
    assert c["dataset"] == "builtin" and c["short"] and c["seq_len"] == 512 and c["rows"] < c["requested_rows"]
    assert any("unavailable" in r for r in c["short_reasons"])
    bundle = next((root / "bundles").rglob("bundle.json"))
    q = json.loads(bundle.read_text())["quant"]["calibration"]
    assert q["short"] and q["dataset"] == "builtin" and q["short_reasons"] == c["short_reasons"]


def test_the_recipe_is_the_one_hf_ptq_py_defaults_to():
    """The recipe constants against ModelOpt's own source text at the pinned commit (vendored nowhere: the
    recorded defaults are what `hf_ptq.py --help` printed there): 1024 samples, 512 tokens, cnn_nemotron_v2_mix; and
    the combo's members from the installed ModelOpt's DATASET_COMBOS."""
    from modelopt.torch.utils import dataset_utils

    assert calib.RECIPE == {"dataset": "cnn_nemotron_v2_mix", "num_samples": 1024, "seq_len": 512}
    assert tuple(dataset_utils.DATASET_COMBOS["cnn_nemotron_v2_mix"]) == calib.DATASET_COMBOS["cnn_nemotron_v2_mix"]
    assert "examples/hf_ptq/hf_ptq.py @ NVIDIA/Model-Optimizer a2fbac7" in calib.RECIPE_SOURCE


def test_the_combo_loads_both_members_interleaved(monkeypatch):
    """The hf_ptq.py combo through ModelOpt's own dataset loader, its Hub download stood in for (no Hub here)."""
    import modelopt.torch.utils.dataset_utils as du

    asked = []

    def samples(name, n):
        asked.append((name, n))
        return [f"{name} document {i} " + "word " * 50 for i in range(n)]

    monkeypatch.setattr(du, "get_dataset_samples", samples)
    monkeypatch.setattr(calib, "require_hub_support", lambda d: None)
    texts = calib._load_hub("cnn_nemotron_v2_mix", 40)
    assert asked == [("cnn_dailymail", 20), ("nemotron-post-training-dataset-v2", 20)]
    docs = texts.calib + texts.heldout
    assert sum(d.startswith("cnn_dailymail") for d in docs) == 20 == sum(d.startswith("nemotron") for d in docs)
