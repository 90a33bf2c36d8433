"""CUDA-only checks: the CPU fallbacks against ModelOpt's GPU kernels, and every format calibrated on the GPU.

Runs unchanged on any CUDA machine with SM >= 8.9 (ModelOpt's NVFP4 Triton kernel); skipped, with the reason,
elsewhere.
"""
from __future__ import annotations

import json

import pytest
import torch

from pipeline.formats import FORMATS, fp8, nvfp4
from pipeline.runtime import reference

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (none visible): NVFP4/FP8 kernel parity and GPU calibration", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip(f"needs SM >= 8.9 for ModelOpt's NVFP4 kernel; this GPU is sm{''.join(map(str, torch.cuda.get_device_capability()))}",
                allow_module_level=True)


def _cases():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape in ((64, 1024), (3, 7, 4096), (1, 16)):
            x = torch.randn(*shape, generator=g) * 2.0
            x.view(-1)[:: 97] *= 50.0  # outliers
            x.view(-1)[5:21] = 0.0  # an all-zero block
            x.view(-1)[40:56] *= 1e-6  # a block that underflows the e4m3 scale
            yield x.to(dtype)


E2M1_BOUNDARIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


@pytest.mark.parametrize("x", list(_cases()), ids=lambda x: f"{str(x.dtype)[6:]}{list(x.shape)}")
def test_cpu_nvfp4_fallback_matches_modelopt_gpu_kernel(x):
    """Bit for bit, except where |x|/scale sits within a few ulp of an e2m1 rounding boundary: ModelOpt's Triton
    kernel divides with Triton's default approximate fp32 division (div.full.f32, up to 2 ulp), which no CPU
    arithmetic reproduces exactly. Such elements may differ by one e2m1 step; every other element must be equal."""
    from modelopt.torch.quantization.tensor_quant import _dynamic_block_quantize_impl

    for amax in (x.float().abs().amax(), x.float().abs().amax() * 0.5):
        gpu = _dynamic_block_quantize_impl(x.cuda(), 16, amax.cuda(), 4, 2, 8, 4).cpu()
        cpu = nvfp4.fake_nvfp4(x, amax)
        assert gpu.dtype == cpu.dtype
        differ = (gpu.float() != cpu.float()).reshape(-1, 16)
        # the per-block scale the CPU fallback used, and how close each |x|/scale is to a rounding boundary
        xf = x.float().reshape(-1, 16)
        gs = amax.float() * nvfp4.inv_range()
        scale = torch.clamp(xf.abs().amax(-1, keepdim=True) / (6 * gs), max=448).to(torch.float8_e4m3fn).float() * gs
        scale = torch.where(scale >= 1e-5, scale, torch.ones_like(scale))
        ratio = xf.abs() * (1.0 / scale)
        near = ((ratio.unsqueeze(-1) - E2M1_BOUNDARIES).abs() <= 4 * torch.finfo(torch.float32).eps * 8).any(-1)
        assert not (differ & ~near).any(), f"{int((differ & ~near).sum())} elements differ away from a boundary"
        step = (gpu.float() - cpu.float()).abs().reshape(-1, 16)[differ]
        assert torch.all(step <= scale.expand_as(xf)[differ] * 2 + 1e-6)  # at most one e2m1 step (<= 2 × scale)
        record = getattr(test_cpu_nvfp4_fallback_matches_modelopt_gpu_kernel, "stats", [])
        record.append((str(x.dtype), tuple(x.shape), int(differ.sum()), x.numel()))
        test_cpu_nvfp4_fallback_matches_modelopt_gpu_kernel.stats = record
        print(f"nvfp4 parity {x.dtype} {tuple(x.shape)}: {int(differ.sum())} of {x.numel()} differ (all at ties)")


def test_cpu_fp8_fallback_matches_modelopt_cuda_kernel_bit_for_bit():
    from modelopt.torch.quantization.tensor_quant import scaled_e4m3_impl

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(256, 4096, generator=g) * 3).to(dtype)
        amax = x.float().abs().amax() * 0.7
        gpu = scaled_e4m3_impl(x.cuda(), amax.cuda()).cpu()
        assert torch.equal(gpu, fp8.fake_fp8(x, amax / 448.0))


