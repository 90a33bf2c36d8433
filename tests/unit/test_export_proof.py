"""The export proof's structure, layer and scale checks against exports that are slightly wrong, in the fast tier:
synthetic FP8, INT8-SmoothQuant and INT4-AWQ exports of tiny-qwen3's architecture in ModelOpt's format (``tests/helpers/exports.py``)
with one layer's weight scale off by 10%, one layer left unquantized (declared excluded or not), a swapped KV scale,
an activation scale off by 1%. Each is judged with the bounds the formats ship (``pipeline/formats/<format>.py``), so a
bound loosened past its control fails here; the untouched export must pass. docs/mutation.md states the margins."""
from __future__ import annotations

import functools
import math

import pytest

import torch

from pipeline import hardware
from pipeline.quant import proof
from tests.helpers import exports

LAYER = "model.layers.0.mlp.down_proj"
ATTN = "model.layers.1.self_attn"


@functools.lru_cache(maxsize=None)
def shipped_ratio(fmt: str) -> float:
    """The per-layer bound ``quant.eval.export_weight_ratio`` that ``quant=<fmt>`` ships."""
    return float(hardware.compose(["model=tiny-qwen3", f"quant={fmt}"]).quant.eval.export_weight_ratio)


@pytest.fixture(scope="module", params=["fp8", "int8_sq", "int4_awq"])
def export(request, tmp_path_factory) -> exports.Export:
    return exports.write(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> exports.Export:
    return exports.write(tmp_path_factory.mktemp("fp8") / "ckpt", "fp8")


def _structure(e: exports.Export, ckpt=None) -> proof.Proof:
    return proof.check_structure(ckpt or e.dir, e.fmt, e.kv, e.group)


def _layers(e: exports.Export, ckpt=None) -> proof.Proof:
    return proof.check_layers(ckpt or e.dir, e.ref, shipped_ratio(e.fmt))


def test_the_untouched_synthetic_export_passes_with_the_shipped_bounds(export):
    s = _structure(export)
    assert s.problems == [] and s.details["quantized_linears"] == 14 and s.details["kv_scales"] == 4
    assert s.details["excluded_linears"] == 1  # lm_head
    lay = _layers(export)
    assert lay.problems == [] and lay.details["layers"] == 14 and lay.details["worst_ratio"] < 1e-3


def _scaled(factor: float):
    def edit(t, q):
        t[f"{LAYER}.weight_scale"] = (t[f"{LAYER}.weight_scale"].float() * factor).to(t[f"{LAYER}.weight_scale"].dtype)
    return edit


def test_one_layers_weight_scale_off_by_10_percent_fails_the_layer_check_naming_it(export, tmp_path):
    ckpt = export.tampered(tmp_path / "scaled", _scaled(1.1))
    assert _structure(export, ckpt).problems == []  # the layout is right: only the numbers can tell
    lay = _layers(export, ckpt)
    mine = [p for p in lay.problems if p.startswith(f"{LAYER}: the exported weight differs from the fake-quant weight")]
    assert len(lay.problems) == 1 and mine, lay.problems
    assert "it is 1.1× the fake-quant weight (a wrong weight scale)" in mine[0]
    assert lay.details["worst_layer"] == LAYER
    # the margin the docs state: the control scores well above the shipped bound
    assert lay.details["worst_ratio"] > 2 * shipped_ratio(export.fmt)


@pytest.mark.parametrize("factor", [0.9, 1.02])
def test_smaller_or_lower_scale_errors_are_caught_on_fp8(fp8, tmp_path, factor):
    """FP8's quantization error is about 3.5% of a weight, so its bound (0.25× that) resolves a scale off by 2%."""
    lay = _layers(fp8, fp8.tampered(tmp_path / "scaled", _scaled(factor)))
    assert [p.split(":")[0] for p in lay.problems] == [LAYER], lay.problems


def _unquantize(e: exports.Export, exclude: bool):
    def edit(t, q):
        for part in ("weight_scale", "input_scale"):
            t.pop(f"{LAYER}.{part}", None)
        t[f"{LAYER}.weight"] = e.original[LAYER].clone()
        if exclude:
            q["exclude_modules"] = [*q["exclude_modules"], LAYER]
    return edit


def test_one_layer_left_unquantized_fails_structure_and_layers(export, tmp_path):
    ckpt = export.tampered(tmp_path / "bf16", _unquantize(export, exclude=False))
    s = _structure(export, ckpt)
    assert any(p.startswith(f"{LAYER}: unquantized weights (BF16, no weight_scale), yet hf_quant_config.json does "
                            f"not exclude it") for p in s.problems), s.problems
    lay = _layers(export, ckpt)
    assert any(p.startswith(f"{LAYER}: the exported weight differs") for p in lay.problems), lay.problems
    assert lay.details["worst_ratio"] == pytest.approx(1.0, abs=0.1)  # its quantization error itself (sketched)


def test_one_layer_left_unquantized_and_declared_excluded_fails_the_layer_check(export, tmp_path):
    """The structure is then consistent (an excluded layer in bf16), so the layer check against the calibrated
    model is what tells: that layer was quantized when calibrated."""
    ckpt = export.tampered(tmp_path / "excluded", _unquantize(export, exclude=True))
    assert _structure(export, ckpt).problems == []
    lay = _layers(export, ckpt)
    assert lay.problems and all(p.startswith(LAYER) for p in lay.problems), lay.problems  # and its input_scale
    assert f"{LAYER}: the exported weight differs" in lay.problems[0]
    assert lay.details["worst_ratio"] > 2 * shipped_ratio(export.fmt)


def test_a_swapped_kv_scale_fails_naming_both(export, tmp_path):
    k, v = f"{ATTN}.k_proj.k_scale", f"{ATTN}.v_proj.v_scale"

    def swap(t, q):
        t[k], t[v] = t[v].clone(), t[k].clone()

    ckpt = export.tampered(tmp_path / "swapped", swap)
    assert _structure(export, ckpt).problems == []  # both still positive fp32 scalars
    problems = _layers(export, ckpt).problems
    assert [p.split(":")[0] for p in problems] == [k, v], problems
    assert all("a wrong or swapped KV-cache scale" in p for p in problems)


def test_an_activation_scale_off_by_one_percent_fails_naming_it(fp8, tmp_path):
    def off(t, q):
        t[f"{LAYER}.input_scale"] = t[f"{LAYER}.input_scale"] * 1.01

    problems = _layers(fp8, fp8.tampered(tmp_path / "act", off)).problems
    assert len(problems) == 1 and problems[0].startswith(f"{LAYER}.input_scale: ") and \
        "a wrong or swapped activation scale" in problems[0], problems
    # within the recorded tolerance (1e-3 relative) an activation scale passes
    near = fp8.tampered(tmp_path / "near", lambda t, q: t.__setitem__(f"{LAYER}.input_scale",
                                                                       t[f"{LAYER}.input_scale"] * 1.0005))
    assert _layers(fp8, near).problems == []


def test_a_dropped_scale_fails_both_checks_naming_it(fp8, tmp_path):
    ckpt = fp8.tampered(tmp_path / "dropped", lambda t, q: t.pop(f"{ATTN}.v_proj.v_scale"))
    assert f"{ATTN}: v_proj.v_scale missing, but the KV cache is quantized (FP8) (dropped scale)" in \
        _structure(fp8, ckpt).problems
    assert any(p.startswith(f"{ATTN}.v_proj.v_scale: missing; the calibrated model has this KV-cache scale")
               for p in _layers(fp8, ckpt).problems)


def test_a_wrong_weight_dtype_or_scale_shape_fails_the_structure_check(fp8, tmp_path):
    import torch

    def as_int8(t, q):
        t[f"{LAYER}.weight"] = t[f"{LAYER}.weight"].view(torch.int8)

    s = _structure(fp8, fp8.tampered(tmp_path / "int8", as_int8)).problems
    assert f"{LAYER}: weight is I8, FP8 stores F8_E4M3" in s, s

    def per_channel(t, q):
        t[f"{LAYER}.weight_scale"] = t[f"{LAYER}.weight_scale"].repeat(4)

    s = _structure(fp8, fp8.tampered(tmp_path / "vec", per_channel)).problems
    assert f"{LAYER}: weight_scale has shape [4], FP8 stores one per-tensor value" in s, s


def test_the_recorded_algorithms_must_be_the_requested_ones(fp8, tmp_path):
    def relabel(t, q):
        q["quant_algo"], q["kv_cache_quant_algo"] = "NVFP4", None

    s = _structure(fp8, fp8.tampered(tmp_path / "relabel", relabel)).problems
    assert "hf_quant_config.json: quant_algo 'NVFP4', but quant.format=fp8 exports 'FP8'" in s
    assert "hf_quant_config.json: kv_cache_quant_algo None, but quant.kv_cache=fp8 exports 'FP8'" in s


@pytest.fixture(scope="module")
def awq(tmp_path_factory) -> exports.Export:
    return exports.write(tmp_path_factory.mktemp("awq") / "ckpt", "int4_awq")


def test_per_channel_and_per_group_scale_shapes_are_checked(export, tmp_path):
    """A scale of the wrong granularity (one too few channels, groups of the wrong size) fails naming the expected
    shape; so does a pre-quant scale of the wrong length."""
    if export.fmt == "fp8":
        pytest.skip("FP8's scales are per tensor (checked above)")
    name = "model.layers.0.self_attn.o_proj"

    def shrink(t, q):
        t[f"{name}.weight_scale"] = t[f"{name}.weight_scale"][:-1].clone()
        t[f"{name}.pre_quant_scale"] = t[f"{name}.pre_quant_scale"][:-1].clone()

    s = _structure(export, export.tampered(tmp_path / "shrunk", shrink)).problems
    out, inp = 128, 128
    want = f"[{out}]" if export.fmt == "int8_sq" else f"[{out}, {inp // export.group}] for group_size {export.group}"
    got = f"[{out - 1}]" if export.fmt == "int8_sq" else f"[{out - 1}, {inp // export.group}]"
    assert f"{name}: weight_scale has shape {got}, expected {want}" + (" (wrong block size)" if export.group else "") \
        in s, s
    assert f"{name}: pre_quant_scale has shape [{inp - 1}], expected [{inp}]" in s, s


def test_a_pre_quant_scale_that_differs_from_the_calibrated_one_fails_the_layer_check(awq, tmp_path):
    name = "model.layers.1.mlp.down_proj"

    def rescale(t, q):
        t[f"{name}.pre_quant_scale"] = (t[f"{name}.pre_quant_scale"].float() * 1.2).to(torch.bfloat16)

    lay = _layers(awq, awq.tampered(tmp_path / "pqs", rescale))
    assert [p.split(":")[0] for p in lay.problems] == [name], lay.problems


def test_an_awq_export_of_another_group_size_fails_on_every_scale_shape(awq):
    s = proof.check_structure(awq.dir, "int4_awq", "fp8", 32).problems
    assert "hf_quant_config.json: group_size 64, but int4_awq with quant.block_size=32 needs 32 (wrong block size)" in s
    assert f"{LAYER}: weight_scale has shape [128, 4], expected [128, 8] for group_size 32 (wrong block size)" in s, s


def test_the_numbers_rule_records_its_terms_and_accepts_an_export_exactly_at_the_limit():
    n = proof.check_numbers({"kl_mean": 0.1}, {"kl_mean": 0.032}, kl_abs=0.002, kl_frac=0.3)
    assert n.ok and n.details == {"kl": 0.032, "kl_max": pytest.approx(0.032), "kl_abs": 0.002, "kl_frac": 0.3,
                                  "kl_quantization": 0.1}
    assert not proof.check_numbers({"kl_mean": 0.1}, {"kl_mean": 0.0321}, kl_abs=0.002, kl_frac=0.3).ok


def test_the_sketch_is_a_fixed_seeded_projection_that_keeps_norms():
    """Seeded by the input size alone (the same after the cache is emptied, whatever torch's global seed), one
    column set of SKETCH_COLS, scaled so that E‖A R‖² = ‖A‖²."""
    proof._R_CACHE.clear()
    torch.manual_seed(1)
    first = proof.sketch_matrix(256).clone()
    assert first.shape == (256, proof.SKETCH_COLS) and first.dtype == torch.float32
    assert proof.sketch_matrix(256) is proof.sketch_matrix(256)  # cached
    proof._R_CACHE.clear()
    torch.manual_seed(2)
    assert torch.equal(proof.sketch_matrix(256), first)
    assert not torch.equal(proof.sketch_matrix(128), first[:128])  # another size, another projection
    a = torch.randn(512, 256, generator=torch.Generator().manual_seed(3))
    ratio = float(proof._sketch(a).norm() ** 2 / a.norm() ** 2)
    assert 0.9 < ratio < 1.1, ratio
    assert proof._sketch(a.to(torch.bfloat16)).dtype == torch.float32


def test_layers_missing_misshapen_or_unreadable_in_the_export_are_each_named(fp8, tmp_path):
    """Every broken layer is reported (the check goes on after the first), each with what is wrong with it."""
    gone, rows, cols, empty, unreadable = (f"model.layers.{i}.{p}" for i, p in (
        (0, "self_attn.q_proj"), (0, "self_attn.k_proj"), (0, "mlp.gate_proj"), (1, "mlp.up_proj"),
        (1, "self_attn.o_proj")))

    def damage(t, q):
        for p in ("weight", "weight_scale", "input_scale"):
            t.pop(f"{gone}.{p}")
        t[f"{rows}.weight"] = t[f"{rows}.weight"][:-1].clone()
        t[f"{cols}.weight"] = t[f"{cols}.weight"][:, :1].clone()
        t[f"{empty}.weight"] = t[f"{empty}.weight"][:, :0].clone()
        t[f"{unreadable}.weight_scale"] = torch.ones(3)  # no per-tensor scale: the dequantizer cannot broadcast it

    problems = _layers(fp8, fp8.tampered(tmp_path / "damaged", damage)).problems
    text = "\n".join(problems)
    assert f"{gone}: quantized in the calibrated model, missing from the export" in problems
    assert f"{rows}: exported weight has shape [63, 128], calibrated 64 rows" in problems, text
    assert f"{empty}: exported weight has shape [256, 0], calibrated 256 rows" in problems, text
    assert any(p.startswith(f"{cols}: the exported weight differs from the fake-quant weight") for p in problems), text
    assert any(p.startswith(f"{unreadable}: cannot dequantize the exported weight (RuntimeError: ") for p in problems), \
        text


def test_a_layer_quantized_only_in_the_export_is_named(fp8, tmp_path):
    def quantize_lm_head(t, q):
        t["lm_head.weight_scale"] = torch.tensor(0.01)

    problems = _layers(fp8, fp8.tampered(tmp_path / "extra", quantize_lm_head)).problems
    assert problems == ["lm_head: quantized in the export, not in the calibrated model"]


# --------------------------------------------------------------- what the proof records of the calibrated model
class _Quantizer(torch.nn.Module):
    """What the proof reads of a ModelOpt TensorQuantizer: ``is_enabled``, ``amax``, ``num_bits`` and, for a weight
    quantizer, the fake-quant call (here: rounding to a grid of 1/8)."""

    def __init__(self, amax=None, num_bits=(4, 3), enabled=True, pre_quant_scale=None):
        super().__init__()
        self.is_enabled, self.num_bits = enabled, num_bits
        self.amax = None if amax is None else torch.tensor(amax)
        self._pre_quant_scale = pre_quant_scale

    def forward(self, w):
        return torch.round(w.float() * 8) / 8


class _Linear(torch.nn.Linear):
    def __init__(self, n, *, weight_q=True, input_amax=None, num_bits=(4, 3), pqs=None):
        super().__init__(n, n, bias=False)
        self.weight_quantizer = _Quantizer(enabled=weight_q)
        self.input_quantizer = _Quantizer(input_amax, num_bits, pre_quant_scale=pqs)


class _Attention(torch.nn.Module):
    def __init__(self, k_amax, v_amax, num_bits=(4, 3)):
        super().__init__()
        self.k_bmm_quantizer = _Quantizer(k_amax, num_bits)
        self.v_bmm_quantizer = _Quantizer(v_amax, num_bits, enabled=v_amax is not None)


def _calibrated() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.fp8 = _Linear(32, input_amax=[44.8, 22.4])  # per-channel amax: the largest counts
    m.int8 = _Linear(32, input_amax=12.7, num_bits=8)
    m.nvfp4 = _Linear(32, input_amax=268.8, num_bits=(2, 1))
    m.odd = _Linear(32, input_amax=1.0, num_bits=5)  # no static scale for that format
    m.off = _Linear(32, weight_q=False)
    m.awq = _Linear(32, pqs=torch.full((32,), 2.0))
    m.attn = _Attention(4.48, None, num_bits=(2, 1))  # NVFP4 KV: a per-tensor scale of amax / 448 too
    return m.to(torch.bfloat16).requires_grad_(False)


def test_the_calibrated_scales_are_amax_over_the_formats_bound():
    scales = proof.calibrated_scales(_calibrated())
    assert set(scales) == {"fp8", "int8", "nvfp4", "attn.k"}
    assert scales["fp8"] == ("input", pytest.approx(0.1)) and scales["int8"] == ("input", pytest.approx(0.1))
    assert scales["nvfp4"] == ("input", pytest.approx(0.1)) and scales["attn.k"] == ("kv", pytest.approx(0.01))


def test_the_record_sketches_each_enabled_weight_quantizer_with_its_error():
    model = _calibrated()
    ref = proof.record(model)
    assert set(ref.layers) == {"fp8", "int8", "nvfp4", "odd", "awq"}  # "off" is not quantized
    assert [n for n, _ in proof.quantized_linears(model)] == ["fp8", "int8", "nvfp4", "odd", "awq"]
    for name, layer in ref.layers.items():
        w = getattr(model, name).weight
        fq = (torch.round(w.float() * 8) / 8).to(torch.bfloat16).float()
        scale = 2.0 if name == "awq" else 1.0
        assert layer.dtype == torch.bfloat16
        assert layer.quant_error == pytest.approx(float((fq - w.float()).norm()) * scale, rel=1e-5)
        assert torch.allclose(layer.sketch, proof._sketch(fq * scale))
    assert ref.scales == proof.calibrated_scales(model)
    assert ref.to_json()["layers"]["awq"] == {"quant_error": ref.layers["awq"].quant_error}
    assert ref.to_json()["scales"]["attn.k"] == {"kind": "kv", "value": ref.scales["attn.k"][1]}


def test_resketch_follows_the_rounded_weights_and_keeps_the_original_error():
    model = _calibrated()
    ref = proof.record(model)
    errors = {n: layer.quant_error for n, layer in ref.layers.items()}
    with torch.no_grad():
        model.fp8.weight.mul_(2)
    proof.resketch(model, ref)
    fq = (torch.round(model.fp8.weight.float() * 8) / 8).to(torch.bfloat16).float()
    assert torch.allclose(ref.layers["fp8"].sketch, proof._sketch(fq))
    awq = (torch.round(model.awq.weight.float() * 8) / 8).to(torch.bfloat16).float() * 2.0
    assert torch.allclose(ref.layers["awq"].sketch, proof._sketch(awq))
    assert {n: layer.quant_error for n, layer in ref.layers.items()} == errors


# ------------------------------------------------------------------------------ the structure check, rule by rule
def _rewrite_config(ckpt, **changes):
    import json

    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(changes)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def test_a_missing_lm_head_is_fine_only_when_the_embeddings_are_tied(fp8, tmp_path):
    ckpt = fp8.tampered(tmp_path / "no-head", lambda t, q: t.pop("lm_head.weight"))
    assert _structure(fp8, ckpt).problems == ["lm_head: no weight in the export"]
    _rewrite_config(ckpt, tie_word_embeddings=True)
    assert _structure(fp8, ckpt).problems == []
    # the export's own quantization_config in config.json is no obstacle to reading the architecture
    _rewrite_config(ckpt, quantization_config={"quant_method": "modelopt", "quant_algo": "FP8"})
    linears, attention, tied = proof.architecture(ckpt)
    assert tied is True and "lm_head" in linears and len(attention) == 2


@pytest.mark.parametrize("edit, expected", [
    (lambda t, q: q["exclude_modules"].append(LAYER), f"{LAYER}: carries weight_scale, but hf_quant_config.json "
                                                       f"excludes it from quantization"),
    (lambda t, q: t.__setitem__("lm_head.weight", t["lm_head.weight"].to(torch.int8)),
     "lm_head: excluded layer stored as I8, not a float dtype"),
    (lambda t, q: t.__setitem__(f"{LAYER}.weight", t[f"{LAYER}.weight"].reshape(1, 128, 256)),
     f"{LAYER}: weight has shape [1, 128, 256], not 2-D"),
    (lambda t, q: t.__setitem__(f"{LAYER}.weight_scale", torch.tensor(0.0)),
     f"{LAYER}: weight_scale is 0.0, not a positive finite scale"),
    (lambda t, q: t.__setitem__(f"{LAYER}.input_scale", torch.tensor(float("nan"))),
     f"{LAYER}: input_scale is nan, not a positive finite scale"),
    (lambda t, q: t.__setitem__(f"{LAYER}.weight_scale", torch.tensor(1.0, dtype=torch.bfloat16)),
     f"{LAYER}: weight_scale is BF16, FP8 stores F32"),
    (lambda t, q: t.__setitem__(f"{LAYER}.weight_scale_2", torch.tensor(1.0)),
     f"{LAYER}: weight_scale_2 is not part of the FP8 layout"),
    (lambda t, q: t.pop(f"{LAYER}.weight"), f"{LAYER}: no weight in the export"),
    (lambda t, q: t.__setitem__(f"{ATTN}.k_proj.k_scale", torch.tensor([0.1, 0.2])),
     f"{ATTN}: k_scale is F32 [2], ModelOpt stores one fp32 value"),
    (lambda t, q: t.__setitem__(f"{ATTN}.k_proj.k_scale", torch.tensor(-1.0)),
     f"{ATTN}: k_scale is -1.0, not a positive finite scale"),
])
def test_each_structure_rule_names_its_fault(fp8, tmp_path, edit, expected):
    problems = _structure(fp8, fp8.tampered(tmp_path / "t", edit)).problems
    assert expected in problems, problems


def test_kv_scales_without_a_quantized_kv_cache_and_none_where_one_is_requested(fp8, tmp_path):
    s = proof.check_structure(fp8.dir, "fp8", "none").problems
    assert f"{ATTN}: k_proj.k_scale present, but quant.kv_cache=none" in s
    assert "hf_quant_config.json: kv_cache_quant_algo 'FP8', but quant.kv_cache=none exports None" in s

    def no_kv(t, q):
        for k in [k for k in t if k.endswith(("k_scale", "v_scale"))]:
            del t[k]
    s = _structure(fp8, fp8.tampered(tmp_path / "nokv", no_kv)).problems
    assert "nothing was quantized in the KV cache: no k_scale/v_scale in the export (FP8 requested)" in s


def test_the_group_size_each_format_needs(awq, fp8):
    s = proof.check_structure(awq.dir, "w4a8_awq", "fp8").problems  # W4A8's default group is 128
    assert "hf_quant_config.json: group_size 64, but w4a8_awq with quant.block_size=128 needs 128 (wrong block size)" \
        in s, s
    s = proof.check_structure(fp8.dir, "nvfp4", "fp8").problems
    assert "hf_quant_config.json: group_size None, but nvfp4 with NVFP4 blocks of 16 needs 16 (wrong block size)" in s
    assert proof.check_structure(awq.dir, "int4_awq", "fp8", 64).problems == []


def test_an_export_without_hf_quant_config_is_not_quantized(fp8, tmp_path):
    import shutil

    ckpt = tmp_path / "plain"
    shutil.copytree(fp8.dir, ckpt)
    (ckpt / "hf_quant_config.json").unlink()
    assert proof.check_structure(ckpt, "none", "none").problems == [
        "nothing was quantized: the export has no hf_quant_config.json, so it is not a ModelOpt quantized checkpoint "
        "(no weight quantization, KV None requested)"]


def test_the_bytes_per_parameter_bound_and_the_recorded_details(fp8, monkeypatch):
    import dataclasses

    d = _structure(fp8).details
    assert d["quant_algo"] == "FP8" and d["kv_cache_quant_algo"] == "FP8" and d["exclude_modules"] == ["lm_head"]
    assert d["excluded_linears"] == 1 and d["quantized_linears"] == 14
    assert 1.0 < d["quantized_bytes_per_param"] < 1.001 and d["fraction_of_bf16"] == pytest.approx(0.5, abs=1e-3)
    assert d["fraction_of_bf16"] == round(d["fraction_of_bf16"], 4) and d["fraction_of_bf16"] != 0.5
    monkeypatch.setitem(proof.LAYOUTS, "FP8", dataclasses.replace(proof.LAYOUTS["FP8"], bf16_fraction_max=0.45))
    s = _structure(fp8).problems
    assert s == ["quantized linears take 1.000 bytes per parameter, 0.50× bf16; FP8 must stay under 0.45× bf16"], s


def test_the_checkpoint_counts_bytes_by_dtype(fp8):
    t = proof.Checkpoint(fp8.dir)
    assert t.nbytes(f"{LAYER}.weight") == 128 * 256 and t.nbytes(f"{LAYER}.weight_scale") == 4
    assert t.nbytes("model.norm.weight") == 128 * 2
    assert f"{LAYER}.weight" in t and "nope" not in t and len(t.keys()) > 50


def test_the_layer_details_and_a_zero_fake_quant_weight(fp8):
    import copy

    lay = _layers(fp8)
    assert lay.details["activation_scales"] == 14 and lay.details["kv_scales"] == 4
    assert lay.details["mean_ratio"] == round(lay.details["mean_ratio"], 5) and lay.details["max_ratio"] == 0.25
    empty = proof.check_layers(fp8.dir, proof.Reference(), 0.25)
    assert empty.details["layers"] == 0 and empty.details["mean_ratio"] is None
    assert empty.details["worst_layer"] is None and empty.details["worst_ratio"] is None
    assert empty.problems == [f"{n}: quantized in the export, not in the calibrated model"
                              for n in sorted(fp8.ref.layers)]
    ref = copy.deepcopy(fp8.ref)
    ref.layers[LAYER].sketch = torch.zeros_like(ref.layers[LAYER].sketch)  # no direction to compare a scale with
    mine = [p for p in proof.check_layers(fp8.dir, ref, 0.25).problems if p.startswith(LAYER)]
    assert len(mine) == 1 and "the quantization error (max 0.25)" in mine[0] and "wrong weight scale" not in mine[0]


def test_every_faulty_layer_is_named_not_only_the_first(fp8, tmp_path):
    """One fault per layer, in the architecture's order: the check goes on after each."""
    p0, p1 = "model.layers.0", "model.layers.1"

    def faults(t, q):
        t.pop(f"{p0}.self_attn.q_proj.weight")
        q["exclude_modules"] = [*q["exclude_modules"], f"{p0}.self_attn.k_proj"]
        for part in ("weight_scale", "input_scale"):
            t.pop(f"{p0}.self_attn.v_proj.{part}")
        t[f"{p0}.self_attn.v_proj.weight"] = fp8.original[f"{p0}.self_attn.v_proj"].clone()
        t[f"{p0}.self_attn.o_proj.weight"] = t[f"{p0}.self_attn.o_proj.weight"].view(torch.int8)
        t[f"{p0}.mlp.gate_proj.weight"] = t[f"{p0}.mlp.gate_proj.weight"].reshape(1, 256, 128)
        t.pop(f"{p0}.mlp.up_proj.input_scale")
        t[f"{p0}.mlp.down_proj.weight_scale"] = t[f"{p0}.mlp.down_proj.weight_scale"].repeat(2)
        t[f"{p1}.self_attn.q_proj.input_scale"] = torch.tensor(-1.0)
        t[f"{p1}.self_attn.k_proj.weight_scale"] = t[f"{p1}.self_attn.k_proj.weight_scale"].to(torch.float16)

    s = _structure(fp8, fp8.tampered(tmp_path / "faults", faults)).problems
    expected = [f"{p0}.self_attn.q_proj: no weight in the export",
                f"{p0}.self_attn.k_proj: carries weight_scale, but hf_quant_config.json excludes it",
                f"{p0}.self_attn.v_proj: unquantized weights (BF16, no weight_scale)",
                f"{p0}.self_attn.o_proj: weight is I8, FP8 stores F8_E4M3",
                f"{p0}.mlp.gate_proj: weight has shape [1, 256, 128], not 2-D",
                f"{p0}.mlp.up_proj: input_scale missing (FP8 stores weight_scale, input_scale; dropped scale)",
                f"{p0}.mlp.down_proj: weight_scale has shape [2], FP8 stores one per-tensor value",
                f"{p1}.self_attn.q_proj: input_scale is -1.0, not a positive finite scale",
                f"{p1}.self_attn.k_proj: weight_scale is F16, FP8 stores F32"]
    for want in expected:
        assert any(p.startswith(want) for p in s), (want, s)


# ------------------------------------------------------------------- rules each found by one planted fault (mutants)
def _as_nvfp4(t, q):
    """The FP8 export's tensors in NVFP4's layout (structure only): two e2m1 per byte along the input, one e4m3 scale
    per 16 inputs, a global fp32 weight_scale_2."""
    for name in exports._linears():
        out, inp = t[f"{name}.weight"].shape
        t[f"{name}.weight"] = torch.zeros(out, inp // 2, dtype=torch.uint8)
        t[f"{name}.weight_scale"] = torch.ones(out, inp // 16).to(torch.float8_e4m3fn)
        t[f"{name}.weight_scale_2"] = torch.tensor(0.01)
    q.update(quant_algo="NVFP4", group_size=16)


def test_nvfp4_packs_along_the_input_and_every_missing_scale_is_named(fp8, tmp_path):
    ckpt = fp8.tampered(tmp_path / "nvfp4", _as_nvfp4)
    s = proof.check_structure(ckpt, "nvfp4", "fp8")
    assert s.problems == [] and s.details["quantized_linears"] == 14
    assert s.details["quantized_bytes_per_param"] == pytest.approx(0.5 + 1 / 16, abs=1e-3)

    def drop(t, q):
        _as_nvfp4(t, q)
        del t[f"{LAYER}.weight_scale_2"], t[f"{LAYER}.input_scale"]

    s = proof.check_structure(fp8.tampered(tmp_path / "dropped", drop), "nvfp4", "fp8").problems
    assert s == [f"{LAYER}: {part} missing (NVFP4 stores weight_scale, weight_scale_2, input_scale; dropped scale)"
                 for part in ("weight_scale_2", "input_scale")]


def test_a_scale_dtype_outside_the_layout_names_every_dtype_it_allows(awq, tmp_path):
    ckpt = awq.tampered(tmp_path / "i32", lambda t, q: t.__setitem__(
        f"{LAYER}.weight_scale", t[f"{LAYER}.weight_scale"].to(torch.int32)))
    assert _structure(awq, ckpt).problems == [f"{LAYER}: weight_scale is I32, W4A16_AWQ stores BF16/F16/F32"]


def test_an_input_size_the_group_does_not_divide_is_named_once_per_layer(awq):
    s = proof.check_structure(awq.dir, "int4_awq", "fp8", 96).problems  # 96 divides neither 128 nor 256
    assert [p for p in s if p.startswith(f"{LAYER}:")] == [
        f"{LAYER}: input size 256 is not a multiple of group_size 96 (wrong block size)"]
    assert None not in s and s[0].startswith("hf_quant_config.json: group_size 64")


def test_a_bias_is_part_of_any_layout_and_not_counted_as_quantized_bytes(fp8, tmp_path):
    ckpt = fp8.tampered(tmp_path / "bias", lambda t, q: t.__setitem__(
        f"{LAYER}.bias", torch.zeros(128, dtype=torch.bfloat16)))
    s = _structure(fp8, ckpt)
    assert s.problems == []
    assert s.details["quantized_bytes_per_param"] == _structure(fp8).details["quantized_bytes_per_param"]


def test_one_quantized_layer_is_enough_and_none_is_named(fp8, tmp_path):
    names = list(exports._linears())

    def keep(n):
        def edit(t, q):
            for name in names[n:]:
                for part in ("weight_scale", "input_scale"):
                    del t[f"{name}.{part}"]
                t[f"{name}.weight"] = fp8.original[name].clone()
            q["exclude_modules"] = [*q["exclude_modules"], *names[n:]]
        return edit

    one = _structure(fp8, fp8.tampered(tmp_path / "one", keep(1)))
    assert one.problems == [] and one.details["quantized_linears"] == 1 and one.details["excluded_linears"] == 14
    none = _structure(fp8, fp8.tampered(tmp_path / "none", keep(0)))
    assert none.problems == ["nothing was quantized: the export carries no FP8 weights (every linear layer is excluded "
                             "or unquantized)"]


def test_both_missing_kv_scales_are_named_and_a_zero_one_is_refused(fp8, tmp_path):
    def drop(t, q):
        del t[f"{ATTN}.k_proj.k_scale"], t[f"{ATTN}.v_proj.v_scale"]

    assert _structure(fp8, fp8.tampered(tmp_path / "nokv", drop)).problems == [
        f"{ATTN}: {w}_proj.{w}_scale missing, but the KV cache is quantized (FP8) (dropped scale)" for w in "kv"]
    zero = fp8.tampered(tmp_path / "zero", lambda t, q: t.__setitem__(f"{ATTN}.v_proj.v_scale", torch.tensor(0.0)))
    assert _structure(fp8, zero).problems == [f"{ATTN}: v_scale is 0.0, not a positive finite scale"]


def test_the_structure_details_record_the_group_size_and_bytes_per_parameter(awq, fp8):
    d = _structure(awq).details
    assert d["group_size"] == 64 and _structure(fp8).details["group_size"] is None
    bpp = _structure(fp8).details["quantized_bytes_per_param"]
    # FP8: one byte per weight plus two fp32 scalars (weight_scale, input_scale) per layer, to 4 decimals
    params = sum(o * i for o, i in exports._linears().values())
    assert bpp == round((params + 8 * 14) / params, 4)


def test_a_quant_config_without_its_quantization_section_is_empty_not_missing(fp8, tmp_path):
    import json
    import shutil

    ckpt = tmp_path / "bare"
    shutil.copytree(fp8.dir, ckpt)
    (ckpt / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}}))
    assert proof.quant_config(ckpt) == {}
    assert proof.check_structure(ckpt, "fp8", "fp8").problems[:2] == [
        "hf_quant_config.json: quant_algo None, but quant.format=fp8 exports 'FP8'",
        "hf_quant_config.json: kv_cache_quant_algo None, but quant.kv_cache=fp8 exports 'FP8'"]


