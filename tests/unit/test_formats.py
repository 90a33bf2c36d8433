"""The format registry (pipeline/formats/): discovery of the format modules, and every place derived from them: the
schema's enums, the config defaults (tolerances), the conf presets (which hold no format fact), the derived tables
(compat, TensorRT-LLM refusals), the reference runtime (the registry passed in, the copy a model repository gets) and
the stage fingerprints (the code digest, the package stage's copies). Each check has a planted negative control."""
from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipeline import compat, config, formats, hardware, schema

from pipeline.runner import executor as runner, fingerprint
from pipeline.formats import FormatError, KVFormat, QuantFormat, Tolerances

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pipeline" / "formats"
PRESET_KEYS = {"format", "kv_cache", "calib", "block_size"}  # what a conf/quant preset may hold: no format fact


def coverage_problems(registry: dict, kv_registry: dict, conf: Path = ROOT / "conf" / "quant") -> list[str]:
    """Where the schema, the conf presets or the reference runtime disagree with a registry."""
    out = []
    want, want_kv = [f.value for f in schema.QuantFormat], [k.value for k in schema.KVFormat]
    if list(registry) != want:
        out.append(f"weight formats: registry {list(registry)} != schema {want}")
    if list(kv_registry) != want_kv:
        out.append(f"KV formats: registry {list(kv_registry)} != schema {want_kv}")
    for name, spec in registry.items():
        preset = conf / f"{name}.yaml"
        if not preset.is_file():
            out.append(f"conf/quant/{name}.yaml is missing")
            continue
        doc = yaml.safe_load(preset.read_text())
        if doc.get("format") != name:
            out.append(f"conf/quant/{name}.yaml: format {doc.get('format')!r}, not {name!r}")
        if set(doc) - PRESET_KEYS:
            out.append(f"conf/quant/{name}.yaml copies format facts {sorted(set(doc) - PRESET_KEYS)}: they are "
                       f"pipeline/formats/{name}.py's")
        if ("block_size" in doc) != spec.awq:  # only AWQ formats take quant.block_size
            out.append(f"conf/quant/{name}.yaml: block_size is for AWQ formats only")
        if spec.quant_algo is not None and not callable(spec.dequantize):
            out.append(f"{name}: the reference runtime cannot dequantize {spec.quant_algo}")
    for name, spec in kv_registry.items():
        if spec.quant_algo is not None and not callable(spec.quantize_kv):
            out.append(f"KV {name}: the reference runtime cannot quantize a {spec.quant_algo} KV cache")
    return out


def test_registry_covers_schema_conf_and_reference_runtime():
    assert coverage_problems(formats.FORMATS, formats.KV_FORMATS) == []
    assert list(formats.FORMATS) == ["none", "fp8", "int4_awq", "nvfp4", "w4a8_awq", "int8_sq",  # none, preference,
                                     "fp8_per_channel_per_token", "mxfp8", "nvfp4_awq", "w4a16_nvfp4",
                                     "w4a8_nvfp4_fp8"]  # then unranked by name
    assert list(formats.KV_FORMATS) == ["none", "fp8", "fp8_cast", "nvfp4", "nvfp4_cast"]
    assert set(formats.MODULES) == {p.stem for p in PACKAGE.glob("*.py") if not p.name.startswith("_")}


def test_planted_missing_extra_and_copied_formats_fail(tmp_path):
    missing = {k: v for k, v in formats.FORMATS.items() if k != "int8_sq"}
    assert any("weight formats" in p for p in coverage_problems(missing, formats.KV_FORMATS))
    mxfp4 = QuantFormat(name="mxfp4", preset=None, quant_algo=None, weight_bytes=0.5, sms=formats.BLACKWELL,
                        sm_needs="Blackwell", runtimes=frozenset(), tolerances=formats.FORMATS["fp8"].tolerances)
    found = coverage_problems({**formats.FORMATS, "mxfp4": mxfp4}, formats.KV_FORMATS)
    assert any("weight formats" in p for p in found) and any("mxfp4.yaml" in p for p in found)
    kv_missing = {k: v for k, v in formats.KV_FORMATS.items() if k != "nvfp4"}
    assert any("KV formats" in p for p in coverage_problems(formats.FORMATS, kv_missing))
    conf = tmp_path / "quant"
    shutil.copytree(ROOT / "conf" / "quant", conf)
    with open(conf / "fp8.yaml", "a") as f:  # a preset that copies a number back
        f.write("thresholds: {kl_max: 0.1}\n")
    assert coverage_problems(formats.FORMATS, formats.KV_FORMATS, conf) == [
        "conf/quant/fp8.yaml copies format facts ['thresholds']: they are pipeline/formats/fp8.py's"]