COMBOS = [("fp8", "fp8"), ("fp8", "nvfp4"), ("int4_awq", "fp8"), ("int4_awq", "nvfp4"), ("nvfp4", "fp8"),
          ("nvfp4", "nvfp4"), ("w4a8_awq", "fp8"), ("int8_sq", "none"), ("int8_sq", "fp8"),
          ("fp8_per_channel_per_token", "fp8"), ("w4a16_nvfp4", "fp8"), ("w4a8_nvfp4_fp8", "fp8"),
          ("mxfp8", "fp8"), ("nvfp4_awq", "fp8")]  # nvfp4_awq: its AWQ search calibrates on CUDA only (no CPU e2e test)


@pytest.fixture(scope="module")
def qwen3_small(tmp_path_factory):
    """A Qwen3-architecture model (seeded random weights, AWQ-compatible sizes) and token rows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = tmp_path_factory.mktemp("q3")
    cfg = AutoConfig.for_model("qwen3", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=4096,
                               initializer_range=0.05, architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(d)
    g = torch.Generator().manual_seed(0)
    return d, torch.randint(0, 4096, (16, 128), generator=g), torch.randint(0, 4096, (4, 128), generator=g)


@pytest.mark.parametrize("fmt,kv", COMBOS, ids=[f"{f}-kv{k}" for f, k in COMBOS])
def test_format_calibrates_on_gpu_and_the_export_passes_the_proof(qwen3_small, tmp_path, fmt, kv):
    """ModelOpt's GPU kernels, the quantize stage's preparation and the whole export proof (structure, layers,
    numbers with the format's bounds from its module), plus its built-in control: the unquantized weights fail."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    from pipeline import hardware, quality
    from pipeline.quant import proof
    from pipeline.quant.modelopt import kv_as_served, prepare_reference, quant_config

    src, cal, ev = qwen3_small
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, device_map="cuda").eval()
    base = quality.logits(model, ev)
    mtq.quantize(model, quant_config(fmt, kv), lambda m: [m(input_ids=cal[i:i + 4].cuda()) for i in range(0, 16, 4)])
    ref, _ = prepare_reference(model, fmt, kv)
    with kv_as_served(model, kv):  # the KV scales the deployment applies, as the quantize stage evaluates
        fq = quality.logits(model, ev)
    export_hf_checkpoint(model, export_dir=str(tmp_path))
    del model
    assert sum(k == "kv" for k, _ in ref.scales.values()) == (0 if kv == "none" else 2 * 4)
    static_inputs = "input_scale" in FORMATS[fmt].layout.required  # none for W4A16 or per-token activations
    assert sum(k == "input" for k, _ in ref.scales.values()) == (7 * 4 if static_inputs else 0)
    bounds = hardware.compose([f"quant={fmt}"]).quant.eval
    structure = proof.check_structure(tmp_path, fmt, kv)
    layers = proof.check_layers(tmp_path, ref, bounds.export_weight_ratio, "cuda")
    assert structure.problems == [] and structure.details["quantized_linears"] == 7 * 4, structure
    assert layers.problems == [], layers  # every layer and every activation / KV scale as calibrated
    ex = quality.logits(reference.load(tmp_path, torch.bfloat16, "cuda"), ev)
    vs_base = quality.compare(base, fq, ev)
    numbers = proof.check_numbers(vs_base, quality.compare(fq, ex, ev), bounds.export_kl_abs, bounds.export_kl_frac)
    unquantized = proof.check_numbers(vs_base, quality.compare(fq, base, ev), bounds.export_kl_abs,
                                      bounds.export_kl_frac)
    assert numbers.ok, numbers.problems
    assert not unquantized.ok, unquantized.details


