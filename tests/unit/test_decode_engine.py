"""The batching engine on a tiny random Llama with the reference loader's FP8 KV-cache attention: a batch decodes what
each request decodes alone, seeds reproduce, stop/bad/end words, cancellation and per-request failures."""
from __future__ import annotations

import pytest
import torch

from pipeline.formats import KV_FORMATS, fp8
from pipeline.runtime import decode_engine as batching, reference as rt
from pipeline.runtime.decode_engine import BatchEngine, GenerationRequest

PROMPTS = [[1, 5, 7, 9, 3], [2, 4], list(range(10, 40)), [7] * 12, [100, 3, 100, 3, 9, 8, 7]]


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.1)  # sharp enough that positions matter (the negative control)
    cfg.architectures = ["LlamaForCausalLM"]
    m = AutoModelForCausalLM.from_config(cfg).eval()
    # The reference runtime's KV-cache fake quantization (what an FP8 KV checkpoint loads into), so the batched path
    # is shown to keep it.
    rt._register_attention()
    for mod in m.modules():
        if hasattr(mod, "k_proj"):
            mod.kv_k_scale, mod.kv_v_scale, mod.kv_format = torch.tensor(0.01), torch.tensor(0.01), KV_FORMATS["fp8"]
    m.set_attn_implementation(rt.ATTN_IMPL)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model: one thread is fastest, above all on shared cores
    yield m
    torch.set_num_threads(threads)


@pytest.fixture
def engine(model):
    eng = BatchEngine(model, max_batch_size=8)
    yield eng
    eng.close()


def alone(model, prompt, n, **kw):
    return list(rt.generate(model, prompt, n, **kw))


def test_a_batch_decodes_what_each_prompt_decodes_alone(model, engine):
    expected = [alone(model, p, 12) for p in PROMPTS]
    first = [engine.submit(GenerationRequest(p, 12)) for p in PROMPTS[:3]]
    next(iter(first[0]))  # the first ones are decoding; the rest join at a later step boundary
    late = [engine.submit(GenerationRequest(p, 12)) for p in PROMPTS[3:]]
    got = [[ev.token for ev in h] for h in first[:1]]
    got[0] = expected[0][:1] + got[0]  # the first event was consumed above
    got += [h.tokens() for h in first[1:] + late]
    assert got == expected
    assert engine.max_batch_seen >= 4  # they really shared forward passes


def test_negative_control_padded_positions_change_the_tokens(model):
    """Position ids counted over the left padding (the classic batching bug) change what short prompts decode: the
    comparison above would catch it."""

    class WrongPositions(BatchEngine):
        def _step_inputs(self):
            last, mask, _ = super()._step_inputs()
            return last, mask, torch.full_like(last, mask.shape[1] - 1)

    eng = WrongPositions(model, max_batch_size=8)
    try:
        handles = [eng.submit(GenerationRequest(p, 12)) for p in PROMPTS]
        got = [h.tokens() for h in handles]
    finally:
        eng.close()
    assert got != [alone(model, p, 12) for p in PROMPTS]


def _joined_at_once(eng, prompts, n):
    """Submit ``prompts`` while the engine thread is held, so that they join at the same step boundary."""
    with eng._cv:
        handles = [eng.submit(GenerationRequest(p, n)) for p in prompts]
    return [h.tokens() for h in handles]


def test_requests_that_join_together_share_one_prefill(model, engine):
    expected = [alone(model, p, 8) for p in PROMPTS]
    assert _joined_at_once(engine, PROMPTS, 8) == expected
    assert engine.prefills == 1  # five ragged prompts, one left-padded forward pass


def test_prefill_passes_stay_within_max_prefill_tokens(model):
    eng = BatchEngine(model, max_batch_size=8, max_prefill_tokens=32)
    try:
        assert _joined_at_once(eng, PROMPTS, 4) == [alone(model, p, 4) for p in PROMPTS]
    finally:
        eng.close()
    # by length: {2, 5, 7} (3 x 7 padded tokens); 12 would make 4 x 12 > 32, so {12}; 30 would make 2 x 30, so {30}
    assert eng.prefills == 3


def test_a_request_for_context_logits_joining_with_others_gets_every_prompt_position(model, engine):
    with engine._cv:
        ctx = engine.submit(GenerationRequest(PROMPTS[4], 4, return_context_logits=True))
        others = [engine.submit(GenerationRequest(p, 4)) for p in PROMPTS[:3]]
    assert ctx.tokens() == alone(model, PROMPTS[4], 4)
    assert [h.tokens() for h in others] == [alone(model, p, 4) for p in PROMPTS[:3]]
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([PROMPTS[4]])).logits[0].float()
    assert ctx.context_logits.shape == full.shape and torch.allclose(ctx.context_logits, full, atol=1e-4)
    assert engine.prefills == 2  # its own pass (all positions' logits), and one for the others