def test_quantizers_without_the_attributes_modelopt_sets_count_as_absent():
    class Bare:  # a quantizer object that lacks is_enabled / amax / _pre_quant_scale
        num_bits = (4, 3)

    m = torch.nn.Module()
    m.lin = torch.nn.Linear(4, 4, bias=False)
    m.lin.weight_quantizer = Bare()
    m.lin.input_quantizer = Bare()
    m.plain = torch.nn.Linear(4, 4, bias=False)
    assert list(proof.quantized_linears(m)) == []
    assert proof._pre_quant_scale(m.lin) is None and proof._pre_quant_scale(m.plain) is None
    m.lin.input_quantizer.is_enabled = True  # enabled, but never calibrated: no amax
    assert proof.calibrated_scales(m) == {}


def test_both_kv_scales_are_collected_and_a_disabled_quantizers_amax_is_not():
    m = torch.nn.Module()
    m.attn = _Attention(4.48, 8.96)
    m.lin = _Linear(8, input_amax=44.8)
    m.lin.input_quantizer.is_enabled = False  # calibrated, then disabled: not a static scale of the export
    assert proof.calibrated_scales(m) == {"attn.k": ("kv", pytest.approx(0.01)), "attn.v": ("kv", pytest.approx(0.02))}


def test_a_layer_off_by_noise_not_scale_gets_no_scale_hint(export, tmp_path):
    import re

    ckpt = export.tampered(tmp_path / "excluded", _unquantize(export, exclude=True))
    msg = [p for p in _layers(export, ckpt).problems if "the exported weight differs" in p]
    bound = shipped_ratio(export.fmt)
    assert len(msg) == 1 and re.fullmatch(rf"{LAYER}: the exported weight differs from the fake-quant weight by "
                                          rf"[0-9.]+× the quantization error \(max {bound:g}\)", msg[0]), msg