@pytest.mark.parametrize("name", list(formats.FORMATS))
def test_the_preset_composes_with_the_module_tolerances(name):
    t = formats.FORMATS[name].tolerances
    cfg = hardware.compose(["model=tiny-qwen3", f"quant={name}"])
    q = config.to_plain(cfg.quant)
    assert q["thresholds"] == {"kl_max": t.kl_max, "top1_min": t.top1_min, "ppl_ratio_max": t.ppl_ratio_max}
    assert (q["eval"]["export_kl_abs"], q["eval"]["export_kl_frac"], q["eval"]["export_weight_ratio"]) == (
        t.export_kl_abs, t.export_kl_frac, t.export_weight_ratio)
    assert config.to_plain(cfg.eval.max_drop) == {n: f.tolerances.max_drop for n, f in formats.FORMATS.items()}


def test_an_override_wins_over_the_module_and_a_wrong_one_is_refused():
    cfg = hardware.compose(["model=tiny-qwen3", "quant=nvfp4", "quant.thresholds.kl_max=0.33",
                          "quant.eval.export_kl_frac=0.9", "eval.max_drop.nvfp4=0.2"])
    assert cfg.quant.thresholds.kl_max == 0.33 and cfg.quant.eval.export_kl_frac == 0.9
    assert cfg.quant.thresholds.top1_min == formats.FORMATS["nvfp4"].tolerances.top1_min  # the rest: the module's
    assert cfg.eval.max_drop.nvfp4 == 0.2 and cfg.eval.max_drop.fp8 == formats.FORMATS["fp8"].tolerances.max_drop
    with pytest.raises(Exception, match="quant.thresholds.top1_min=1.5 is out of range"):
        hardware.compose(["model=tiny-qwen3", "quant=fp8", "quant.thresholds.top1_min=1.5"])


def test_the_resolver_names_an_unknown_format_or_fact():
    assert schema.format_fact(schema.QuantFormat.fp8, "tolerances.kl_max") == formats.FORMATS["fp8"].tolerances.kl_max
    with pytest.raises(ValueError, match="no format module pipeline/formats/mxfp4.py"):
        schema.format_fact("mxfp4", "tolerances.kl_max")
    with pytest.raises(ValueError, match="has no 'tolerances.kl_maxx'"):
        schema.format_fact("fp8", "tolerances.kl_maxx")


def test_derived_tables_read_the_registry():
    assert compat.QUANT_SM["nvfp4"].sms == formats.BLACKWELL
    assert compat.RUNTIME_QUANT["trtllm_llmapi"] == set(formats.FORMATS) - {"int8_sq"}
    assert compat.RUNTIME_QUANT["trtllm_engine"] == {"none", "fp8", "int4_awq", "nvfp4", "w4a8_awq", "int8_sq"}
    assert formats.FORMATS["int4_awq"].export_group(None) == formats.AWQ_GROUP
    assert formats.FORMATS["int4_awq"].export_group(64) == 64
    assert formats.FORMATS["nvfp4"].export_group(64) == formats.nvfp4.NVFP4_BLOCK  # the NVFP4 block is fixed
    assert formats.AWQ_FORMATS == ("int4_awq", "w4a8_awq")
    assert formats.PREFERENCE == ("fp8", "int4_awq", "nvfp4", "w4a8_awq", "int8_sq")
    assert set(formats.BY_ALGO) == {"FP8", "W4A16_AWQ", "W4A8_AWQ", "NVFP4", "W8A8_SQ_PER_CHANNEL",
                                    "FP8_PER_CHANNEL_PER_TOKEN", "MXFP8", "NVFP4_AWQ", "W4A16_NVFP4",
                                    "W4A8_NVFP4_FP8"}
    assert {n for n, f in formats.FORMATS.items() if f.trtllm_lines == ("main",)} == {"mxfp8", "nvfp4_awq",
                                                                                       "w4a16_nvfp4"}


