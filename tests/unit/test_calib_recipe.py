"""Calibration size and dataset: ModelOpt's hf_ptq.py recipe for real checkpoints, the models' own small sets for the
tiny and embedded ones, explicit smaller settings recorded as short, and the offline fallback of local checkpoints."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline import calib, hardware
from pipeline.errors import UserError

HF_PTQ = "examples/hf_ptq/hf_ptq.py @ NVIDIA/Model-Optimizer a2fbac7"


@pytest.fixture
def online(monkeypatch):
    """The Hub reachable as far as the pipeline can tell (no offline variables); whether ``datasets`` is installed
    is left as it is."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)


def _local(tmp_path: Path, *extra: str) -> list[str]:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text("{}")
    return ["model=tiny-qwen3", f"model.source={ckpt}", "model.synthetic=null", "model.calib=null", *extra]


def test_plan_for_qwen32b_nvfp4_b200_calibrates_on_the_recipe(online):
    """Done-means: at least 512 × 512 tokens from the recipe's dataset, with an estimate on the target."""
    cfg = hardware.compose(["model=qwen32b", "quant=nvfp4", "target=b200"])
    s = calib.plan_summary(cfg)
    assert s["dataset"] == "cnn_nemotron_v2_mix" and s["num_samples"] >= 512 and s["seq_len"] >= 512
    assert s["tokens"] >= 512 * 512 and not s["short"] and s["short_reasons"] == []
    assert HF_PTQ in s["basis"]
    # 2 × 32.8e9 × 524288 / (0.33 × 2250e12) ≈ 46 s
    assert calib.CALIB_EFFICIENCY == 0.33
    assert s["estimated_s"] == pytest.approx(2 * 32.8e9 * 1024 * 512 / (0.33 * 2250e12), rel=0.01)


@pytest.mark.parametrize("quant", ["fp8", "int8_sq", "int4_awq", "w4a8_awq", "nvfp4"])
def test_every_format_takes_the_recipe_for_a_real_model(quant, online):
    s = calib.spec(hardware.compose(["model=qwen32b", f"quant={quant}", "target=h200"]))
    assert (s.dataset, s.num_samples, s.seq_len, s.short_reasons) == ("cnn_nemotron_v2_mix", 1024, 512, ())


def test_tiny_and_embedded_models_keep_their_own_small_set_recorded_as_short():
    for model in ("tiny-qwen3", "smollm2-135m"):
        s = calib.spec(hardware.compose([f"model={model}"]))
        assert (s.dataset, s.num_samples, s.seq_len) == ("builtin", 24, 128)
        assert s.basis == f"model config {model} (model.calib)"
        assert len(s.short_reasons) == 1 and "below ModelOpt's recipe of 1024×512" in s.short_reasons[0]


def test_a_smaller_explicit_setting_is_allowed_and_recorded_as_short(online):
    s = calib.spec(hardware.compose(["model=qwen32b", "quant.calib.num_samples=256"]))
    assert (s.num_samples, s.seq_len, s.basis) == (256, 512, "quant.calib")
    assert s.short_reasons and "256×512 tokens (quant.calib)" in s.short_reasons[0]
    # a larger one is not short; the negative control of the rule above
    big = calib.spec(hardware.compose(["model=qwen32b", "quant.calib.num_samples=2048", "quant.calib.seq_len=1024"]))
    assert big.short_reasons == ()


def test_a_local_checkpoint_offline_falls_back_to_the_shipped_corpus_and_plan_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = hardware.compose(_local(tmp_path))
    s = calib.spec(cfg)
    assert s.dataset == "builtin" and s.allow_short and not s.fallback
    assert (s.num_samples, s.seq_len) == (1024, 512)  # the recipe's size is still what is asked for
    assert any("cnn_nemotron_v2_mix is unavailable (HF_HUB_OFFLINE=1 (offline))" in r for r in s.short_reasons)
    summary = calib.plan_summary(cfg)
    assert summary["short"] and summary["dataset"] == "builtin"
    # an hf:// model never falls back: it needs the Hub anyway
    assert calib.spec(hardware.compose(["model=qwen32b"])).dataset == "cnn_nemotron_v2_mix"


def test_a_local_checkpoint_online_asks_for_the_recipe_and_may_fall_back(tmp_path, online, monkeypatch):
    monkeypatch.setattr(calib, "hub_unavailable", lambda: None)
    s = calib.spec(hardware.compose(_local(tmp_path)))
    assert (s.dataset, s.fallback, s.short_reasons) == ("cnn_nemotron_v2_mix", True, ())
    # an explicit dataset is never replaced
    explicit = calib.spec(hardware.compose(_local(tmp_path, "quant.calib.dataset=cnn_dailymail")))
    assert not explicit.fallback


class _ByteTokenizer:
    """A byte-level stand-in for a checkpoint's tokenizer (one token per UTF-8 byte): the packing, not the
    tokenizer, is under test."""

    eos_token_id = 0
    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [b + 1 for b in text.encode()]}


def test_the_stage_falls_back_when_the_recipe_dataset_cannot_load_and_records_why(monkeypatch):
    def unreachable(dataset, limit=4000):
        raise UserError(f"quant.calib.dataset={dataset}: cannot load it (ConnectionError); offline or gated? use a "
                        f"local .txt/.jsonl file")

    monkeypatch.setattr(calib, "_load_hub", unreachable)
    spec = calib.Spec("cnn_nemotron_v2_mix", 1024, 512, calib.RECIPE_SOURCE, (), False, fallback=True)
    rows = calib.rows_for(_ByteTokenizer(), spec, chat_template=False, eval_seq_len=128, eval_num_samples=6)
    rec = rows.record(1.0)
    assert rec["dataset"] == "builtin" and rec["short"] and rec["seq_len"] == 512 and 0 < rec["rows"] < 1024
    assert any("cnn_nemotron_v2_mix is unavailable" in r and "ConnectionError" in r for r in rec["short_reasons"])
    assert rec["recipe"]["num_samples"] == 1024
    # without the fallback (an hf:// model, or a dataset named explicitly) the same failure stops the stage
    with pytest.raises(UserError, match="cannot load it"):
        calib.rows_for(_ByteTokenizer(), calib.Spec("cnn_nemotron_v2_mix", 1024, 512, "x", (), False),
                       chat_template=False, eval_seq_len=128, eval_num_samples=6)


def test_plan_prints_the_calibration_line(online, capsys):
    from pipeline import report
    from pipeline.cli.build import cmd_plan
    from pipeline.ui import out

    doc = cmd_plan(hardware.compose(["model=qwen32b", "quant=nvfp4", "target=b200"]), as_json=True)
    assert doc["calibration"]["tokens"] == 524288
    with out.capture() as cap:
        report.print_plan(doc)
    line = next(ln for ln in cap.get().splitlines() if ln.startswith("calibration:"))
    assert re.search(r"cnn_nemotron_v2_mix, 1024 rows × 512 tokens \(524,288 tokens; size from ModelOpt", line)
    assert "~46 s on b200" in line
