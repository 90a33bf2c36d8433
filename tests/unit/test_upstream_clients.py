"""tools/upstream_clients.py's verdicts on what NVIDIA's client scripts print (their print formats written down from
reading them: tensorrtllm_backend @ c2e65b8 ``end_to_end_grpc_client.py``, ``inflight_batcher_llm_client.py``,
``tools/inflight_batcher_llm/end_to_end_test.py``; TensorRT-LLM ``llmapi_client.py``). The scripts themselves run
against real servers only in the tool."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import upstream_clients as uc  # noqa: E402

E2E = ["-u", "{grpc}", "-p", "x", "-o", "16"]


def test_text_printed_and_exit_0_passes():
    v = uc.judge("end_to_end_grpc_client.py", E2E, "text", 0, "0: The capital of France is\nnear Paris\n")
    assert v["ok"] and v["texts"] == ["The capital of France is\nnear Paris"]


def test_exit_0_without_text_fails():
    """The failure that once went unnoticed: the script prints the server's error, prints no text and exits 0."""
    out = ("Received an error from server:\nunexpected inference input 'exclude_input_in_output' for model "
           "'ensemble'\n")
    v = uc.judge("end_to_end_grpc_client.py", E2E, "text", 0, out)
    assert not v["ok"] and "no text" in v["problems"] and "errors in output" in v["problems"]
    assert "unexpected inference input 'exclude_input_in_output'" in v["errors"][0]


def test_streaming_pieces_are_joined_per_batch_index():
    out = "0 [b'The']\n1 [b'Hi']\n0 [b' cat\\n']\n1 [b'']\nThe cat\n\nHi\n"
    v = uc.judge("end_to_end_grpc_client.py", [*E2E, "-S"], "text", 0, out, n_texts=2)
    assert v["ok"] and v["texts"] == ["The cat\n", "Hi"]


def test_an_empty_text_or_a_missing_prompt_fails():
    assert uc.judge("end_to_end_grpc_client.py", E2E, "text", 0, "0: a\n1: \n", n_texts=2)["problems"] == [
        "1 of 2 texts empty"]
    assert uc.judge("end_to_end_grpc_client.py", E2E, "text", 0, "0: a\n", n_texts=3)["problems"] == [
        "1 texts for 3 prompts"]


def test_a_text_that_runs_past_its_stop_word_fails():
    assert uc.judge("end_to_end_grpc_client.py", E2E, "text", 0, "0:  A com\n", ends=" com")["ok"]
    assert uc.judge("end_to_end_grpc_client.py", E2E, "text", 0, "0:  A com more\n", ends=" com")["problems"] == [
        "a text does not end with ' com'"]


def test_inflight_batcher_llm_client_output_beam():
    out = ("Input: x\nOutput beam 0:  A com\nmore\nOutput beam 0:  A com\nmore\nOutput sequence:  [1, 2]\n")
    v = uc.judge("inflight_batcher_llm_client.py", ["--tokenizer-dir", "t"], "text", 0, out)
    assert v["ok"] and v["texts"] == [" A com\nmore"]
    assert not uc.judge("inflight_batcher_llm_client.py", [], "text", 1, out)["ok"]  # a non-zero exit fails


def test_end_to_end_test_outputs():
    ifb = "ensemble output: [b' ab']\n[INFO] Functionality test succeed.\n"
    assert uc.judge("end_to_end_test.py", [], "text", 0, ifb)["texts"] == [" ab"]
    llmapi = "Text output: one\nFinish reason: [b'length']\nText output: two\n[INFO] Functionality test succeeded.\n"
    assert uc.judge("end_to_end_test.py", ["--test-llmapi"], "text", 0, llmapi, n_texts=2)["texts"] == ["one", "two"]
    failed = "[Functionality test] Failed to infer with error: boom\n"
    assert not uc.judge("end_to_end_test.py", ["--test-llmapi"], "text", 1, failed)["ok"]


def test_a_refusal_passes_only_when_the_error_names_it():
    refused = ("Received an error from server:\n[StatusCode.UNIMPLEMENTED] ModelInfer RPC doesn't support models with "
               "decoupled transaction policy\n")
    assert uc.judge("llmapi_client.py", ["-u", "{grpc}"], "refused", 1, refused)["ok"]
    other = "Received an error from server:\n[StatusCode.INTERNAL] model crashed\n"
    assert not uc.judge("llmapi_client.py", ["-u", "{grpc}"], "refused", 1, other)["ok"]
    assert not uc.judge("llmapi_client.py", ["-u", "{grpc}"], "refused", 0, "Output text: hi\n")["ok"]