def test_a_format_only_main_loads_is_refused_for_a_1_2_runtime_and_allowed_on_main():
    refused = compat.problems("nvfp4_awq", "fp8", "b200", 100, "cuda", "trtllm_llmapi", "1.2.1")
    assert refused == ["nvfp4_awq (NVFP4_AWQ) is loaded by TensorRT-LLM main only, not by the 1.2.1 line that "
                       "runtime.trtllm_version names; no final release after 1.2.1 is recorded (docs/formats.md), "
                       "so use quant=nvfp4 or runtime=reference"]
    assert compat.problems("nvfp4_awq", "fp8", "b200", 100, "cuda", "trtllm_llmapi", "main") == []
    assert compat.problems("nvfp4_awq", "fp8", "cpu", 0, "cpu", "reference", "1.2.1") == []  # dequantized on CPU
    assert compat.problems("w4a8_nvfp4_fp8", "fp8", "b200", 100, "cuda", "trtllm_llmapi", "1.2.1") == []
    with pytest.raises(FormatError, match=r"unknown TensorRT-LLM lines \['1.3'\]"):
        QuantFormat(name="x", preset=None, quant_algo=None, weight_bytes=2.0, sms=(90,), sm_needs="",
                    runtimes=frozenset(), tolerances=formats.FORMATS["fp8"].tolerances, trtllm_lines=("1.3",))


def refusal_problems(registry: dict) -> list[str]:
    """Every rule a format opts into is a rule of pipeline/upstream/rules.yaml (which keeps its upstream source)."""
    from pipeline.upstream import rules

    known = set(rules.record()["rules"])
    return [f"{n}: no rule {r!r} in pipeline/upstream/rules.yaml" for n, f in registry.items()
            for r in sorted(f.trtllm_refusals - known)]


def test_trtllm_refusals_are_rules_yaml_rules_and_reach_the_rule():
    from pipeline.upstream import rules

    assert refusal_problems(formats.FORMATS) == []
    assert rules.refused_formats("no_int_quant_on_sm100") == ("int4_awq", "int8_sq")
    assert set(rules.FP8_CONTEXT_FMHA_QUANTS) == {"fp8", "nvfp4", "w4a8_awq"}
    planted = {"x": QuantFormat(name="x", preset=None, quant_algo=None, weight_bytes=2.0, sms=(90,), sm_needs="",
                                runtimes=frozenset(), tolerances=formats.FORMATS["fp8"].tolerances,
                                trtllm_refusals=frozenset({"no_such_rule"}))}
    assert refusal_problems(planted) == ["x: no rule 'no_such_rule' in pipeline/upstream/rules.yaml"]


# ------------------------------------------------------------------------------------------ discovery, planted
def _planted(tmp_path: Path, name: str, files: dict[str, str], drop: tuple[str, ...] = ()) -> str:
    """A copy of the registry package as ``name`` (importable from tmp_path), with ``files`` added, ``drop`` removed."""
    dst = tmp_path / name
    shutil.copytree(PACKAGE, dst, ignore=shutil.ignore_patterns("__pycache__"))
    for f in drop:
        (dst / f).unlink()
    for rel, text in files.items():
        (dst / rel).write_text(text)
    if str(tmp_path) not in sys.path:
        sys.path.insert(0, str(tmp_path))
    return name


def _import(name: str):
    try:
        return importlib.import_module(name)
    finally:
        for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[m]


TOY = '''from ._base import ALL_RUNTIMES, QuantFormat, Tolerances, ExportLayout
def dequantize(t, group_size=None):
    return t["weight"].float() * t["weight_scale"].float()[:, None]
FORMAT = QuantFormat(name={name!r}, preset="INT8_WEIGHT_ONLY_CFG", quant_algo={algo!r}, weight_bytes=1.0,
                     sms=(90,), sm_needs="Hopper", runtimes=ALL_RUNTIMES, dequantize={deq},
                     layout=ExportLayout(weight="I8", required={{"weight_scale": (("F32",), {kind!r})}}),
                     tolerances=Tolerances(kl_max=0.1, top1_min=0.8, ppl_ratio_max=1.1, max_drop=0.05))
'''


def test_a_planted_module_is_discovered_and_helpers_are_skipped(tmp_path):
    pkg = _planted(tmp_path, "planted_ok", {
        "toy.py": TOY.format(name="toy", algo="TOY_W8", deq="dequantize", kind="out"),
        "_helper.py": "X = 1\n"})
    reg = _import(pkg)
    ranked = [n for n, f in formats.FORMATS.items() if f.preference is not None or f.quant_algo is None]
    unranked = sorted([n for n, f in formats.FORMATS.items() if n not in ranked] + ["toy"])
    assert list(reg.FORMATS) == ranked + unranked  # no preference: after the ranked ones, by name
    assert reg.BY_ALGO["TOY_W8"].name == "toy" and "_helper" not in reg.MODULES


