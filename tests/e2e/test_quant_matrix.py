"""Every format × KV combination that calibrates on CPU, on tiny-qwen3: exported dtypes, scales, config fields,
the manifest's record of them, and the export check. Plus the plan-time refusals and the accuracy gate."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from pipeline import hardware

from pipeline.runner import executor as runner
from pipeline.errors import StageFailed, UserError
from pipeline.stages import STAGES
from tests.conftest import TINY, run_cli

ALGO = {"fp8": "FP8", "int4_awq": "W4A16_AWQ", "nvfp4": "NVFP4", "w4a8_awq": "W4A8_AWQ",
        "int8_sq": "W8A8_SQ_PER_CHANNEL", "none": None}
CPU_COMBOS = [(f, kv) for f in ALGO for kv in ("none", "fp8", "nvfp4")
              if not (f in ("int4_awq", "w4a8_awq") and kv == "nvfp4")]  # AWQ + NVFP4 KV: CUDA only


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("matrix")


def _quantize(root, fmt, kv, *extra):
    given = {e.split("=")[0] for e in extra}
    small = [o for o in ("quant.calib.num_samples=8", "quant.calib.seq_len=64") if o.split("=")[0] not in given]
    cfg = hardware.compose([*TINY, f"quant={fmt}", f"quant.kv_cache={kv}", f"paths.root={root}", "until=quantize",
                          *small, *extra])
    planned = {p.stage.name: p for p in runner.plan(cfg, list(STAGES[:2]))}
    for name in ("fetch", "quantize"):
        if not planned[name].cached:
            runner.execute(cfg, planned[name], planned)
    return planned["quantize"].out


# The fast tier exports every format and every KV format at least once (AWQ, whose scale search takes 20-30 s a
# combination on 2 cores, only in the slow tier); the slow tier runs the whole matrix.
FAST_COMBOS = {("none", "none"), ("fp8", "fp8"), ("nvfp4", "fp8"), ("int8_sq", "none"), ("int8_sq", "fp8"),
               ("int8_sq", "nvfp4")}


@pytest.mark.parametrize("fmt,kv", [pytest.param(f, k, id=f"{f}-kv{k}",
                                                 marks=[] if (f, k) in FAST_COMBOS else [pytest.mark.slow])
                                    for f, k in CPU_COMBOS])
def test_format_exports_what_it_should(root, fmt, kv):
    out = _quantize(root, fmt, kv)
    ckpt = out / "checkpoint"
    manifest = json.loads((out / "manifest.json").read_text())["result"]
    if fmt == "none" and kv == "none":
        assert not (ckpt / "hf_quant_config.json").exists() and manifest["quant_algo"] is None
        return
    q = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert q.get("quant_algo") == ALGO[fmt]
    assert q.get("kv_cache_quant_algo") == (None if kv == "none" else kv.upper())
    for key in ("quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules"):
        assert manifest[key] == q.get(key), key  # recorded exactly as exported
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    with safe_open(str(next(ckpt.glob("*.safetensors"))), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys() if ".layers.0." in k}
    p = "model.layers.0.mlp.down_proj."  # in 256, out 128
    w = t.get(p + "weight")
    if fmt == "fp8":
        assert w.dtype == torch.float8_e4m3fn and t[p + "weight_scale"].dtype == torch.float32
        assert t[p + "input_scale"].dtype == torch.float32
    elif fmt in ("int4_awq", "w4a8_awq"):
        assert w.dtype == torch.uint8 and tuple(w.shape) == (64, 256)  # two int4 per byte along the output dim
        assert tuple(t[p + "weight_scale"].shape) == (128, 256 // q["group_size"])
        assert p + "pre_quant_scale" in t
        assert (p + "input_scale" in t) == (fmt == "w4a8_awq") and (p + "weight_scale_2" in t) == (fmt == "w4a8_awq")
    elif fmt == "nvfp4":
        assert w.dtype == torch.uint8 and tuple(w.shape) == (128, 128)  # two e2m1 per byte along the input dim
        assert t[p + "weight_scale"].dtype == torch.float8_e4m3fn and tuple(t[p + "weight_scale"].shape) == (128, 16)
        assert t[p + "weight_scale_2"].dtype == torch.float32 and t[p + "input_scale"].dtype == torch.float32
    elif fmt == "int8_sq":
        assert w.dtype == torch.int8 and tuple(t[p + "weight_scale"].shape) == (128,)
        assert p + "pre_quant_scale" in t and p + "input_scale" in t
    else:
        assert w.dtype == torch.bfloat16
    has_kv = "model.layers.0.self_attn.k_proj.k_scale" in t and "model.layers.0.self_attn.v_proj.v_scale" in t
    assert has_kv == (kv != "none")
    acc = json.loads((out / "accuracy.json").read_text())["accuracy"]
    assert acc["export_check"] == "pass", acc["export_proof"]["problems"]
    p = acc["export_proof"]
    linears = 2 * (4 + 3)  # tiny-qwen3: 2 layers × (q, k, v, o, gate, up, down)
    assert p["structure"]["quantized_linears"] == (0 if fmt == "none" else linears), p["structure"]
    assert p["structure"]["kv_scales"] == (0 if kv == "none" else 2 * 2)
    assert p["layers"]["layers"] == (0 if fmt == "none" else linears)
    assert p["layers"]["activation_scales"] == (0 if fmt in ("none", "int4_awq") else linears), p["layers"]
    assert p["layers"]["kv_scales"] == (0 if kv == "none" else 2 * 2)
    # the built-in negative control: the unquantized weights score beyond the limit the export met
    assert p["unquantized_weights"]["fails"] and p["unquantized_weights"]["kl"] > p["numbers"]["kl_max"] >= \
        p["numbers"]["kl"], p
    assert manifest["calibration"]["sha256"] and manifest["bytes_per_param"] > 0


def test_calibrated_scales_recorded_before_export_catch_a_tampered_export(root, tmp_path):
    """The scales the stage recorded from the calibrated model (before the export existed) against the export's
    files; a copy of the export with an activation scale dropped, one halved and a KV scale removed must fail,
    naming each."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pipeline.quant import proof

    out = _quantize(root, "fp8", "fp8")
    recorded = json.loads((out / "accuracy.json").read_text())["accuracy"]["export_proof"]["calibrated_scales"]
    calibrated = {k: (v["kind"], v["value"]) for k, v in recorded.items()}
    assert len(calibrated) == 14 + 4
    assert proof.scale_problems(proof.Checkpoint(out / "checkpoint"), calibrated) == []
    bad = tmp_path / "bad"
    shutil.copytree(out / "checkpoint", bad)
    shard = next(bad.glob("*.safetensors"))
    t = load_file(str(shard))
    del t["model.layers.1.mlp.down_proj.input_scale"], t["model.layers.0.self_attn.v_proj.v_scale"]
    t["model.layers.0.self_attn.q_proj.input_scale"] = t["model.layers.0.self_attn.q_proj.input_scale"] / 2
    save_file(t, str(shard), metadata={"format": "pt"})
    problems = proof.scale_problems(proof.Checkpoint(bad), calibrated)
    assert sorted(p.split(": ")[0] for p in problems) == [
        "model.layers.0.self_attn.q_proj.input_scale", "model.layers.0.self_attn.v_proj.v_scale",
        "model.layers.1.mlp.down_proj.input_scale"], problems
    assert "missing; the calibrated model has this KV-cache scale" in " ".join(problems)
    assert "missing; the calibrated model has this activation scale" in " ".join(problems)