def test_the_scale_hint_needs_only_a_nonzero_fake_quant_weight(fp8):
    import copy

    ref = copy.deepcopy(fp8.ref)
    layer = ref.layers[LAYER]
    c = 0.5 / float(layer.sketch.norm())  # a fake-quant sketch of squared norm 0.25, below 1
    layer.sketch = layer.sketch * c
    mine = [p for p in proof.check_layers(fp8.dir, ref, 0.25).problems if p.startswith(LAYER)]
    assert len(mine) == 1 and f"it is {1 / c:.3g}× the fake-quant weight (a wrong weight scale)" in mine[0], mine


def test_a_ratio_equal_to_the_bound_passes_and_the_ratios_are_recorded_to_5_decimals(fp8, tmp_path):
    assert proof.check_layers(fp8.dir, fp8.ref, 0.0).problems == []  # the untouched export scores exactly 0
    lay = _layers(fp8, fp8.tampered(tmp_path / "scaled", _scaled(1.1)))
    worst, mean = lay.details["worst_ratio"], lay.details["mean_ratio"]
    assert isinstance(worst, float) and worst == round(worst, 5) and worst > 2  # not an int, not 6 decimals
    assert isinstance(mean, float) and mean == round(mean, 5)
    assert mean == pytest.approx(worst / 14, abs=1e-5)  # one faulty layer of 14, the others at 0


