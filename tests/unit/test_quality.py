"""The accuracy gate: its comparisons, breaches and verdict, the export proof's negative control, the stage's
failure message and the quantize.md rendering. Planted logits stand in for the models (no model is loaded)."""
from __future__ import annotations

import pytest
import torch

from pipeline import quality
from pipeline.quant.proof import Proof

TH = {"kl_max": 0.1, "top1_min": 0.85, "ppl_ratio_max": 1.05}
ROWS = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(0))


def _logits(seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(seed)) * scale


def _near(x: torch.Tensor, eps: float, seed: int) -> torch.Tensor:
    return x + eps * torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))


def test_compare_is_zero_for_identical_logits_and_positive_for_different_ones():
    base = _logits(1)
    same = quality.compare(base, base.clone(), ROWS)
    assert same["kl_mean"] == pytest.approx(0.0, abs=1e-6) and same["top1_agreement"] == 1.0
    assert same["ppl_ratio"] == pytest.approx(1.0) and same["tokens"] == 4 * 16
    other = quality.compare(base, _logits(2), ROWS)
    assert other["kl_mean"] > 1.0 and other["top1_agreement"] < 0.5


def test_breaches_name_each_threshold_crossed_and_nothing_else():
    good = {"kl_mean": 0.01, "top1_agreement": 0.95, "ppl_ratio": 1.01}
    assert quality.breaches(good, TH) == []
    bad = {"kl_mean": 0.2, "top1_agreement": 0.80, "ppl_ratio": 1.2}
    assert quality.breaches(bad, TH) == ["KL 0.2000 > 0.1", "top-1 agreement 0.8000 < 0.85",
                                         "perplexity ratio 1.2000 > 1.05"]
    assert quality.breaches({**good, "top1_agreement": 0.84}, TH) == ["top-1 agreement 0.8400 < 0.85"]


def test_gate_verdict_passes_without_breaches_and_warn_only_downgrades_a_failure():
    assert quality.gate([], "fail") == "pass" and quality.gate([], "warn") == "pass"
    assert quality.gate(["KL 0.2000 > 0.1"], "fail") == "fail"
    assert quality.gate(["KL 0.2000 > 0.1"], "warn") == "warn"


def _assess(exported, *, structure=None, mode="fail", th=TH, kl_abs=0.002, kl_frac=0.5):
    base = _logits(1)
    fq = _near(base, 0.3, 2)  # the quantization error
    return quality.assess(base, fq, exported(base, fq), ROWS, structure=structure or Proof(), layers=Proof(),
                          scales={}, thresholds=th, mode=mode, kl_abs=kl_abs, kl_frac=kl_frac)


def test_an_export_that_reproduces_the_fake_quant_model_passes_the_proof_and_the_gate():
    a = _assess(lambda base, fq: fq.clone())
    assert a["export_check"] == "pass" and a["gate"] == "pass" and a["breaches"] == []
    assert a["export_proof"]["unquantized_weights"]["fails"] is True  # the control rejects the unquantized weights
    assert quality.failure(a, "fp8", "fp8") is None


def test_the_unquantized_weights_shipped_as_the_export_fail_the_proof():
    """Negative control: an "export" whose logits are the unquantized model's."""
    a = _assess(lambda base, fq: base.clone())
    assert a["export_check"] == "fail"
    msg = quality.failure(a, "fp8", "fp8")
    assert msg.startswith("export proof failed: the reloaded export does not reproduce the fake-quant model")


def test_limits_that_cannot_tell_the_export_from_the_unquantized_weights_fail_the_proof():
    a = _assess(lambda base, fq: fq.clone(), kl_frac=1.0, kl_abs=10.0)
    assert a["export_proof"]["unquantized_weights"]["fails"] is False
    assert "cannot tell this export from the unquantized weights" in quality.failure(a, "fp8", "fp8")


def test_a_gate_breach_fails_the_stage_naming_the_fixes_unless_warn():
    strict = {**TH, "top1_min": 0.999}
    a = _assess(lambda base, fq: fq.clone(), th=strict)
    assert a["export_check"] == "pass" and a["gate"] == "fail" and a["thresholds"] == strict
    msg = quality.failure(a, "nvfp4", "fp8")
    assert msg.startswith("accuracy gate (nvfp4, KV fp8, deployed export vs unquantized): top-1 agreement ")
    assert msg.endswith(" (quant.gate=warn to accept, or raise quant.thresholds.*)")
    warned = _assess(lambda base, fq: fq.clone(), th=strict, mode="warn")
    assert warned["gate"] == "warn" and quality.failure(warned, "nvfp4", "fp8") is None


