"""``runtime=trtllm_engine`` is refused in ``plan`` for a model whose TRT-LLM checkpoint ModelOpt cannot export
(Qwen3-MoE), and the refusal rests on what ModelOpt itself does: its ``export_tensorrt_llm_checkpoint`` raises on a
tiny calibrated Qwen3-MoE with the decoder type the pipeline maps it to, and exports the dense Qwen3 (the control)."""
from __future__ import annotations

import warnings

import pytest

from pipeline.runtime import trtllm
from tests.conftest import run_cli

pytestmark = pytest.mark.e2e

ENGINE = ["model=tiny-qwen3", "target=h100", "runtime=trtllm_engine", "runtime.trtllm_version=1.2.1"]


def test_plan_refuses_the_engine_runtime_for_qwen3_moe_in_one_line(tmp_path):
    proc = run_cli("plan", *ENGINE, "model.shape.model_type=qwen3_moe", root=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "runtime trtllm_engine cannot serve model_type='qwen3_moe'" in lines[0]
    assert "use runtime=trtllm_llmapi" in lines[0] and "build_moe_config" in lines[0]
    # the synthetic model's own type is read when model.shape does not name one
    proc = run_cli("plan", *ENGINE, "model.shape.model_type=", "model.synthetic.model_type=qwen3_moe", root=tmp_path)
    assert proc.returncode == 2 and "model_type='qwen3_moe'" in proc.stderr, proc.stderr


def test_the_same_model_plans_on_the_llmapi_runtime_and_dense_qwen3_on_engines(tmp_path):
    """Controls: the refusal is the engine path's, for the MoE type only."""
    llmapi = run_cli("plan", "model=tiny-qwen3", "target=h100", "runtime=trtllm_llmapi", "runtime.trtllm_version=1.2.1",
                     "model.shape.model_type=qwen3_moe", root=tmp_path)
    assert llmapi.returncode == 0, llmapi.stderr
    dense = run_cli("plan", *ENGINE, root=tmp_path)
    assert dense.returncode == 0, dense.stderr


def _calibrated(model_type: str):
    import modelopt.torch.quantization as mtq
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=128)
    if model_type == "qwen3_moe":
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg.architectures = ["Qwen3MoeForCausalLM" if model_type == "qwen3_moe" else "Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: m(torch.randint(0, 128, (2, 8))))
    return model


@pytest.mark.parametrize("model_type, exports", [("qwen3_moe", False), ("qwen3", True)])
def test_modelopts_trtllm_export_refuses_what_plan_refuses(tmp_path, model_type, exports):
    import torch
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    assert (trtllm.engine_export_problem(model_type) is None) is exports
    decoder = trtllm.DECODER_TYPES[model_type]
    model = _calibrated(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exports:
            export_tensorrt_llm_checkpoint(model, decoder, torch.bfloat16, export_dir=str(tmp_path),
                                           inference_tensor_parallel=1)
            assert (tmp_path / "rank0.safetensors").is_file()
        else:
            with pytest.raises(AssertionError):
                export_tensorrt_llm_checkpoint(model, decoder, torch.bfloat16, export_dir=str(tmp_path),
                                               inference_tensor_parallel=1)
