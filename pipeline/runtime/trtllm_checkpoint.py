"""The TRT-LLM checkpoint's ``config.json`` as TensorRT-LLM itself would write it, wherever quantize ran.

ModelOpt's ``export_tensorrt_llm_checkpoint`` builds the checkpoint config in
``modelopt/torch/export/tensorrt_llm_utils.py::convert_to_tensorrt_llm_config``: a manual dict, then, where
``tensorrt_llm`` imports, ``config.update(MODEL_MAP[arch].config_class.from_hugging_face(hf_config, dtype, mapping,
quant_config).to_dict())`` and ModelOpt's own ``use_parallel_embedding``/``embedding_sharding_dim``/``logits_dtype``.
Where ``tensorrt_llm`` does not import it warns and keeps the manual dict, which for Qwen3 lacks ``qwen_type``
(TensorRT-LLM then builds a legacy Qwen network: QKV bias, no q/k norm) and ``rotary_base`` (the default 10000 instead
of the model's ``rope_theta``).

:func:`trtllm_config` turns either dict into the one ModelOpt writes with ``tensorrt_llm`` importable: the fields
``QWenConfig.from_hugging_face`` / ``LLaMAConfig.from_hugging_face`` set (``tensorrt_llm/models/{qwen,llama}/config.py``)
and their ``to_dict`` adds, computed here from the HF ``config.json``, over the manual dict. The nested ``mapping``,
``quantization`` and ``moe`` are written in the minimal form every recorded TensorRT-LLM version reads
(``Mapping.from_dict``, ``QuantConfig.from_dict``, ``MoeConfig.from_dict`` fill the rest with their defaults), so the
result is the same dict whichever path ran. Sources (the stored versions read): qwen/config.py @ 0428c188,
llama/config.py @ 04100fd0, models/modeling_utils.py (``PretrainedConfig``) @ 01ea6d79, layers/moe.py (``MoeConfig``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pipeline import hf_config
from pipeline.errors import UserError

QWEN_TYPES = ("qwen", "qwen2", "qwen2_moe", "qwen2_llava_onevision", "qwen2_vl", "qwen2_audio", "qwen3", "qwen3_moe")
MAPPING_KEYS = ("world_size", "tp_size", "pp_size", "moe_tp_size", "moe_ep_size")
# QuantConfig's fields and defaults (models/modeling_utils.py): a field at its default is left to QuantConfig.from_dict
QUANT_DEFAULTS = {"group_size": 128, "smoothquant_val": 0.5, "clamp_val": None, "use_meta_recipe": False,
                  "has_zero_point": False, "pre_quant_scale": False, "exclude_modules": None}
MODELOPT_OVERRIDES = ("use_parallel_embedding", "embedding_sharding_dim", "logits_dtype")


def _rope(hf: dict[str, Any], default: float) -> tuple[float, dict | None]:
    """``rope_theta`` and ``rope_scaling`` as ``from_hugging_face`` reads them (``getattr(hf_config, "rope_theta",
    default)``, ``getattr(hf_config, "rope_scaling", None)``), from a config.json of transformers 4 or 5."""
    return hf_config.legacy_rope(hf, default)


def _common(hf: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The ``PretrainedConfig`` fields both ``from_hugging_face`` pass, and the defaults ``PretrainedConfig.__init__``
    fills (``rotary_embedding_dim`` = head_size x rotary_pct 1.0, ``qk_layernorm`` False, ``runtime_defaults`` None)."""
    heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // heads
    head_size = int(hf.get("kv_channels", head_dim))
    # a config built in memory may have no `architectures` (from_hugging_face would fail on it): keep ModelOpt's
    arch = (hf.get("architectures") or [hf.get("_written_architecture")])[0]
    return {"architecture": arch, "dtype": dtype,
            "num_hidden_layers": int(hf["num_hidden_layers"]), "num_attention_heads": heads,
            "hidden_size": int(hf["hidden_size"]), "intermediate_size": int(hf["intermediate_size"]),
            "num_key_value_heads": int(hf.get("num_key_value_heads", heads)), "head_size": head_size,
            "vocab_size": int(hf["vocab_size"]), "position_embedding_type": "rope_gpt_neox",
            "max_position_embeddings": hf.get("max_position_embeddings"), "rotary_embedding_dim": head_size,
            "qk_layernorm": False, "runtime_defaults": None,
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False))}


