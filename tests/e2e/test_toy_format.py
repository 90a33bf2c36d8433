"""Adding a quant format is one module and one conf preset: a copy of the project gets ONLY
``pipeline/formats/int8_wo.py`` (INT8 weight-only, W8A16: per-channel int8 weights, 16-bit activations, as ModelOpt's
``INT8_WEIGHT_ONLY_CFG`` exports it) and ``conf/quant/int8_wo.yaml``, and every place derived from the registry picks
it up, each shown through the copy's own code in a subprocess (``PYTHONPATH=<copy>``): ``validate`` and ``plan``
accept it, the schema's enum lists it, the compatibility and capacity refusals name it, the preset composes with the
module's tolerances, the TensorRT-LLM rule it opts into reaches it, the reference runtime serves a synthetic export of
it (its own dequantize) and the export proof's structure check reads its layout.

Negative controls: without the module (the preset alone) the format is refused with the schema's message and the
reference runtime refuses its export; a broken record stops every verb with a message naming the file."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import config, formats
from tests.conftest import cli_env

RANKED = [n for n, f in formats.FORMATS.items() if f.preference is not None or f.quant_algo is None]
WITH_TOY = RANKED + sorted([n for n in formats.FORMATS if n not in RANKED] + ["int8_wo"])  # unranked: by name

REPO = Path(__file__).resolve().parents[2]
COPIED = ("pipeline", "conf", "hydra_plugins", "pyproject.toml")

TOY_MODULE = '''"""INT8 weight-only (W8A16): per-channel int8 weights, 16-bit activations (INT8_WEIGHT_ONLY_CFG).

Export (quant_algo W8A16): int8 ``weight`` x per-output-channel ``weight_scale`` (= amax / 127); activations are not
quantized. Served here by the reference runtime only.
"""
from __future__ import annotations

from ._base import FLOAT_DTYPES, ExportLayout, QuantFormat, Tolerances


def dequantize(t, group_size=None):
    """int8 x the per-output-channel ``weight_scale``."""
    return t["weight"].float() * t["weight_scale"].float()[:, None]


FORMAT = QuantFormat(
    name="int8_wo", preset="INT8_WEIGHT_ONLY_CFG", quant_algo="W8A16", weight_bytes=1.0,
    sms=(80, 86, 89, 90), sm_needs="Ampere, Ada or Hopper (sm80-sm90)", runtimes=frozenset({"reference"}),
    layout=ExportLayout(weight="I8", required={"weight_scale": (FLOAT_DTYPES, "out")}),
    trtllm_refusals=frozenset({"no_int_quant_on_sm100"}),
    tolerances=Tolerances(kl_max=0.12, top1_min=0.82, ppl_ratio_max=1.08, max_drop=0.04,
                          export_kl_frac=0.6, export_weight_ratio=0.3),
    dequantize=dequantize,
)
'''
TOY_PRESET = """# INT8 weight-only (W8A16), per-channel scales (ModelOpt INT8_WEIGHT_ONLY_CFG); FP8 KV cache.
# Its tolerances are its module's: pipeline/formats/int8_wo.py.
format: int8_wo
kv_cache: fp8
calib: {dataset: auto, batch_size: auto}
"""
TOY = {"pipeline/formats/int8_wo.py": TOY_MODULE, "conf/quant/int8_wo.yaml": TOY_PRESET}

# Read inside the copy: what the derived places make of the toy format.
FACTS = """
import json
from pipeline import calib, capacity, compat, config, hardware, schema
from pipeline.upstream import rules
cfg = hardware.compose(["model=tiny-qwen3", "quant=int8_wo"])
print(json.dumps({
    "enum": [f.value for f in schema.QuantFormat],
    "quant": config.to_plain(cfg.quant), "max_drop": config.to_plain(cfg.eval.max_drop),
    "weight_bytes": capacity.WEIGHT_BYTES["int8_wo"], "llmapi": sorted(compat.RUNTIME_QUANT["trtllm_llmapi"]),
    "refused_on_sm100": list(rules.refused_formats("no_int_quant_on_sm100")),
    "calib_s": calib.estimate_s(1.0, 1000, "h100", "int8_wo"),
    "calib_s_fp8": calib.estimate_s(1.0, 1000, "h100", "fp8"),
}))
"""

# A synthetic W8A16 export of a tiny Qwen3 (seeded random weights, int8 per output channel as ModelOpt's
# to_quantized_weight stores them), the same weights dequantized into a plain bf16 checkpoint, then: the reference
# runtime's logits on the export against transformers' on the bf16 checkpoint, and the proof's structure check on the
# export and on a copy with one scale cut short.
SERVE = """
import json, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config