def test_an_export_proof_failure_is_reported_before_the_gate_with_the_count_of_the_rest():
    structure = Proof(problems=[f"problem {i}" for i in range(5)])
    a = _assess(lambda base, fq: fq.clone(), structure=structure, th={**TH, "top1_min": 0.999})
    assert a["export_proof"]["problem_count"] == 5
    assert quality.failure(a, "fp8", "fp8") == ("export proof failed: problem 0; problem 1; problem 2 "
                                                "(and 2 more, see accuracy.json)")


def test_the_report_shows_the_gate_verdict_and_the_unquantized_report_its_note():
    a = _assess(lambda base, fq: fq.clone(), th={**TH, "top1_min": 0.999})
    a["export_proof"].update(numbers={"kl": 0.0, "kl_max": 0.01, "kl_abs": 0.002, "kl_frac": 0.5,
                                      "kl_quantization": 0.02})
    r = {"format": "fp8", "kv_cache": "fp8", "quant_algo": "FP8", "device": "cpu", "accuracy": a,
         "calibration": {"rows": 8, "seq_len": 64, "dataset": "builtin", "sha256": "ab" * 32, "tokens_per_s": 1.0},
         "timings_s": {"load_s": 0.1}}
    md = quality.report("tiny-qwen3", r)
    assert md.startswith("# quantize: tiny-qwen3 fp8 (KV fp8)")
    assert "Accuracy gate: **fail**" in md and "top-1 agreement" in md and "Export proof: **pass**" in md
    plain = quality.report("tiny-qwen3", {"format": "none", "kv_cache": "none", "note": "unquantized"})
    assert plain.endswith("\nunquantized\n") and "Accuracy gate" not in plain


def test_a_measure_exactly_at_its_threshold_is_no_breach():
    at = {"kl_mean": TH["kl_max"], "top1_agreement": TH["top1_min"], "ppl_ratio": TH["ppl_ratio_max"]}
    assert quality.breaches(at, TH) == []


def test_compare_reports_every_measure_and_the_ratio_of_the_perplexities():
    base, test = _logits(1), _near(_logits(1), 0.5, 3)
    m = quality.compare(base, test, ROWS)
    assert set(m) == {"kl_mean", "kl_max", "top1_agreement", "ppl_ref", "ppl_test", "ppl_ratio", "tokens"}
    assert m["kl_max"] >= m["kl_mean"] > 0
    assert m["ppl_ratio"] == pytest.approx(m["ppl_test"] / m["ppl_ref"])
    assert m["ppl_ref"] == pytest.approx(quality.compare(base, base, ROWS)["ppl_test"])


def test_the_accuracy_section_is_the_recorded_schema_and_keeps_fifty_problems_with_their_count():
    from pipeline.results import Accuracy

    structure = Proof(problems=[f"problem {i}" for i in range(60)], details={"quantized_linears": 3})
    a = _assess(lambda base, fq: fq.clone(), structure=structure)
    Accuracy.model_validate(a)
    assert a["gate_measures"].startswith("the exported checkpoint, reloaded as served") and \
        a["gate_measures"].endswith("vs the unquantized model")
    p = a["export_proof"]
    assert len(p["problems"]) == 50 and p["problems"][-1] == "problem 49" and p["problem_count"] == 60
    assert p["structure"] == {"quantized_linears": 3} and p["numbers"]["kl_frac"] == 0.5
    assert p["calibrated_scales"] == {}


@pytest.mark.parametrize("count, more", [(3, ""), (4, " (and 1 more, see accuracy.json)")])
def test_the_failure_message_counts_what_it_leaves_out(count, more):
    a = _assess(lambda base, fq: fq.clone(), structure=Proof(problems=[f"p{i}" for i in range(count)]))
    assert quality.failure(a, "fp8", "fp8") == "export proof failed: p0; p1; p2" + more


def test_every_gate_breach_is_named_in_the_failure():
    a = _assess(lambda base, fq: fq.clone(), th={"kl_max": -1.0, "top1_min": 1.01, "ppl_ratio_max": 0.0})
    msg = quality.failure(a, "fp8", "fp8")
    assert msg.startswith("accuracy gate (fp8, KV fp8, deployed export vs unquantized): KL ")
    assert msg.count("; ") == 2 and "top-1 agreement" in msg and "perplexity ratio" in msg
    assert msg.split(": ", 1)[1].split(" (quant.gate")[0] == "; ".join(a["breaches"])