def test_requests_for_context_logits_that_join_together_share_one_pass(model, engine):
    """Log-likelihood requests (echo with logprobs) arrive many at a time: those of one width step share a pass
    (right-padded, of a fixed shape), and each gets its own prompt's logits, those of it run alone."""
    with engine._cv:
        handles = [engine.submit(GenerationRequest(p, 1, return_context_logits=True)) for p in PROMPTS]
        other = engine.submit(GenerationRequest(PROMPTS[0], 4))
    for p, h in zip(PROMPTS, handles):
        assert h.tokens() == alone(model, p, 1)
        with torch.inference_mode():
            full = model(input_ids=torch.tensor([p])).logits[0].float()
        assert h.context_logits.shape == full.shape and torch.allclose(h.context_logits, full, atol=1e-4)
    assert other.tokens() == alone(model, PROMPTS[0], 4)
    # lengths 5, 2, 7 -> 8 wide; 12 -> 16; 30 -> 32: three passes (every position's logits), one for the other
    assert [engine.context_shape(len(p)) for p in PROMPTS] == [(8, 8), (8, 8), (8, 32), (8, 16), (8, 8)]
    assert engine.prefills == 4


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_context_logits_are_the_same_bits_whatever_shares_the_pass(dtype):
    """CPU kernels may round by the shape of the whole pass (which ones do depends on the CPU and its ISA: bf16 on
    some, fp32's GEMM on others): left-padded into passes of the prompts that happen to arrive together, a prompt's
    logits then change with its companions (the negative control, on the model directly). The engine's
    log-likelihood passes have a shape fixed by each prompt's own length, and the prompt sits at the start of its
    row: alone, among others, at another row, its logits are the same bits. A dtype whose kernels round the same
    whatever the shape on this CPU has nothing to guard against, and is skipped."""
    import random

    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.1)
    net = AutoModelForCausalLM.from_config(cfg).eval().to(getattr(torch, dtype))
    rng = random.Random(0)
    target = [7, 3, 9, 100, 4, 5, 200, 11, 12, 13, 14]
    others = [[rng.randrange(256) for _ in range(rng.randrange(9, 16))] for _ in range(12)]

    @torch.inference_mode()
    def left_padded(rows):  # the prompt of row 0 in one left-padded pass with the others
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(rows):
            ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
        out = net(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        return out[0, width - len(rows[0]):]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = BatchEngine(net, max_batch_size=8)
    try:
        solo = left_padded([target])
        if not any(not torch.equal(left_padded([target, *others[:k]]), solo) for k in (1, 3, 7)):
            pytest.skip(f"{dtype} kernels on this CPU give the same bits whatever the pass's shape")

        def context_logits(companions, row):
            with eng._cv:  # held: they join one step boundary
                hs = [eng.submit(GenerationRequest(p, 1, return_context_logits=True)) for p in companions[:row]]
                h = eng.submit(GenerationRequest(target, 1, return_context_logits=True))
                hs += [eng.submit(GenerationRequest(p, 1, return_context_logits=True)) for p in companions[row:]]
            for x in [h, *hs]:
                x.tokens()
            return h.context_logits

        alone_ = context_logits([], 0)
        assert torch.equal(context_logits(others[:7], 3), alone_)
        assert torch.equal(context_logits(others[5:9], 0), alone_)
        assert torch.equal(context_logits(others[2:4], 2), alone_)
    finally:
        eng.close()
        torch.set_num_threads(threads)


def test_negative_control_prefill_positions_counted_over_the_padding_change_the_tokens(model):
    """A padded prefill whose position ids start at the padding (not at each row's first token) changes what the
    short prompts decode: the comparison above would catch it."""

    class WrongPrefillPositions(BatchEngine):
        def _prefill_inputs(self, group):
            ids, mask, _ = super()._prefill_inputs(group)
            return ids, mask, torch.arange(ids.shape[1]).expand_as(ids)

    eng = WrongPrefillPositions(model, max_batch_size=8)
    try:
        got = _joined_at_once(eng, PROMPTS, 8)
    finally:
        eng.close()
    assert eng.prefills == 1
    assert got != [alone(model, p, 8) for p in PROMPTS]


def test_a_seed_reproduces_its_tokens_whatever_else_is_in_the_batch(engine):
    req = dict(input_ids=PROMPTS[0], max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.95)
    solo = engine.generate(GenerationRequest(**req, seed=7))
    crowd = [engine.submit(GenerationRequest(p, 16, temperature=0.8, seed=i)) for i, p in enumerate(PROMPTS)]
    again = engine.submit(GenerationRequest(**req, seed=7))
    assert again.tokens() == solo
    assert [h.tokens() for h in crowd]
    assert engine.generate(GenerationRequest(**req, seed=8)) != solo  # negative control: another seed differs


def test_top_k_1_decodes_greedily_without_drawing_a_sample(model, engine, monkeypatch):
    # TensorRT-LLM resolves top-k 1 to greedy decoding whatever the temperature (the PyTorch backend's
    # resolve_sampling_strategy, tensorrt_llm/_torch/pyexecutor/sampling_utils.py); the OpenAI front end sends
    # top-k 1 for temperature 0, so that request must cost what a greedy one costs
    greedy = alone(model, PROMPTS[0], 8)

    def no_draw(*a, **k):
        raise AssertionError("sampled")

    monkeypatch.setattr(torch, "multinomial", no_draw)
    assert engine.generate(GenerationRequest(PROMPTS[0], 8, temperature=0.7, top_k=1, seed=3)) == greedy
    with pytest.raises(Exception):  # negative control: top-k 2 samples
        engine.generate(GenerationRequest(PROMPTS[0], 8, temperature=0.7, top_k=2, seed=3))


def test_stop_words_end_ids_and_max_tokens(model, engine):
    ref = alone(model, PROMPTS[2], 12)
    stop = ref[3:5]
    h = engine.submit(GenerationRequest(PROMPTS[2], 12, stop_words=[[255, 254], stop]))
    assert h.tokens() == ref[:5] and h.finish_reason == batching.FINISH_STOP
    h = engine.submit(GenerationRequest(PROMPTS[2], 12, end_ids=frozenset([ref[6]])))
    assert h.tokens() == ref[:ref.index(ref[6]) + 1] and h.finish_reason == batching.FINISH_END
    h = engine.submit(GenerationRequest(PROMPTS[2], 12, stop_words=[[ref[0], 255]]))  # never completed: no stop
    assert h.tokens() == ref and h.finish_reason == batching.FINISH_LENGTH


def test_bad_words_are_never_generated(model, engine):
    ref = alone(model, PROMPTS[3], 10)
    got = engine.generate(GenerationRequest(PROMPTS[3], 10, bad_words=[[t] for t in set(ref)]))
    assert not set(got) & set(ref)
    # A two-token bad word masks its last token only right after its first one.
    first = ref[0]
    pair = engine.generate(GenerationRequest(PROMPTS[3], 10, bad_words=[[PROMPTS[3][-1], first]]))
    assert pair[0] != first
    assert engine.generate(GenerationRequest(PROMPTS[3], 10, bad_words=[[255, first]]))[0] == first


def test_log_probs_and_logits_are_the_models(model, engine):
    h = engine.submit(GenerationRequest(PROMPTS[1], 6, return_log_probs=True, return_context_logits=True,
                                        return_generation_logits=True))
    events = list(h)
    tokens = [e.token for e in events]
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([PROMPTS[1] + tokens])).logits[0].float()
    logp = torch.log_softmax(full, -1)
    n = len(PROMPTS[1])
    for i, e in enumerate(events):
        assert e.log_prob == pytest.approx(float(logp[n - 1 + i, e.token]), abs=1e-3)
        assert torch.allclose(e.logits, full[n - 1 + i], atol=1e-3)
    assert h.context_logits.shape == (n, 256)
    assert torch.allclose(h.context_logits, full[:n], atol=1e-3)