out = Path(sys.argv[1])
cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False)
cfg.architectures = ["Qwen3ForCausalLM"]
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
state = {k: v.contiguous() for k, v in model.state_dict().items()}
export, plain = {}, {}
for key, w in state.items():
    name = key[: -len(".weight")]
    if name not in linears:
        export[key] = plain[key] = w
        continue
    scale = (w.float().abs().amax(1) / 127).clamp_min(1e-8)
    q = (w.float() / scale[:, None]).round().clamp(-128, 127).to(torch.int8)
    export[key], export[f"{name}.weight_scale"] = q, scale
    plain[key] = (q.float() * scale[:, None]).to(torch.bfloat16)
for d, tensors in (("export", export), ("plain", plain)):
    (out / d).mkdir(parents=True)
    cfg.save_pretrained(out / d)
    save_file(tensors, str(out / d / "model.safetensors"), metadata={"format": "pt"})
(out / "export" / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
    "quant_algo": "W8A16", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}))

from pipeline.quant import proof
from pipeline.runtime import reference

ids = torch.arange(3, 35).reshape(1, -1)
with torch.inference_mode():
    served = reference.load(out / "export", torch.bfloat16)
    ours = served(input_ids=ids).logits
    theirs = AutoModelForCausalLM.from_pretrained(out / "plain", dtype=torch.bfloat16)(input_ids=ids).logits
structure = proof.check_structure(out / "export", "int8_wo", "none")
bad = out / "bad"
shutil.copytree(out / "export", bad)
t = load_file(str(bad / "model.safetensors"))
layer = "model.layers.0.mlp.down_proj"
t[f"{layer}.weight_scale"] = t[f"{layer}.weight_scale"][:10]
save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
print(json.dumps({
    "quant_linears": sum(isinstance(m, reference.QuantLinear) for m in served.modules()),
    "algo": served.config.pipeline_quant["quant_algo"], "equal": bool(torch.equal(ours, theirs)),
    "max_diff": float((ours.float() - theirs.float()).abs().max()),
    "structure": structure.problems, "details": structure.details,
    "bad_structure": proof.check_structure(bad, "int8_wo", "none").problems,
}))
"""


def _copy(dst: Path, files: dict[str, str], drop: tuple[str, ...] = ()) -> Path:
    """The project's code and config under ``dst``, plus ``files`` (path -> text), less ``drop``."""
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst / name)
    for rel, text in files.items():
        (dst / rel).write_text(text)
    for rel in drop:
        (dst / rel).unlink()
    return dst


def _env(copy: Path, tmp: Path) -> dict[str, str]:
    return cli_env(tmp, PYTHONPATH=str(copy))