def test_every_missing_scale_is_named_and_one_exactly_at_the_tolerance_passes(fp8):
    t = proof.Checkpoint(fp8.dir)
    a, b = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
    assert proof.scale_problems(t, {"x.y": ("input", 1.0), "x.z": ("input", 2.0)}) == [
        "x.y.input_scale: missing; the calibrated model has this activation scale (1)",
        "x.z.input_scale: missing; the calibrated model has this activation scale (2)"]
    got = float(t.get(f"{a}.input_scale").float())
    # |got - want| == rtol × want exactly (powers of two): within the tolerance
    assert proof.scale_problems(t, {a: ("input", got / 2)}, rtol=1.0) == []
    assert proof.scale_problems(t, {b: ("input", got / 2)}, rtol=1.0) != []  # another layer's value


def test_the_bf16_fraction_bound_is_exclusive_to_the_last_bit(fp8, monkeypatch):
    import dataclasses

    params = sum(o * i for o, i in exports._linears().values())
    fraction = ((params + 8 * 14) / params) / 2.0  # FP8: a byte per weight, two fp32 scalars per layer
    layout = proof.LAYOUTS["FP8"]
    monkeypatch.setitem(proof.LAYOUTS, "FP8", dataclasses.replace(layout, bf16_fraction_max=fraction))
    assert _structure(fp8).problems == []  # exactly at the bound
    monkeypatch.setitem(proof.LAYOUTS, "FP8", dataclasses.replace(layout, bf16_fraction_max=math.nextafter(fraction, 0)))
    assert [p.split(";")[1] for p in _structure(fp8).problems] == [
        f" FP8 must stay under {math.nextafter(fraction, 0):g}× bf16"]