def test_cancellation_ends_one_request_and_spares_the_others(model, engine):
    expected = alone(model, PROMPTS[0], 30)
    long = engine.submit(GenerationRequest(PROMPTS[2], 200))
    other = engine.submit(GenerationRequest(PROMPTS[0], 30))
    tokens = []
    for ev in long:
        if ev.token is not None:
            tokens.append(ev.token)
        if len(tokens) == 3:
            long.cancel()
    assert long.finish_reason == batching.FINISH_CANCELLED and len(tokens) < 200
    assert other.tokens() == expected


def test_a_failing_request_fails_alone(model, engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit(GenerationRequest([1, 999], 4))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit(GenerationRequest([1, 2], -1))
    doomed = engine.submit(GenerationRequest(PROMPTS[1], 5, bad_words=[[t] for t in range(256)]))
    fine = engine.submit(GenerationRequest(PROMPTS[0], 5))
    with pytest.raises(ValueError, match="every token is masked"):
        doomed.tokens()
    assert doomed.finish_reason == batching.FINISH_ERROR
    assert fine.tokens() == alone(model, PROMPTS[0], 5)


def _full_requant_attention(module, query, key, value, attention_mask, **kwargs):
    """The oracle: every call fake-quantizes the whole key and value, the cached positions included."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    key, value = fp8.fake_fp8(key, module.kv_k_scale), fp8.fake_fp8(value, module.kv_v_scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _greedy_logits(model, prompt, n):
    from transformers import DynamicCache

    cache, ids, rows = DynamicCache(config=model.config), torch.tensor([prompt]), []
    with torch.inference_mode():
        for _ in range(n):
            row = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].float()
            rows.append(row)
            ids = torch.tensor([[int(row.argmax())]])
    return torch.stack(rows), cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_cache_holds_each_position_quantized_once(model, dtype):
    import copy

    from transformers import AttentionInterface

    m = copy.deepcopy(model).to(dtype)
    fast, cache = _greedy_logits(m, PROMPTS[2], 10)
    for layer, mod in zip(cache.layers, (x for x in m.modules() if hasattr(x, "k_proj"))):
        assert torch.equal(layer.keys, fp8.fake_fp8(layer.keys, mod.kv_k_scale))  # stored quantized
        assert torch.equal(layer.values, fp8.fake_fp8(layer.values, mod.kv_v_scale))
    AttentionInterface.register("test_full_requant", _full_requant_attention)
    m.set_attn_implementation("test_full_requant")
    assert torch.equal(_greedy_logits(m, PROMPTS[2], 10)[0], fast)  # quantizing once is quantizing every step
    m.set_attn_implementation("sdpa")  # negative control: without the KV quantization the logits differ
    assert not torch.equal(_greedy_logits(m, PROMPTS[2], 10)[0], fast)


def test_a_sliding_window_model_prefills_log_likelihood_prompts_alone_and_unpadded():
    """A sliding-window cache keeps the last positions of a pass: a right-padded pass would keep padding and drop
    the prompt's own positions, and the tokens decoded after it would be wrong. Such an engine decodes one sequence
    at a time, and prefills each prompt alone, unpadded: its tokens and logits are those of the model alone."""
    from transformers import AutoModelForCausalLM, MistralConfig

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=4,
                        initializer_range=0.1)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    eng = BatchEngine(m, max_batch_size=8)
    try:
        assert eng.max_batch_size == 1
        prompt = PROMPTS[3] + [5, 9, 11]  # 15 tokens: longer than the window, not a multiple of the width step
        h = eng.submit(GenerationRequest(prompt, 6, return_context_logits=True))
        assert h.tokens() == alone(m, prompt, 6)
        with torch.inference_mode():
            full = m(input_ids=torch.tensor([prompt])).logits[0].float()
        assert torch.allclose(h.context_logits, full, atol=1e-4)
    finally:
        eng.close()



def test_stats_count_the_batch_the_queue_and_what_each_sequence_holds(model):
    """What the runtime's load metrics read: a batch of two with two more queued, then nothing once all ended."""
    import time

    eng = BatchEngine(model, max_batch_size=2)
    try:
        assert eng.stats() == {"waiting": 0, "context": 0, "scheduled": 0, "iterations": 0, "sequence_tokens": []}
        handles = [eng.submit(GenerationRequest(p, 40)) for p in PROMPTS[:4]]
        next(iter(handles[0]))  # the first two are decoding
        st = eng.stats()
        assert st["scheduled"] == 2 and st["waiting"] == 2 and st["iterations"] >= 1, st
        # each sequence in the batch holds its prompt and what it generated so far (one of the first two prompts)
        assert len(st["sequence_tokens"]) == 2 and all(n > len(PROMPTS[1]) for n in st["sequence_tokens"]), st
        list(handles[0])  # the rest of its events
        for h in handles[1:]:
            h.tokens()
        deadline = time.monotonic() + 10
        while eng.stats()["scheduled"] and time.monotonic() < deadline:
            time.sleep(0.01)
        st = eng.stats()
        assert (st["scheduled"], st["waiting"], st["sequence_tokens"]) == (0, 0, []), st
    finally:
        eng.close()
