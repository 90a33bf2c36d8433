"""A STAND-IN for TensorRT-LLM's LLM API, for tests only: NOT TensorRT-LLM, and it runs no model.

TensorRT-LLM cannot be installed here (it needs NVIDIA's TRT-LLM container and a GPU), so the llmapi layout's Triton
python model (``pipeline/triton/layouts/llmapi/models/tensorrt_llm.llmapi/1/model.py``) is exercised against this
package instead: ``tests/e2e/test_llmapi_model.py`` copies it into the model's version folder, which Triton's python
backend puts on the stub's ``sys.path`` (the stub runs Python isolated: ``PYTHONPATH`` does not reach it), so the
model's ``import tensorrt_llm`` finds it. It implements only the surface that model calls, shaped as TensorRT-LLM
1.2.1's (``tensorrt_llm/llmapi/llm.py``, ``tensorrt_llm/sampling_params.py``, ``tensorrt_llm/executor/result.py``):

- ``LLM(**kwargs)``: records its keyword arguments and the ``CUDA_VISIBLE_DEVICES`` / ``TRTLLM_VISIBLE_DEVICES`` it
  was created under; ``shutdown()``.
- ``LLM.generate_async(prompt, sampling_params=None, streaming=False)`` -> a ``RequestOutput`` that async-iterates:
  streaming, once per generated token with the cumulative ``outputs[0].text`` (never the prompt), the last one
  ``finished``; otherwise once, at the end, with the prompt before the generated text unless
  ``exclude_input_from_output`` (the LLM API's default True). ``CompletionOutput.text_diff`` is the text added since
  the output before, as the LLM API's. The result's ``abort()`` ends the generation at its next token with
  ``finish_reason`` ``cancelled``.
- Generated text: ``max_tokens`` (default 32) words, each with a leading space, chosen from the prompt's hash
  (:func:`words`), one every ``$TRTLLM_STANDIN_TOKEN_S`` seconds (0.01 without it); ``finish_reason`` ``length``, or
  ``stop`` (``stop_reason`` the string, cut from the text) where a ``stop`` string shows up; ``cumulative_logprob``
  None (no log probs were asked for).
- ``SamplingParams(**kwargs)``: keeps its keyword arguments; a keyword TensorRT-LLM's dataclass lacks is a
  ``TypeError``, as there. With ``return_perf_metrics`` each output carries ``request_perf_metrics`` with the
  fixed, distinct values of :data:`PERF` (timings as ``datetime.timedelta``, as TensorRT-LLM's bindings give them).
- ``llmapi.KvCacheConfig`` / ``llmapi.CudaGraphConfig``: keep their keyword arguments.

Every call is recorded as one JSON line in ``$TRTLLM_STANDIN_RECORD/<pid>.jsonl`` (the directory the test reads):
``{"event": "LLM" | "generate" | "abort" | "shutdown", ...}``.
"""
from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import os
import threading
from types import SimpleNamespace

__version__ = "0.0.0+standin"

WORDS = ("amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor", "island", "juniper", "kestrel",
         "lagoon", "meadow", "nectar", "orchard", "prairie", "quartz", "river", "summit", "tundra")

# request_perf_metrics of every output when return_perf_metrics is set; the decimal strings upstream's model sends
PERF = {
    "kv_cache": {"num_reused_blocks": 3, "kv_cache_hit_rate": 0.375, "num_new_allocated_blocks": 5,
                 "num_total_allocated_blocks": 11, "num_missed_blocks": 7},
    "timing": {"arrival_time": datetime.timedelta(seconds=1000, microseconds=1),
               "first_scheduled_time": datetime.timedelta(seconds=1000, microseconds=20),
               "first_token_time": datetime.timedelta(seconds=1001, microseconds=300),
               "last_token_time": datetime.timedelta(seconds=1002, microseconds=4000)},
    "speculative_decoding": {"acceptance_rate": 0.625, "total_accepted_draft_tokens": 10, "total_draft_tokens": 16},
}
PERF_STRINGS = {
    "kv_cache_reused_block": "3", "kv_cache_hit_rate": "0.375", "kv_cache_alloc_new_blocks": "5",
    "kv_cache_alloc_total_blocks": "11", "kv_cache_missed_block": "7",
    "arrival_time_ns": "1000000001000", "first_scheduled_time_ns": "1000000020000",
    "first_token_time_ns": "1001000300000", "last_token_time_ns": "1002004000000",
    "acceptance_rate": "0.625", "total_accepted_draft_tokens": "10", "total_draft_tokens": "16",
}

# the keywords of TensorRT-LLM 1.2.1's SamplingParams dataclass (tensorrt_llm/sampling_params.py)
SAMPLING_FIELDS = frozenset("""end_id pad_id max_tokens bad bad_token_ids stop stop_token_ids include_stop_str_in_output
    embedding_bias logits_processor apply_batched_logits_processor n best_of use_beam_search top_k top_p top_p_min
    top_p_reset_ids top_p_decay seed temperature min_tokens beam_search_diversity_rate repetition_penalty
    presence_penalty frequency_penalty prompt_ignore_length length_penalty early_stopping no_repeat_ngram_size min_p
    beam_width_array logprobs prompt_logprobs return_context_logits return_generation_logits
    exclude_input_from_output return_encoder_output return_perf_metrics additional_model_outputs lookahead_config
    guided_decoding ignore_eos detokenize add_special_tokens truncate_prompt_tokens skip_special_tokens
    spaces_between_special_tokens""".split())