def _composite(tmp_path, top, text):
    """A Gemma 3 config (text and vision parts, as composite checkpoints write them) with the tie flags given."""
    import json

    from transformers import Gemma3Config

    cfg = Gemma3Config(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=300),
                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, image_size=28, patch_size=14)).to_dict()
    cfg["tie_word_embeddings"], cfg["text_config"]["tie_word_embeddings"] = top, text
    if top is None:
        del cfg["tie_word_embeddings"]
    d = tmp_path / f"gemma3-{top}-{text}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("top, text, tied", [(True, False, True), (False, True, True), (False, False, False)])
def test_tied_embeddings_are_read_from_the_config_or_its_text_part(tmp_path, top, text, tied):
    linears, attention, got = proof.architecture(_composite(tmp_path, top, text))
    assert got is tied
    assert "lm_head" in linears and "model.language_model.layers.0.self_attn" in attention


def test_a_config_without_a_tie_flag_is_untied(tmp_path):
    import json

    from transformers import AutoConfig

    # mllama's top-level config has no tie_word_embeddings at all (transformers 5); its text part says False
    cfg = AutoConfig.for_model("mllama", text_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=300, cross_attention_layers=[1], pad_token_id=0, bos_token_id=1, eos_token_id=2),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_global_layers=1,
                           attention_heads=2, image_size=28, patch_size=14, vision_output_dim=64)).to_dict()
    assert "tie_word_embeddings" not in cfg
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert proof.architecture(tmp_path)[2] is False