@pytest.mark.parametrize("files, drop, message", [
    ({"toy.py": "X = 1\n"}, (), "planted/toy.py declares neither FORMAT (a QuantFormat) nor KV_FORMAT"),
    ({"toy.py": TOY.format(name="toy2", algo="TOY_W8", deq="dequantize", kind="out")}, (),
     "planted/toy.py: FORMAT.name is 'toy2'; a format is named after its module ('toy')"),
    ({"toy.py": TOY.format(name="toy", algo="FP8", deq="dequantize", kind="out")}, (),
     "planted/toy.py: FORMAT.quant_algo 'FP8' is fp8's already"),
    ({"toy.py": TOY.format(name="toy", algo="TOY_W8", deq="None", kind="out")}, (),
     "planted/toy.py: format toy: quant_algo TOY_W8 needs a dequantize function"),
    ({"toy.py": TOY.format(name="toy", algo="TOY_W8", deq="dequantize", kind="rows")}, (),
     "planted/toy.py: ExportLayout tensor 'weight_scale': unknown shape kind 'rows'; use one of scalar, out, in"),
    ({"toy.py": "import pipeline.nothing_here\n"}, (), "planted/toy.py cannot be imported (ModuleNotFoundError"),
    ({}, ("none.py",), "planted/none.py must declare the unquantized FORMAT and KV_FORMAT"),
])
def test_a_broken_module_stops_the_registry_naming_its_file(tmp_path, files, drop, message):
    pkg = _planted(tmp_path, "planted", files, drop)
    with pytest.raises(ValueError) as exc:  # the planted copy's own FormatError class
        _import(pkg)
    assert type(exc.value).__name__ == "FormatError" and message in str(exc.value), exc.value


def test_format_modules_import_nothing_from_pipeline_and_no_torch_at_import():
    import ast

    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.parse(path.read_text()).body:  # module level only: torch and modelopt inside functions
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [] if node.level else [node.module or ""]
            else:
                continue
            assert not any(n.split(".")[0] in ("pipeline", "torch", "modelopt") for n in names), (path.name, names)
        for node in ast.walk(ast.parse(path.read_text())):  # nothing from pipeline anywhere in the file
            if isinstance(node, ast.ImportFrom) and not node.level:
                assert not (node.module or "").startswith("pipeline"), path.name
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("pipeline") for a in node.names), path.name


def test_records_are_keyword_only_and_refuse_a_half_declared_format():
    with pytest.raises(TypeError):
        Tolerances(0.1, 0.8, 1.1, 0.05)  # noqa: positional
    with pytest.raises(FormatError, match="give preset, quant_algo and layout together"):
        QuantFormat(name="x", preset="X_CFG", quant_algo=None, weight_bytes=1.0, sms=(90,), sm_needs="",
                    runtimes=frozenset(), tolerances=formats.FORMATS["fp8"].tolerances)
    with pytest.raises(FormatError, match="needs a quantize_kv function"):
        KVFormat(name="x", preset="X_KV_CFG", quant_algo="X", bytes=1.0, sms=(90,), sm_needs="", runtimes=frozenset())