_lock = threading.Lock()


def _plain(obj):
    if isinstance(obj, _Config):
        return {type(obj).__name__: obj.kwargs}
    if isinstance(obj, datetime.timedelta):
        return obj.total_seconds()
    return repr(obj)


def record(event: str, **fields) -> None:
    """Append one JSON line to ``$TRTLLM_STANDIN_RECORD/<pid>.jsonl`` (nothing without the variable)."""
    folder = os.environ.get("TRTLLM_STANDIN_RECORD")
    if not folder:
        return
    line = json.dumps({"event": event, "pid": os.getpid(), **fields}, default=_plain)
    with _lock, open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(line + "\n")


def words(prompt: str, n: int) -> list[str]:
    """The ``n`` tokens the stand-in generates for ``prompt``: words with a leading space, chosen from its hash."""
    seed = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:4], "little")
    return [" " + WORDS[(seed + 7 * i) % len(WORDS)] for i in range(n)]


class _Config:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class SamplingParams:
    def __init__(self, **kwargs):
        unknown = sorted(set(kwargs) - SAMPLING_FIELDS)
        if unknown:
            raise TypeError(f"SamplingParams.__init__() got an unexpected keyword argument '{unknown[0]}'")
        self.kwargs = kwargs
        self.max_tokens = kwargs.get("max_tokens", 32)
        self.exclude_input_from_output = kwargs.get("exclude_input_from_output", True)
        self.return_perf_metrics = kwargs.get("return_perf_metrics", False)
        stop = kwargs.get("stop")
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])


class CompletionOutput:
    def __init__(self, index: int = 0):
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.cumulative_logprob = None
        self.finish_reason = None
        self.stop_reason = None
        self.request_perf_metrics = None
        self._last_text_len = 0

    @property
    def text_diff(self) -> str:
        """The text added since the output before (what upstream's model never sends)."""
        return self.text[self._last_text_len:]


def _perf_metrics():
    return SimpleNamespace(kv_cache_metrics=SimpleNamespace(**PERF["kv_cache"]),
                           timing_metrics=SimpleNamespace(**PERF["timing"]),
                           speculative_decoding=SimpleNamespace(**PERF["speculative_decoding"]))


class RequestOutput:
    """What ``generate_async`` returns: async-iterating it yields itself after each step, as the LLM API's does."""

    _ids = iter(range(1, 1 << 62))

    def __init__(self, llm: "LLM", prompt: str, params: SamplingParams, streaming: bool):
        self.request_id = next(self._ids)
        self.prompt = prompt
        self.outputs = [CompletionOutput()]
        self.finished = False
        self._llm, self._params, self._streaming = llm, params, streaming
        self._aborted = threading.Event()
        self._started = False

    def abort(self) -> None:
        record("abort", model=self._llm.model, prompt=self.prompt, finished=self.finished)
        self._aborted.set()

    def __aiter__(self):
        if self._started:
            raise RuntimeError("a RequestOutput is iterated once")
        self._started = True
        return self._steps()

    async def _steps(self):
        out, params = self.outputs[0], self._params
        pace = float(os.environ.get("TRTLLM_STANDIN_TOKEN_S", "0.01"))
        generated = ""
        for i, word in enumerate(words(self.prompt, int(params.max_tokens))):
            await asyncio.sleep(pace)
            out._last_text_len = len(out.text)
            if self._aborted.is_set():
                out.finish_reason = "cancelled"
            else:
                generated += word
                out.token_ids.append(i)
                hit = next((s for s in params.stop if s and s in generated), None)
                if hit is not None:
                    generated = generated[:generated.index(hit)]
                    out.finish_reason, out.stop_reason = "stop", hit
                elif i + 1 == int(params.max_tokens):
                    out.finish_reason = "length"
            self.finished = out.finish_reason is not None
            if self._streaming:
                out.text = generated
            elif self.finished:
                out._last_text_len = 0
                out.text = generated if params.exclude_input_from_output else self.prompt + generated
            if params.return_perf_metrics:
                out.request_perf_metrics = _perf_metrics()
            if self._streaming or self.finished:
                yield self
            if self.finished:
                return
        if not self.finished:  # max_tokens 0
            out.finish_reason, self.finished = "length", True
            yield self


class LLM:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.model = kwargs.get("model")
        record("LLM", kwargs=kwargs, cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
               trtllm_visible_devices=os.environ.get("TRTLLM_VISIBLE_DEVICES"))

    def generate_async(self, inputs, sampling_params: SamplingParams | None = None, streaming: bool = False,
                       **kwargs) -> RequestOutput:
        params = sampling_params or SamplingParams()
        record("generate", model=self.model, prompt=inputs, streaming=streaming, sampling=params.kwargs,
               extra=kwargs)
        return RequestOutput(self, inputs, params, bool(streaming))

    def shutdown(self) -> None:
        record("shutdown", model=self.model)
