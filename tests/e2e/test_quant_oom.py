"""Out of GPU memory in the quantize stage: a batch that does not fit is halved and retried, recorded in
accuracy.json, and the stage finishes; only a single row that does not fit fails it. The error is planted in the
tiny model's forward (``torch.cuda.OutOfMemoryError``, what a CUDA allocation raises) and runs through the real
stage code on CPU."""
from __future__ import annotations

import json

import pytest
import torch

from pipeline import hardware

from pipeline.runner import executor as runner
from pipeline.errors import StageFailed
from pipeline.stages import STAGES
from tests.conftest import TINY


def _plant(monkeypatch, should_fail):
    """Make Qwen3ForCausalLM.forward raise torch.cuda.OutOfMemoryError when ``should_fail(batch, calibrating)``
    says so; -> the list of (batch rows, calibrating, raised) it saw."""
    from transformers.models.qwen3 import modeling_qwen3

    cls = modeling_qwen3.Qwen3ForCausalLM
    real = cls.forward
    seen = []

    def forward(self, input_ids=None, *a, **kw):
        calibrating = kw.get("logits_to_keep") == 1
        n = int(input_ids.shape[0])
        fail = should_fail(n, calibrating)
        seen.append((n, calibrating, fail))
        if fail:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (planted)")
        return real(self, input_ids, *a, **kw)

    monkeypatch.setattr(cls, "forward", forward)
    return seen


def _quantize(root, *extra):
    cfg = hardware.compose([*TINY, "quant=fp8", f"paths.root={root}", "until=quantize", *extra])
    planned = {p.stage.name: p for p in runner.plan(cfg, list(STAGES[:2]))}
    for name in ("fetch", "quantize"):
        if not planned[name].cached:
            runner.execute(cfg, planned[name], planned)
    return planned["quantize"].out


def test_an_oom_at_the_first_batch_halves_it_and_the_stage_finishes(tmp_path, monkeypatch):
    state = {"calib": False, "eval": False}

    def first_batch_of_each(n, calibrating):
        key = "calib" if calibrating else "eval"
        if not state[key] and n > 1:
            state[key] = True
            return True
        return False

    seen = _plant(monkeypatch, first_batch_of_each)
    out = _quantize(tmp_path)  # CPU: batches of 8 (24 calibration rows, 5 held-out)
    acc = json.loads((out / "accuracy.json").read_text())
    mem = acc["gpu_memory"]
    retries = mem["oom_retries"]
    assert [(r["step"], r["row"], r["batch_size"], r["retry_batch_size"]) for r in retries] == [
        ("reference logits", 0, 5, 2), ("calibrate", 0, 8, 4)]
    assert "planted" in retries[1]["error"]
    assert mem["batch_size"] == 8 and acc["batch_size"] == mem["calibration_batch_size_used"] == 4
    calib_batches = [n for n, c, fail in seen if c and not fail]
    assert calib_batches == [4] * 6  # every one of the 24 rows calibrated, in halves, the failed batch included
    assert acc["calibration"]["rows"] == 24
    parts = acc["calibrate_parts_s"]  # one timing per batch that ran, the retried halves included
    assert parts["forward_loops"] == 1 and len(parts["batches_s"]) == 6
    assert 0 < parts["forward_loop_s"] <= acc["timings_s"]["calibrate_s"]
    assert acc["timings_s"]["modelopt_import_s"] >= 0  # outside the calibrate step, as hf_ptq.py imports it
    # negative control: the same build without a planted error records no retry and keeps its batch
    monkeypatch.undo()
    clean = _quantize(tmp_path / "clean")
    acc = json.loads((clean / "accuracy.json").read_text())
    assert acc["gpu_memory"]["oom_retries"] == [] and acc["batch_size"] == 8


def test_a_single_row_that_does_not_fit_fails_the_stage_with_the_fix(tmp_path, monkeypatch):
    _plant(monkeypatch, lambda n, calibrating: calibrating)
    with pytest.raises(StageFailed, match=r"calibrate: out of GPU memory with a batch of one row of 128 tokens "
                                          r"\(CUDA out of memory\. .*\(planted\)\); free GPU memory"):
        _quantize(tmp_path)
    assert not list((tmp_path / ".store").glob("*quantize-*/accuracy.json"))  # nothing half-written