# ------------------------------------------------------------------------------- the reference runtime's registry
def test_the_reference_runtime_loads_with_the_packaged_copy_of_the_registry(tmp_path):
    """The files the package stage copies next to a reference model.py form a registry that loads an export alone,
    to the same numbers, passed in or found by the copied runtime itself; a registry without the export's quant_algo
    refuses it, and a copied runtime without the registry beside it says so."""
    from pipeline.runtime import reference
    from pipeline.triton import repository
    from tests.helpers import exports

    version_dir = tmp_path / "repo" / "m" / "1"
    for dst, origin in repository.reference_files().items():
        (version_dir / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(origin, version_dir / dst)
    assert (version_dir / "reference_formats" / "fp8.py").is_file()
    assert not list(version_dir.rglob("__pycache__"))
    sys.path.insert(0, str(version_dir))
    try:
        copy = _import("reference_formats")
    finally:
        sys.path.remove(str(version_dir))
    assert copy.__file__.startswith(str(version_dir)) and list(copy.FORMATS) == list(formats.FORMATS)

    e = exports.write(tmp_path / "fp8", "fp8", "fp8")
    ids = torch.arange(1, 17).reshape(1, -1)
    with torch.inference_mode():
        ours = reference.load(e.dir, torch.bfloat16).forward(input_ids=ids).logits
        served = reference.load(e.dir, torch.bfloat16, formats=copy).forward(input_ids=ids).logits
    assert torch.equal(ours, served)

    class WithoutFP8:  # negative control: a registry that lacks the export's format
        BY_ALGO = {a: f for a, f in formats.BY_ALGO.items() if a != "FP8"}
        KV_BY_ALGO = formats.KV_BY_ALGO

    with pytest.raises(ValueError, match=r"cannot load quant_algo='FP8' \(supported: FP8_PER_CHANNEL_PER_TOKEN, "
                                         r"MXFP8, NVFP4, NVFP4_AWQ, W4A16_AWQ, W4A16_NVFP4, W4A8_AWQ, W4A8_NVFP4_FP8, "
                                         r"W8A8_SQ_PER_CHANNEL, none\)"):
        reference.load(e.dir, torch.bfloat16, formats=WithoutFP8)

    # the copied runtime given no registry (a model.py that passes none) reads the copy beside it
    sys.path.insert(0, str(version_dir))
    try:
        copied_rt = importlib.import_module("reference_runtime")
        with torch.inference_mode():
            model = copied_rt.load(e.dir, torch.bfloat16)
            alone = model.forward(input_ids=ids).logits
        layer = next(m for m in model.modules() if isinstance(m, copied_rt.QuantLinear))
        assert layer.fmt.dequantize.__module__ == "reference_formats.fp8" and torch.equal(alone, ours)
        shutil.rmtree(version_dir / "reference_formats")  # negative control: a repository without the copy
        for m in [m for m in sys.modules if m.startswith("reference_formats")]:
            del sys.modules[m]
        with pytest.raises(ImportError, match="no format registry beside it"):
            copied_rt.load(e.dir, torch.bfloat16)
    finally:
        sys.path.remove(str(version_dir))
        for m in [m for m in sys.modules if m.startswith(("reference_formats", "reference_runtime"))]:
            del sys.modules[m]


def test_the_package_fingerprint_covers_every_copied_format_file(tmp_path, monkeypatch):
    from pipeline.triton import repository

    src = tmp_path / "formats"
    shutil.copytree(PACKAGE, src, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "fp8.py").write_text("litter\n")  # never copied, never fingerprinted
    monkeypatch.setitem(repository.REFERENCE_PACKAGES, "reference_formats", src)
    files = repository.reference_files()
    assert {d for d in files if d.startswith("reference_formats/")} == {
        f"reference_formats/{p.name}" for p in PACKAGE.glob("*.py")}
    before = repository.templates_digest()
    (src / "__pycache__" / "fp8.py").write_text("other litter\n")
    assert repository.templates_digest() == before  # negative control: litter does not count
    (src / "fp8.py").write_text((src / "fp8.py").read_text() + "# changed\n")
    assert repository.templates_digest() != before


def test_stage_code_digests_cover_the_discovered_format_modules():
    import importlib.util

    name = "pipeline.stages.quantize"
    mods = fingerprint.code_modules(name, Path(importlib.util.find_spec(name).origin))
    assert {f"pipeline.formats.{m}" for m in formats.MODULES} | {"pipeline.formats._base"} <= set(mods)


def test_a_format_whose_calibration_needs_cuda_is_refused_on_a_cpu_target_only():
    from pipeline.stages import quantize

    cpu = quantize.check(hardware.compose(["model=tiny-qwen3", "quant=nvfp4_awq", "target=cpu"]))
    assert [p for p in cpu if p.startswith("quant=nvfp4_awq")] == [
        "quant=nvfp4_awq calibrates on a CUDA GPU only (ModelOpt's NVFP4_AWQ_LITE_CFG runs a CUDA-only kernel during "
        "calibration); use a GPU target, or quant=nvfp4 on target cpu"]
    gpu = quantize.check(hardware.compose(["model=tiny-qwen3", "quant=nvfp4_awq", "target=b200"]))
    assert not [p for p in gpu if p.startswith("quant=nvfp4_awq")]  # control: the same format on a GPU target
    assert not [p for p in quantize.check(hardware.compose(["model=tiny-qwen3", "quant=w4a16_nvfp4", "target=cpu"]))
                if "CUDA GPU only" in p]  # control: an NVFP4 format with the CPU fallback