# ------------------------------------------------ cases no synthetic export reaches (docs/mutation.md's survivors)
def _fake_architecture(monkeypatch, model, config):
    """architecture() reading ``config`` and building ``model`` in place of transformers' Auto classes."""
    import transformers

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda ckpt: config)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", lambda cfg: model)


class _KOnly(torch.nn.Module):
    def __init__(self, k=True, v=True):
        super().__init__()
        if k:
            self.k_proj = torch.nn.Linear(4, 4)
        if v:
            self.v_proj = torch.nn.Linear(4, 4)


def test_an_attention_layer_needs_both_a_linear_k_proj_and_v_proj(monkeypatch, tmp_path):
    from types import SimpleNamespace

    model = torch.nn.Module()
    model.both, model.k_only, model.v_only = _KOnly(), _KOnly(v=False), _KOnly(k=False)
    model.k_not_linear = _KOnly(v=False)
    model.k_not_linear.v_proj = torch.nn.Identity()  # a v_proj that is no linear layer
    config = SimpleNamespace(tie_word_embeddings=False, get_text_config=lambda: SimpleNamespace())
    _fake_architecture(monkeypatch, model, config)
    linears, attention, tied = proof.architecture(tmp_path)
    assert attention == ["both"], attention
    assert "k_only.k_proj" in linears and "v_only.v_proj" in linears and tied is False


