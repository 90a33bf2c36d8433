"""The TRT-LLM checkpoint config.json is the one TensorRT-LLM's own from_hugging_face writes, whether or not
tensorrt_llm imports where quantize runs. ModelOpt's real export runs here (tensorrt_llm is not installed, so it takes
its manual path and warns); the expected field values are read from QWenConfig/LLaMAConfig.from_hugging_face
(tensorrt_llm/models/{qwen,llama}/config.py). No TensorRT-LLM run is simulated: the "importable" dict below is
ModelOpt's manual dict updated the way convert_to_tensorrt_llm_config updates it, with a to_dict that carries every
default field TensorRT-LLM's Mapping/QuantConfig/MoeConfig add."""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

from pipeline.runtime import trtllm_checkpoint as tc

QWEN3 = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, vocab_size=512,
             tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6)  # conf/model/tiny-qwen3 + Qwen3's
SMOLLM2 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=256, max_position_embeddings=8192, tie_word_embeddings=True,
               rope_theta=100000.0, rms_norm_eps=1e-5)  # SmolLM2's rope_theta, eps and tied embeddings, shrunk


def _export(tmp_path, family: str):
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cfg_cls, model_cls, kw, decoder, arch = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, QWEN3, "qwen", "Qwen3ForCausalLM"),
        "llama": (LlamaConfig, LlamaForCausalLM, SMOLLM2, "llama", "LlamaForCausalLM")}[family]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(architectures=[arch], **kw)).to(torch.bfloat16).eval()
    out = tmp_path / family
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        export_tensorrt_llm_checkpoint(model, decoder, torch.bfloat16, export_dir=str(out),
                                       inference_tensor_parallel=1, inference_pipeline_parallel=1)
    # tensorrt_llm does not import here: ModelOpt took its manual path (the case this module exists for)
    assert any("Cannot export tensorrt_llm checkpoint config" in str(w.message) for w in seen)
    return json.loads((out / "config.json").read_text()), model.config.to_dict(), decoder, out


def _importable(manual: dict, hf: dict, decoder: str) -> dict:
    """What convert_to_tensorrt_llm_config returns where tensorrt_llm imports: the manual dict before its fallback-only
    keys (rotary_base, rotary_scaling, mapping, quantization), updated with from_hugging_face(...).to_dict() --
    which writes Mapping, QuantConfig and MoeConfig with all their default fields -- then ModelOpt's overrides."""
    base = {k: v for k, v in manual.items() if k not in ("rotary_base", "rotary_scaling", "mapping", "quantization")}
    to_dict = tc.FAMILIES[decoder]({**hf, "_written_architecture": manual["architecture"]}, manual["dtype"])
    to_dict["mapping"] = {**manual["mapping"], "gpus_per_node": 8, "cp_size": 1, "moe_tp_size": 1, "moe_ep_size": 1,
                          "auto_parallel": False}
    to_dict["quantization"] = {"group_size": 128, "smoothquant_val": 0.5, "clamp_val": None, "use_meta_recipe": False,
                               "has_zero_point": False, "pre_quant_scale": False, "exclude_modules": None,
                               **manual["quantization"]}
    to_dict["moe"] = {**to_dict["moe"], "shared_expert_intermediate_size": 0, "sparse_mixer_epsilon": 0.01,
                      "tp_mode": 0}
    base.update(to_dict)
    base.update({"use_parallel_embedding": True, "embedding_sharding_dim": 0, "logits_dtype": "float16"})
    return base


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_checkpoint_config_is_the_same_whichever_path_ran(tmp_path, family):
    manual, hf, decoder, out = _export(tmp_path, family)
    fixed = tc.trtllm_config(manual, hf, decoder)
    assert tc.trtllm_config(_importable(manual, hf, decoder), hf, decoder) == fixed
    assert tc.trtllm_config(fixed, hf, decoder) == fixed  # idempotent
    changed = tc.rewrite(out, hf, decoder)
    assert json.loads((out / "config.json").read_text()) == fixed and changed
    assert tc.problems(fixed, hf, decoder) == []


def test_qwen3_fields_are_the_ones_qwenconfig_from_hugging_face_sets(tmp_path):
    manual, hf, decoder, _ = _export(tmp_path, "qwen3")
    # negative control: ModelOpt's manual config is what TensorRT-LLM would build a legacy Qwen network from
    raw = "\n".join(tc.problems(manual, hf, decoder))
    assert "qwen_type: '<missing>'" in raw and "attn_bias: '<missing>'" in raw and "rotary_base: '<missing>'" in raw
    c = tc.trtllm_config(manual, hf, decoder)
    assert (c["architecture"], c["qwen_type"], c["attn_bias"], c["mlp_bias"]) == ("Qwen3ForCausalLM", "qwen3", False,
                                                                                  False)
    assert c["rotary_base"] == 1000000.0 and c["rotary_scaling"] is None  # rope_theta, not QWenConfig's 10000
    assert (c["head_size"], c["rotary_embedding_dim"], c["num_key_value_heads"]) == (32, 32, 2)
    assert (c["norm_epsilon"], c["hidden_act"], c["seq_length"], c["position_embedding_type"]) == (
        1e-6, "silu", 8192, "rope_gpt_neox")
    assert c["moe"] == {"num_experts": 0, "top_k": 0, "normalization_mode": 0} and c["num_labels"] == 1
    assert c["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert c["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": None}
    assert c["logits_dtype"] == "float16" and c["use_parallel_embedding"] is True  # ModelOpt's own overrides


def test_llama_fields_are_the_ones_llamaconfig_from_hugging_face_sets(tmp_path):
    manual, hf, decoder, _ = _export(tmp_path, "llama")
    c = tc.trtllm_config(manual, hf, decoder)
    assert "rotary_base: '<missing>'" in "\n".join(tc.problems(manual, hf, decoder))  # negative control
    assert c["rotary_base"] == 100000.0 and c["attn_bias"] is False and c["tie_word_embeddings"] is True
    assert (c["use_input_layernorm_in_first_layer"], c["use_last_layernorm"], c["layer_idx_offset"]) == (True, True, 0)
    assert c["moe"] == {"num_experts": 0, "top_k": 0, "normalization_mode": None}
    assert c["output_multiplier_scale"] == 1.0 and c["head_size"] == 16 and "qwen_type" not in c


def test_rope_is_read_from_either_transformers_config_shape():
    assert tc._rope({"rope_theta": 5e5, "rope_scaling": None}, 1e4) == (5e5, None)
    assert tc._rope({"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}, 1e4) == (5e5, None)
    yarn = {"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}}
    assert tc._rope(yarn, 1e4) == (1e6, {"rope_type": "yarn", "factor": 4.0})
    assert tc._rope({}, 1e4) == (1e4, None)  # from_hugging_face's getattr default


def test_an_unknown_family_is_refused():
    from pipeline.errors import UserError

    with pytest.raises(UserError, match="no recorded from_hugging_face for decoder type 'gpt'"):
        tc.trtllm_config({"dtype": "bfloat16"}, {}, "gpt")
    with pytest.raises(UserError, match="not a Qwen type"):
        tc.qwen_fields(copy.deepcopy({"model_type": "llama"}), "bfloat16")