# ---------------------------------------------------------------------------------- the pipeline's stages on CUDA
def test_synthetic_weights_are_the_same_bits_on_cuda_as_on_cpu():
    """Counter-based generation: the GPU path (chunked) reproduces the CPU path bit for bit; another seed or tensor
    name gives other values (negative controls)."""
    from pipeline import synthetic

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for name, shape in (("model.embed_tokens.weight", (4099, 64)),
                            ("model.layers.0.mlp.up_proj.weight", (96, 1000))):
            key = synthetic.tensor_key(7, name)
            cpu = synthetic.noise(key, shape, 0.02, dtype, "cpu")
            gpu = synthetic.noise(key, shape, 0.02, dtype, "cuda", chunk=12345).cpu()
            assert torch.equal(cpu.view(torch.uint8) if dtype != torch.float32 else cpu.view(torch.int32),
                               gpu.view(torch.uint8) if dtype != torch.float32 else gpu.view(torch.int32))
            other = synthetic.noise(synthetic.tensor_key(8, name), shape, 0.02, dtype, "cuda").cpu()
            assert not torch.equal(cpu, other)
            assert abs(cpu.float().std().item() - 0.02) < 0.002


def _cli(*args, root):
    import subprocess
    import sys

    from tests.conftest import cli_env

    root.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "pipeline", *args, f"paths.root={root}"], cwd=root,
                          env=cli_env(root), capture_output=True, text=True, timeout=1200)


def _manifest(root, stage):
    (path,) = root.glob(f".store/*-{stage}-*/manifest.json")
    return json.loads(path.read_text())


def test_the_quantize_stage_runs_on_cuda_and_sizes_its_batch_there(tmp_path):
    """The pipeline's own quantize stage (target=auto: this GPU): the model is placed on the GPU (device_map), the
    calibration batch is bounded by a tenth of the weights (less the CUDA context), the calibrated model is freed
    before the export proof, and the proof passes."""
    from pipeline import config, hardware

    target = hardware.detect_target(config.shipped_targets())
    proc = _cli("build", "model=tiny-qwen3", "quant=fp8", "quant.gate=warn", "quant.calib.num_samples=16",
                "until=quantize", root=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = _manifest(tmp_path, "quantize")
    assert m["config"]["target"]["name"] == target != "cpu"
    res = m["result"]
    assert res["device"] == "cuda"
    assert isinstance(res["batch_size"], int) and 1 <= res["batch_size"] <= 16
    (acc_path,) = tmp_path.glob(".store/*-quantize-*/accuracy.json")
    mem = json.loads(acc_path.read_text())["gpu_memory"]
    assert mem["calibrated_model_freed_before_proof"] is True
    assert mem["batch_size"] == res["batch_size"] and mem["batch_size"] * mem["row_bytes"] <= max(
        mem["budget_bytes"], mem["row_bytes"])
    assert set(mem["torch_peak_bytes_by_step"]) >= {"load", "calibrate", "export", "export_check"}
    assert res["accuracy"]["export_check"] == "pass"
    assert _manifest(tmp_path, "fetch")["result"]["generated_on"] == "cuda"


def test_the_reference_runtime_is_built_and_served_on_cuda(tmp_path):
    """build -> package -> bench on this GPU: the reference runtime loads on CUDA, Triton serves it (the bundled
    server, or NVIDIA's on PATH), and every bench request succeeds."""
    from pipeline.errors import UserError
    from pipeline.triton import server

    try:
        server.find_server(None)
    except UserError as exc:  # e.g. only the bundled server, under numpy 2, without `make stub-env`
        pytest.skip(str(exc))
    proc = _cli("build", "model=tiny-qwen3", "quant=fp8", "quant.gate=warn", "bench.concurrency=[1,2]",
                "bench.requests_per_level=4", "bench.warmup_requests=1", "bench.workloads.chat.max_tokens=8",
                "bench.workloads.rag.prompt_words=120", "bench.workloads.rag.max_tokens=4", "until=bench",
                root=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (build_json,) = tmp_path.glob("engines/**/build.json")  # the build stage's record, next to the engine
    build = json.loads(build_json.read_text())
    assert build["device"] == "cuda" and build["dtype"] == "bfloat16"  # runtime.dtype auto on a GPU
    bench = _manifest(tmp_path, "bench")["result"]
    levels = [lv for w in bench["workloads"].values() for lv in w]  # {workload: [level, ...]}
    assert levels and all(lv["error_count"] == 0 and lv["request_count"] >= 1 for lv in levels)
    repo_cfg = next((tmp_path / "triton_repo").rglob("tensorrt_llm/config.pbtxt")).read_text()
    assert 'key: "device" value: { string_value: "cuda" }' in repo_cfg  # the served model runs on the GPU