@pytest.mark.parametrize("top", [None, False])
def test_a_text_config_without_a_tie_flag_is_untied(monkeypatch, tmp_path, top):
    """Neither the config nor its text part names tie_word_embeddings (or the top says False): not tied."""
    from types import SimpleNamespace

    config = SimpleNamespace(get_text_config=lambda: SimpleNamespace())
    if top is not None:
        config.tie_word_embeddings = top
    _fake_architecture(monkeypatch, torch.nn.Module(), config)
    assert proof.architecture(tmp_path) == ([], [], False)


def test_a_tied_absent_lm_head_before_other_layers_skips_only_itself(fp8, tmp_path, monkeypatch):
    """A model whose lm_head is not its last linear layer: the layers after a tied, absent head are still checked."""
    ckpt = fp8.tampered(tmp_path / "no-head", lambda t, q: t.pop("lm_head.weight"))
    real = proof.architecture

    def head_first(c):
        linears, attention, _ = real(c)
        return ["lm_head"] + [n for n in linears if n != "lm_head"], attention, True
    monkeypatch.setattr(proof, "architecture", head_first)
    s = _structure(fp8, ckpt)
    assert s.problems == [] and s.details["quantized_linears"] == 14, s.problems


def test_a_tensors_bytes_are_what_its_shard_stores(tmp_path):
    """Every dtype's size is the file's own (safetensors' ``data_offsets``), not a table of known dtypes: I16 is
    2 bytes an element, BOOL 1, F8_E4M3 1; the bytes-per-parameter bound of check_structure reads these."""
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 5, dtype=torch.int16), "b": torch.zeros(7, dtype=torch.bool),
               "c": torch.zeros(2, 4, dtype=torch.float8_e4m3fn)}, str(tmp_path / "model.safetensors"))
    save_file({"d": torch.zeros(6, dtype=torch.bfloat16)}, str(tmp_path / "model-2.safetensors"))
    t = proof.Checkpoint(tmp_path)
    assert (t.dtype("a"), t.dtype("b"), t.dtype("c")) == ("I16", "BOOL", "F8_E4M3")
    assert (t.nbytes("a"), t.nbytes("b"), t.nbytes("c"), t.nbytes("d")) == (15 * 2, 7, 8, 12)
