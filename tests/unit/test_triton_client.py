"""The load generator's arithmetic: output tokens from the re-tokenized text (an empty response adds none), aiperf's
inter-token latency, the entry points' request tensors, and the statistics of one level."""
from __future__ import annotations

import pytest

from pipeline.stages.bench import triton_client as client
from pipeline.stages.bench.triton_client import EntryPoint, RequestRecord


@pytest.fixture(scope="module")
def tok():
    """A real Hugging Face fast tokenizer (byte-level BPE trained on the shipped corpus, as tiny-qwen3's)."""
    from pipeline.stages.fetch import train_tokenizer

    return train_tokenizer(512)


def _record(text: str, chunks: list[float], responses: int, *, sent: float = 10.0, done: float | None = None,
            error: str | None = None) -> RequestRecord:
    return RequestRecord(0, sent=sent, first=chunks[0] if chunks else None, done=done, chunk_times=chunks,
                         responses=responses, text=text, error=error)


def test_output_tokens_come_from_the_text_not_the_responses(tok):
    text = "The capital of France is Paris."
    # four responses: three with text, then the empty final response the stream ends with
    rec = _record(text, [10.1, 10.2, 10.3], responses=4, done=10.5)
    client.count_output_tokens([rec], tok)
    assert rec.output_tokens == len(tok.encode(text, add_special_tokens=False)) > 3
    # negative control: the same responses with no text count zero tokens, and no TTFT
    empty = _record("", [], responses=2, done=10.5)
    client.count_output_tokens([empty], tok)
    assert empty.output_tokens == 0 and empty.ttft is None and empty.itl is None


def test_inter_token_latency_is_aiperfs(tok):
    rec = _record("one two three four five", [10.2, 10.4], responses=3, done=11.0)
    client.count_output_tokens([rec], tok)
    n = rec.output_tokens
    assert n >= 2
    assert rec.ttft == pytest.approx(0.2) and rec.latency == pytest.approx(1.0)
    assert rec.itl == pytest.approx((1.0 - 0.2) / (n - 1))
    assert rec.chunk_gaps == [pytest.approx(0.2)]
    d = rec.as_dict()
    assert d["inter_token_latency_ms"] == pytest.approx(1000 * 0.8 / (n - 1), abs=1e-3)
    assert d["inter_chunk_latencies_ms"] == [pytest.approx(200.0)] and d["responses"] == 3


def test_summarize_refuses_uncounted_records_and_ignores_errors(tok):
    ok = _record("Paris is the capital", [1.1, 1.2], responses=3, sent=1.0, done=1.5)
    bad = _record("", [], responses=0, sent=1.0, error="boom")
    with pytest.raises(ValueError, match="count_output_tokens"):
        client.summarize([ok, bad], 2.0)
    client.count_output_tokens([ok, bad], tok)
    s = client.summarize([ok, bad], 2.0)
    n = ok.output_tokens
    assert s["request_count"] == 2 and s["error_count"] == 1 and s["errors"] == ["boom"]
    assert s["output_token_throughput"]["avg"] == pytest.approx(n / 2.0)
    assert s["output_sequence_length"]["avg"] == n and s["output_token_count"]["avg"] == n
    assert s["time_to_first_token"]["p50"] == pytest.approx(100.0)
    assert s["request_latency"]["p99"] == pytest.approx(500.0)
    for key in ("p1", "p5", "p10", "p25", "p75", "p90", "std"):  # every statistic aiperf exports
        assert key in s["request_latency"]


def test_request_tensors_follow_the_layout_and_the_model_config():
    def shapes(entry):
        return {t.name(): (t.shape(), t.datatype()) for t in client._inputs(entry, "hi", 7)}

    assert shapes(EntryPoint("ensemble", "inflight_batcher_llm")) == {
        "text_input": ([1, 1], "BYTES"), "max_tokens": ([1, 1], "INT32"), "stream": ([1, 1], "BOOL"),
        "exclude_input_in_output": ([1, 1], "BOOL")}
    assert "exclude_input_in_output" not in shapes(EntryPoint("ensemble", "inflight_batcher_llm", exclude_input=False))
    # upstream's llmapi model: max_batch_size 0 in model.yaml, so 1-D tensors, LLM-API names; it returns the prompt
    # with the text unless told not to
    assert shapes(EntryPoint("tensorrt_llm", "llmapi", batched=False)) == {
        "text_input": ([1], "BYTES"), "sampling_param_max_tokens": ([1], "INT32"), "streaming": ([1], "BOOL"),
        "sampling_param_exclude_input_from_output": ([1], "BOOL")}
    assert EntryPoint("tensorrt_llm", "llmapi").cumulative
    assert not EntryPoint("ensemble", "inflight_batcher_llm").cumulative