def test_the_gate_measures_the_deployed_export_not_the_fake_quant_model(root):
    """Recompute the gate's KL independently: the fetched model with plain transformers against the export reloaded
    by the reference runtime, on the stage's held-out rows. NVFP4, where the two models differ measurably."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline import calib, quality
    from pipeline.runtime import reference

    out = _quantize(root, "nvfp4", "fp8")
    result = json.loads((out / "accuracy.json").read_text())
    acc, bs = result["accuracy"], result["batch_size"]
    src = next(p for p in root.glob(".store/tiny-qwen3-fetch-*") if p.is_dir())
    cfg = hardware.compose([*TINY, "quant=nvfp4"])
    rows = calib.pack(AutoTokenizer.from_pretrained(src), calib.load("builtin").heldout, cfg.quant.eval.seq_len,
                      cfg.quant.eval.num_samples)
    base = quality.logits(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval(), rows, bs)
    deployed = quality.logits(reference.load(out / "checkpoint", torch.bfloat16), rows, bs)
    kl = quality.compare(base, deployed, rows)["kl_mean"]
    gate, diagnostic = acc["quantized_vs_unquantized"]["kl_mean"], acc["fake_quant_vs_unquantized"]["kl_mean"]
    assert gate == pytest.approx(kl, rel=1e-6), (gate, kl)
    assert abs(diagnostic - kl) > 1e-5 + 10 * abs(gate - kl), (diagnostic, gate, kl)  # the fake-quant model differs


def test_calibration_shorter_than_requested_fails_unless_allowed(root):
    """The shipped corpus packs into fewer tiny-qwen3 rows than asked for here (yet more than plan's byte bound
    rules out): the stage stops with the fix; quant.calib.allow_short=true accepts it and records it."""
    many = ["quant.calib.num_samples=100", "quant.calib.seq_len=128"]
    with pytest.raises(UserError, match=r"quant.calib: builtin packs into \d+ of the 100 requested rows of 128 "
                                        r"tokens; .*quant.calib.allow_short=true"):
        _quantize(root, "fp8", "none", *many)
    out = _quantize(root, "fp8", "none", *many, "quant.calib.allow_short=true")
    c = json.loads((out / "accuracy.json").read_text())["calibration"]
    assert c["short"] and c["rows"] < c["requested_rows"] == 100


def test_plan_refuses_a_calibration_the_corpus_cannot_fill(tmp_path):
    big = ["quant=int4_awq", "quant.calib.num_samples=256", "quant.calib.seq_len=512"]
    proc = run_cli("plan", *TINY, *big, root=tmp_path)
    assert proc.returncode == 2
    assert "quant.calib: the shipped corpus (builtin) holds at most ~" in proc.stderr
    assert "fewer than the 256×512 requested" in proc.stderr and "quant.calib.allow_short=true" in proc.stderr
    ok = run_cli("plan", *TINY, *big, "quant.calib.allow_short=true", root=tmp_path)
    assert ok.returncode == 0, ok.stderr


def test_awq_block_size_that_does_not_divide_fails_in_plan_naming_one_that_does(tmp_path):
    proc = run_cli("plan", "quant=int4_awq", root=tmp_path)  # SmolLM2: hidden 576
    assert proc.returncode == 2
    assert "quant.block_size=128 does not divide smollm2-135m's hidden size 576" in proc.stderr
    assert "use quant.block_size=64" in proc.stderr
    ok = run_cli("plan", "quant=int4_awq", "quant.block_size=64", "quant.calib.num_samples=16", root=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert not list(tmp_path.rglob("*.safetensors"))


def test_plan_refuses_a_model_that_cannot_fit_and_names_the_gpus(tmp_path):
    proc = run_cli("plan", "model=qwen32b", "target=a10g", "target.gpus_per_node=1", root=tmp_path)
    assert proc.returncode == 2
    assert "qwen32b needs ~72 GB to calibrate" in proc.stderr and "target a10g has 1× 24 GB" in proc.stderr
    assert "1× 80 GB GPU" in proc.stderr
    fits = run_cli("plan", "model=qwen32b", "target=h200", root=tmp_path).stdout
    # the target fits; only this GPU-less machine is named as unable to run quantize itself
    assert "target h200 has" not in fits and "quantize runs on this machine" in fits


def test_target_cpu_fit_check_uses_this_hosts_memory(monkeypatch):
    """target=cpu calibrates on this host: the check reads its memory (set here to 24 GB and to 512 GB, so the test
    gives the same answer on any machine)."""
    import psutil

    from pipeline.stages import quantize

    cfg = hardware.compose(["model=qwen32b", "quant.calib.dataset=builtin", "quant.calib.num_samples=8"])
    for total_gb, fits in ((24, False), (512, True)):
        monkeypatch.setattr(psutil, "virtual_memory", lambda t=total_gb: SimpleNamespace(total=t * 10**9))
        problems = quantize.check(cfg)
        problem = next((p for p in problems if "to calibrate" in p), None)
        assert len(problems) == (0 if fits else 1), problems
        assert (problem is None) == fits, problem
        if not fits:
            assert "this host, which has 24 GB of memory and no GPU" in problem


def test_awq_with_nvfp4_kv_needs_cuda(tmp_path):
    proc = run_cli("plan", *TINY, "quant=int4_awq", "quant.kv_cache=nvfp4", root=tmp_path)
    assert proc.returncode == 2 and "calibrates on a CUDA GPU only" in proc.stderr


def test_block_size_changes_the_export(root):
    out = _quantize(root, "int4_awq", "fp8", "quant.block_size=64")
    q = json.loads((out / "checkpoint" / "hf_quant_config.json").read_text())["quantization"]
    assert q["group_size"] == 64


def test_accuracy_gate_fails_the_stage_and_warn_downgrades_it(root):
    with pytest.raises(StageFailed, match="accuracy gate .fp8, KV fp8, deployed export vs unquantized.: .*top-1 "
                                          "agreement"):
        _quantize(root, "fp8", "fp8", "quant.gate=fail", "quant.thresholds.top1_min=0.99")
    kept = list((root / "reports" / "failed").glob("*quantize*/quantize.md"))
    assert kept and "Accuracy gate: **fail**" in kept[0].read_text()
    out = _quantize(root, "fp8", "fp8", "quant.gate=warn", "quant.thresholds.top1_min=0.99")
    assert json.loads((out / "accuracy.json").read_text())["accuracy"]["gate"] == "warn"


def test_calibration_file_content_enters_the_fingerprint(tmp_path):
    data = tmp_path / "calib.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"Sentence number {i} about the weather."}) for i in range(20)))
    a = hardware.compose([*TINY, f"quant.calib.dataset={data}"])
    fp1 = runner.plan(a, list(STAGES[:2]))[1].fingerprint
    data.write_text(data.read_text() + "\n" + json.dumps({"text": "One more line."}))
    fp2 = runner.plan(a, list(STAGES[:2]))[1].fingerprint
    assert fp1 != fp2


@pytest.mark.parametrize("content, expected", [
    (b"\xff\xfe not utf8", "is not UTF-8 text"),
    (b'{"txt": "wrong key"}\n', "is not a JSON object with a 'text' field"),
])
def test_bad_calibration_files_are_one_line_errors(tmp_path, content, expected):
    from pipeline import calib

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    with pytest.raises(UserError, match=expected):
        calib.load(str(bad))