def _cli(copy: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeline", *args]
    if args[0] != "validate":
        cmd.append(f"paths.root={tmp / 'out'}")
    return subprocess.run(cmd, cwd=copy, env=_env(copy, tmp), capture_output=True, text=True, timeout=900)


def _python(copy: Path, tmp: Path, code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=copy, env=_env(copy, tmp), capture_output=True,
                          text=True, timeout=900)


def _plan(copy: Path, tmp: Path, *overrides: str) -> dict:
    proc = _cli(copy, tmp, "plan", "--json", *overrides)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow  # a copy of the project validating, planning, quantizing and serving its new format (~20 s on 2 cores)
def test_a_toy_format_is_one_module_and_one_preset(tmp_path):
    copy = _copy(tmp_path / "project", TOY)
    # validate composes every combination of the new format (tests/e2e/test_config.py validates every shipped one):
    # it runs while the other checks do
    validate = subprocess.Popen([sys.executable, "-m", "pipeline", "validate", "--json", "quant=int8_wo"], cwd=copy,
                                env=_env(copy, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # plan accepts it, and capacity plans with its bytes per parameter (int8_sq's, half of bf16's)
        doc = _plan(copy, tmp_path, "model=tiny-qwen3", "quant=int8_wo", "target=cpu", "runtime=reference")
        assert (doc["quant"], doc["kv_cache"]) == ("int8_wo", "fp8")
        big = ["model=qwen32b", "target=l40s", "runtime=reference", "build.tp_size=1"]
        weights = {q: _plan(copy, tmp_path, *big, f"quant={q}")["capacity"]["weights_gb_per_gpu"]
                   for q in ("int8_wo", "int8_sq")}
        assert weights["int8_wo"] == weights["int8_sq"] > 0

        # the compatibility and capacity refusals name it
        for overrides, message in (
                (["model=tiny-qwen3", "target=b200"],
                 "int8_wo needs Ampere, Ada or Hopper (sm80-sm90); for b200 use fp8 or nvfp4"),
                (["model=tiny-qwen3", "target=h100", "runtime=trtllm_engine"],
                 "int8_wo is not served by runtime trtllm_engine; use runtime=reference or quant=fp8"),
                (["model=qwen32b", "target=a10g", "runtime=reference", "build.tp_size=1"],
                 "qwen32b with int8_wo weights does not fit on a10g")):
            proc = _cli(copy, tmp_path, "plan", "quant=int8_wo", *overrides)
            assert proc.returncode == 2 and message in proc.stderr, proc.stderr

        # the schema's enum, the preset with the module's tolerances, the TensorRT-LLM rule, the calibration factor
        proc = _python(copy, tmp_path, FACTS)
        assert proc.returncode == 0, proc.stderr
        facts = json.loads(proc.stdout)
        assert facts["enum"] == WITH_TOY
        q = facts["quant"]
        assert q["format"] == "int8_wo" and q["thresholds"] == {"kl_max": 0.12, "top1_min": 0.82, "ppl_ratio_max": 1.08}
        assert (q["eval"]["export_kl_abs"], q["eval"]["export_kl_frac"], q["eval"]["export_weight_ratio"]) == (
            0.002, 0.6, 0.3)  # the default of _base.Tolerances, and the module's own two
        assert facts["max_drop"]["int8_wo"] == 0.04 and facts["max_drop"]["fp8"] == 0.05
        assert facts["weight_bytes"] == 1.0 and "int8_wo" not in facts["llmapi"]
        assert facts["refused_on_sm100"] == ["int4_awq", "int8_sq", "int8_wo"]
        assert facts["calib_s"] == facts["calib_s_fp8"]  # no search: a factor of 1

        # the reference runtime serves a synthetic export through the module's dequantize; the proof reads its layout
        proc = _python(copy, tmp_path, SERVE, str(tmp_path / "ckpt"))
        assert proc.returncode == 0, proc.stderr
        served = json.loads(proc.stdout)
        assert served["algo"] == "W8A16" and served["quant_linears"] == 14
        assert served["equal"], served["max_diff"]  # the dequantized weights, bit for bit as a bf16 checkpoint
        assert served["structure"] == [] and served["details"]["quantized_linears"] == 14
        assert served["details"]["quant_algo"] == "W8A16" and served["details"]["excluded_linears"] == 1
        assert served["bad_structure"] == [  # negative control: a cut scale is found through the module's layout
            "model.layers.0.mlp.down_proj: weight_scale has shape [10], expected [64]"]
    finally:
        out, err = validate.communicate(timeout=900)
    assert validate.returncode == 0, err[-3000:]
    result = json.loads(out)
    toy = [r for r in result["results"] if r["combination"]["quant"] == "int8_wo"]
    models, targets, runtimes = (len([o for o in config.group_options(g) if o != "auto"])
                                 for g in ("model", "target", "runtime"))
    assert result["failing"] == 0 and len(toy) == result["combinations"] == models * targets * runtimes
    assert not [r for r in toy if r["errors"]]
    refused = {(r["combination"]["target"], r["combination"]["runtime"]) for r in toy if r["refused"]}
    assert ("h100", "reference") not in refused and ("b200", "reference") in refused


def test_without_the_module_the_preset_alone_is_refused(tmp_path):
    copy = _copy(tmp_path / "project", {"conf/quant/int8_wo.yaml": TOY_PRESET})
    proc = _cli(copy, tmp_path, "plan", "model=tiny-qwen3", "quant=int8_wo")
    assert proc.returncode == 2, proc.stderr
    assert (f"quant.format: invalid value 'int8_wo', expected one of [{', '.join(formats.FORMATS)}]"
            in proc.stderr), proc.stderr
    proc = _python(copy, tmp_path, SERVE, str(tmp_path / "ckpt"))
    assert proc.returncode != 0
    from pipeline import formats as registry

    shipped = ", ".join(sorted({f.quant_algo for f in registry.FORMATS.values() if f.quant_algo}) + ["none"])
    assert "W8A16" not in shipped
    assert (f"reference runtime cannot load quant_algo='W8A16' (supported: {shipped})") in proc.stderr, \
        proc.stderr[-2000:]


@pytest.mark.parametrize("edit, message", [
    (lambda text: text.replace('name="int8_wo"', 'name="int8wo"'),
     "pipeline/formats/int8_wo.py: FORMAT.name is 'int8wo'; a format is named after its module ('int8_wo')"),
    (lambda text: text.replace("    dequantize=dequantize,\n", ""),
     "pipeline/formats/int8_wo.py: format int8_wo: quant_algo W8A16 needs a dequantize function"),
])
def test_a_broken_toy_record_stops_every_verb_naming_its_file(tmp_path, edit, message):
    copy = _copy(tmp_path / "project", {**TOY, "pipeline/formats/int8_wo.py": edit(TOY_MODULE)})
    for args in (["plan", "model=tiny-qwen3", "quant=fp8"], ["validate"]):
        proc = _cli(copy, tmp_path, *args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]  # one line, exit 2, no traceback
        assert lines[0].startswith(f"error: {message}"), lines[0]