def qwen_fields(hf: dict[str, Any], dtype: str) -> dict[str, Any]:
    """What ``QWenConfig.from_hugging_face(...).to_dict()`` sets for a Qwen / Qwen2 / Qwen3 HF config."""
    qwen_type = hf.get("model_type")
    if qwen_type not in QWEN_TYPES:
        raise UserError(f"TRT-LLM checkpoint: model_type {qwen_type!r} is not a Qwen type TensorRT-LLM accepts "
                        f"({', '.join(QWEN_TYPES)})")
    theta, scaling = _rope(hf, 100000.0)
    if qwen_type == "qwen":
        theta, eps = float(hf.get("rotary_emb_base", 10000.0)), hf["layer_norm_epsilon"]
    else:
        eps = hf["rms_norm_eps"]
    moe = qwen_type in ("qwen2_moe", "qwen3_moe")
    arch = (hf.get("architectures") or [None])[0]
    return {**_common(hf, dtype),
            "hidden_act": "swiglu" if moe else hf.get("hidden_act", "silu"), "norm_epsilon": eps,
            "mlp_bias": False, "attn_bias": qwen_type not in ("qwen3", "qwen3_moe"),  # Qwen3: no attention bias
            "rotary_base": theta, "rotary_scaling": scaling, "disable_weight_only_quant_plugin": False,
            "use_logn_attn": bool(hf.get("use_logn_attn", False)), "seq_length": int(hf.get("seq_length", 8192)),
            "qwen_type": qwen_type, "moe_intermediate_size": int(hf.get("moe_intermediate_size", 0)),
            "moe_shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size", 0)),
            "moe": {"num_experts": int(hf.get("num_experts", 0)), "top_k": int(hf.get("num_experts_per_tok", 0)),
                    "normalization_mode": 0},  # ExpertScaleNormalizationMode.NONE
            "num_labels": int(hf.get("num_labels", 1)) if arch == "Qwen2ForSequenceClassification" else 1}


def llama_fields(hf: dict[str, Any], dtype: str) -> dict[str, Any]:
    """What ``LLaMAConfig.from_hugging_face(...)`` (and its ``to_dict``) sets for a Llama-architecture HF config."""
    theta, scaling = _rope(hf, 10000.0)
    head_size = _common(hf, dtype)["head_size"]
    attention_multiplier = float(hf.get("attention_multiplier", 1.0))
    if attention_multiplier != 1.0:
        attention_multiplier *= head_size ** 0.5
    moe_type = hf.get("model_type") in ("mixtral", "arctic", "granitemoe")
    return {**_common(hf, dtype),
            "hidden_act": "swiglu" if moe_type else hf["hidden_act"], "norm_epsilon": hf["rms_norm_eps"],
            "mlp_bias": False, "attn_bias": bool(hf.get("bias", False) or hf.get("attention_bias", False)),
            "rotary_base": theta, "rotary_scaling": scaling,
            "residual_mlp": bool(hf.get("parallel_attn_mlp_res", False)), "disable_weight_only_quant_plugin": False,
            "moe": {"num_experts": int(hf.get("num_local_experts", 0)), "top_k": int(hf.get("num_experts_per_tok", 0)),
                    "normalization_mode": 1 if moe_type else None},  # RENORMALIZE for MoE, else unset
            "remove_duplicated_kv_heads": False,
            "embedding_multiplier": float(hf.get("embedding_multiplier", 1.0)),
            "attention_multiplier": attention_multiplier,
            "residual_multiplier": float(hf.get("residual_multiplier", 1.0)),
            "output_multiplier_scale": 1.0 / float(hf.get("logits_scaling", 1.0)),
            "fc_after_embed": False, "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
            "layer_idx_offset": 0}


FAMILIES = {"qwen": qwen_fields, "qwen3moe": qwen_fields, "llama": llama_fields}  # by ModelOpt decoder type


def trtllm_config(written: dict[str, Any], hf: dict[str, Any], decoder: str) -> dict[str, Any]:
    """The checkpoint config ModelOpt writes with ``tensorrt_llm`` importable, from the one it wrote (either path)
    and the HF ``config.json`` dict."""
    if decoder not in FAMILIES:
        raise UserError(f"TRT-LLM checkpoint: no recorded from_hugging_face for decoder type {decoder!r} "
                        f"(recorded: {', '.join(FAMILIES)})")
    out = dict(written)
    out.update(FAMILIES[decoder]({**hf, "_written_architecture": written.get("architecture")}, str(written["dtype"])))
    out["use_parallel_embedding"], out["embedding_sharding_dim"] = True, 0
    out["logits_dtype"] = "float16" if written["dtype"] == "bfloat16" else written["dtype"]
    mapping = written.get("mapping") or {}
    keys = MAPPING_KEYS if out["moe"]["num_experts"] else MAPPING_KEYS[:3]  # moe_* only where there are experts
    out["mapping"] = {k: mapping[k] for k in keys if k in mapping}
    quant = written.get("quantization") or {}
    out["quantization"] = {"quant_algo": quant.get("quant_algo"), "kv_cache_quant_algo": quant.get("kv_cache_quant_algo"),
                           **{k: quant[k] for k, d in QUANT_DEFAULTS.items() if k in quant and quant[k] != d}}
    return out


def problems(written: dict[str, Any], hf: dict[str, Any], decoder: str) -> list[str]:
    """Every field of ``written`` that differs from what TensorRT-LLM's ``from_hugging_face`` sets (empty: none)."""
    want = trtllm_config(written, hf, decoder)
    return [f"{k}: {written.get(k, '<missing>')!r}, TensorRT-LLM's from_hugging_face sets {want[k]!r}"
            for k in sorted(want) if written.get(k, "<missing>") != want[k]]


def rewrite(export_dir: Path, hf: dict[str, Any], decoder: str) -> list[str]:
    """Rewrite ``export_dir/config.json`` as :func:`trtllm_config` (atomically) for the HF config dict ``hf``
    (``model.config.to_dict()``); returns what it changed."""
    path = Path(export_dir) / "config.json"
    written = json.loads(path.read_text())
    changed = problems(written, hf, decoder)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(trtllm_config(written, hf, decoder), indent=4) + "\n")
    os.replace(tmp, path)
    return changed
