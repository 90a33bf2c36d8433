"""TensorRT-LLM's ``llmapi`` layout ``tensorrt_llm`` model computed by the reference runtime.

Same ``config.pbtxt`` and ``1/model.yaml`` as TensorRT-LLM's LLM-API model gets, and the same answers to the same
requests as that model (TensorRT-LLM triton_backend/all_models/llmapi/tensorrt_llm/1/model.py @ 044a90d209, the
commit the 1.2.1 record cites, and its ``helpers.py``) gives with the LLM API (``tensorrt_llm/sampling_params.py``,
``tensorrt_llm/executor/result.py``) behind it. ``auto_complete_config`` takes ``max_batch_size`` and the transaction
policy from model.yaml's ``triton_config``.

- Requests: ``text_input`` holds one prompt (a 1-D tensor, as upstream's ``llmapi_client.py`` sends; a leading batch
  dimension of 1 is accepted too). ``streaming`` (decoupled only; otherwise the request fails with upstream's
  "Streaming is only supported in decoupled mode.") sends one response per generated token.
- Text: a streamed response carries the text generated so far, never the prompt (TensorRT-LLM's ``LlmRequest``
  returns only tokens not yet sent when streaming, whatever ``exclude_input_from_output`` says); a single response
  is the decoded prompt and generated tokens together unless ``sampling_param_exclude_input_from_output`` is true
  (upstream's model defaults it to false, unlike the LLM API). Special tokens are skipped, as the LLM API does.
- ``sampling_param_*`` as upstream hands them to ``SamplingParams``: ``max_tokens`` (default 32, the LLM API's),
  ``temperature``/``top_k``/``top_p`` validated as ``SamplingParams._validate`` does (top_p in [0, 1], top_k and
  temperature not negative) and decoded greedily exactly when ``params_imply_greedy_decoding`` says so (none of the
  three given, or top_k 1, top_p 0, temperature 0); otherwise sampled with an unset temperature 1, top_k unset (no
  truncation) and top_p unset (1). ``frequency_penalty``, ``presence_penalty``, ``seed`` (the same seed and inputs
  give the same text). ``stop`` strings become token sequences (encoded without special tokens, as
  ``SamplingParams._setup`` does); generation ends when the output ends with one, and it is cut from the output
  (``include_stop_str_in_output`` is false). ``best_of`` above 1 is refused (the reference decodes one sequence).
- ``return_finish_reason`` / ``return_stop_reason`` / ``return_cumulative_logprob`` add ``str()`` of
  ``CompletionOutput.finish_reason`` (``stop`` for an end token or a stop string, ``length``, ``cancelled``; ``None``
  before the end), ``stop_reason`` (the stop string; ``None`` for an end token, as ``result.py`` leaves it) and
  ``cumulative_logprob``, which is ``None``: upstream's model never asks the LLM API for log probs, so the LLM API
  never fills it. Each is a STRING tensor, as upstream sends them whatever the config declares.
- ``sampling_param_return_perf_metrics``: every response adds the request's perf metrics as upstream does, as STRING
  tensors of their decimal values: ``kv_cache_reused_block`` 0 and ``kv_cache_hit_rate`` 0.0 (the reference reuses
  no blocks), ``kv_cache_missed_block`` the prompt's blocks, ``kv_cache_alloc_new_blocks`` /
  ``kv_cache_alloc_total_blocks`` the blocks the sequence holds (``kv_cache_config.tokens_per_block`` of model.yaml,
  the LLM API's 32 without it); ``arrival_time_ns`` <= ``first_scheduled_time_ns`` <= ``first_token_time_ns`` <=
  ``last_token_time_ns`` on the monotonic clock (TensorRT-LLM's are steady-clock times); ``acceptance_rate`` 0.0,
  ``total_accepted_draft_tokens`` and ``total_draft_tokens`` 0 (no speculative decoding).
- ``stop`` true with the request id of running requests cancels them, and the stop request itself is answered with
  a CANCELLED error ("Request cancelled by client"), as upstream's ``handle_stop_request`` does (also when no request
  has that id; without an id it fails). A cancelled streaming request ends with a final response holding its text
  so far and finish reason ``cancelled``, as the LLM API's last output is. A cancelled non-streaming request gets the
  CANCELLED error: upstream sends it nothing at all, which leaves the client waiting; the reference ends it. A client
  cancellation gets the CANCELLED error, as upstream's cancellation loop sends.
- Guided decoding: with model.yaml's ``guided_decoding_backend`` (an LLM argument; the reference runs ``xgrammar``),
  this project's ``guided_decoding_guide_type`` / ``guided_decoding_guide`` inputs (``pipeline/upstream``
  ``extensions``) are what ``model.py`` turns into ``GuidedDecodingParams`` for TensorRT-LLM; here the guide is
  compiled with XGrammar from the model's tokenizer (``reference_guided.py``, each type as TensorRT-LLM compiles it)
  and its token bitmask masks every step. A guide without ``guided_decoding_backend`` is refused, as is an unknown
  guide type.
- Load metrics under the TensorRT-LLM C++ backend's names (``nv_trt_llm_request_metrics``,
  ``nv_trt_llm_kv_cache_block_metrics`` in blocks of ``kv_cache_config.tokens_per_block``,
  ``nv_trt_llm_general_metrics``; ``reference_common.LoadMetrics``), read from the batching engine: upstream's llmapi
  model reports none (model.py @ 044a90d209 makes no metric), so a gateway finds the reference's load where the C++
  backend's would be.
- Checkpoint: the ``engine_dir`` parameter (relative to the repository root); without it, model.yaml's ``model``
  (relative to model.yaml's folder unless absolute). ``dtype``, ``device``, ``torch_threads`` and ``max_seq_len``
  parameters, else model.yaml's ``dtype`` / ``max_seq_len``. The batching engine decodes up to model.yaml's
  ``max_batch_size`` (an LLM-API option; 8 without it) sequences together.
"""
import json
import os
import queue
import sys
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from reference_common import (  # noqa: E402
    LoadMetrics, RequestError, Sender as _Sender, param as _param, watch_cancellation)


def _model_yaml():
    path = os.path.join(HERE, os.environ.get("LLM_CONFIG_PATH", "model.yaml"))
    if not os.path.isfile(path):
        raise pb_utils.TritonModelException(f"{path} (the model's LLM options and triton_config) is missing")
    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    if "triton_config" not in doc:
        raise pb_utils.TritonModelException(f"{path} has no triton_config (max_batch_size, decoupled)")
    return doc, path


def _value(request, name, default=None):
    """A scalar input (upstream's tensors hold one value per request)."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    a = t.as_numpy()
    if a.size == 0:
        return default
    if a.size != 1:
        raise RequestError(f"{name}: expected a single value, got shape {list(a.shape)}")
    v = a.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else v.item() if hasattr(v, "item") else v


def _strings(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return []
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in t.as_numpy().reshape(-1)]


class _Job:
    def __init__(self, request, sender, user_id, prompt_ids, prompt_text, params, arrival_ns):
        self.request, self.sender, self.user_id = request, sender, user_id
        self.prompt_ids, self.prompt_text, self.params = prompt_ids, prompt_text, params
        self.arrival_ns = arrival_ns
        self.wall_offset_ns = time.time_ns() - time.monotonic_ns()  # the engine stamps admission with time.time_ns()
        self.events = queue.Queue()
        self.handle = None
        self.stopped = None   # "stop" (a stop request) or "client" (a client cancellation)

    def cancel(self, by="client"):
        self.stopped = self.stopped or by
        if self.handle is not None:
            self.handle.cancel()


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        doc, _ = _model_yaml()
        tc = doc["triton_config"]
        current = auto_complete_model_config.as_dict()
        if not current.get("model_transaction_policy", {}).get("decoupled") and tc.get("decoupled"):
            auto_complete_model_config.set_model_transaction_policy(dict(decoupled=bool(tc["decoupled"])))
        if not current.get("max_batch_size"):
            auto_complete_model_config.set_max_batch_size(int(tc.get("max_batch_size", 0)))
        return auto_complete_model_config

    def initialize(self, args):
        import torch
        import reference_decode_engine as decode_engine
        import reference_runtime as rt
        import reference_formats as formats
        from transformers import AutoTokenizer

        cfg = json.loads(args["model_config"])
        self.cfg = cfg
        self.outputs = {o["name"] for o in cfg.get("output", [])}
        doc, yaml_path = _model_yaml()
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        rel = _param(cfg, "engine_dir")
        if rel:
            path = rel if os.path.isabs(rel) else os.path.join(args["model_repository"], "..", rel)
            origin = "parameter engine_dir"
        else:
            model = str(doc.get("model", ""))
            path = model if os.path.isabs(model) else os.path.join(os.path.dirname(yaml_path), model)
            origin = f"{yaml_path} model"
        path = os.path.normpath(path)
        if not os.path.isdir(path):
            raise pb_utils.TritonModelException(f"{origin}: {path} is not a checkpoint directory")
        threads = int(_param(cfg, "torch_threads", "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        device = _param(cfg, "device", "cpu")
        # the parameter, else model.yaml's LLM-API dtype; auto: bfloat16 where it is native, else float32
        dtype = rt.compute_dtype(_param(cfg, "dtype") or doc.get("dtype") or "auto", device)
        self.model = rt.load(path, dtype=dtype, device=device, formats=formats)
        self.tokenizer = AutoTokenizer.from_pretrained(doc.get("tokenizer") or path)
        gen_cfg = getattr(self.model, "generation_config", None)
        eos = getattr(gen_cfg, "eos_token_id", None) or self.model.config.eos_token_id
        self.eos = frozenset(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        max_seq = _param(cfg, "max_seq_len") or doc.get("max_seq_len")
        self.decode_engine = decode_engine
        self.engine = decode_engine.BatchEngine(self.model, max_batch_size=int(doc.get("max_batch_size") or 8),
                                           max_seq_len=int(max_seq) if max_seq else None)
        self.tokens_per_block = int((doc.get("kv_cache_config") or {}).get("tokens_per_block") or 32)
        self.grammars = None
        backend = doc.get("guided_decoding_backend")
        if backend:
            if backend != "xgrammar":
                raise pb_utils.TritonModelException(f"{yaml_path}: guided_decoding_backend {backend!r}: the reference "
                                                    f"runtime's guided decoding is XGrammar's (xgrammar)")
            import reference_guided as guided

            self.grammars = guided.Grammars.from_tokenizer(self.tokenizer, self.engine.vocab_size)
        # the load TensorRT-LLM's C++ backend reports, under its names (its llmapi model reports none)
        self.load = LoadMetrics(self.engine, args["model_name"], args["model_version"], self.tokens_per_block)
        period = doc["triton_config"].get("cancellation_check_period_ms", 100)
        self.cancel_period_s = int(period) / 1000.0
        self.jobs = set()
        self.lock = threading.Lock()
        self.running = True
        threading.Thread(target=watch_cancellation, args=(self,), daemon=True).start()

    # --- requests ----------------------------------------------------------------------------------------------
    def execute(self, requests):
        now = time.monotonic_ns()
        for request in requests:
            sender = _Sender(request.get_response_sender())
            user_id = request.request_id()
            try:
                if _value(request, "stop", False):
                    self._stop(user_id, sender)
                    continue
                job = self._convert(request, sender, user_id, now)
                job.handle = self.engine.submit(job.params["request"], on_event=job.events.put)
            except Exception as exc:
                self._fail(sender, exc)
                continue
            with self.lock:
                self.jobs.add(job)
            threading.Thread(target=self._serve, args=(job,), daemon=True).start()
        return None

    def _convert(self, request, sender, user_id, now):
        texts = _strings(request, "text_input")
        if not texts:
            raise RequestError("text_input is missing from the request")
        if len(texts) > 1:
            raise RequestError(f"text_input holds {len(texts)} prompts; this model takes one prompt per request "
                               "(a 1-D text_input), as TensorRT-LLM's llmapi model does")
        best_of = _value(request, "sampling_param_best_of", 1)
        if best_of is not None and int(best_of) > 1:
            raise RequestError(f"best_of={best_of} (several candidate sequences) is not supported by the reference "
                               "runtime")
        streaming = bool(_value(request, "streaming", False))
        if streaming and not self.decoupled:
            raise RequestError("Streaming is only supported in decoupled mode.")
        temperature = _value(request, "sampling_param_temperature")
        top_k = _value(request, "sampling_param_top_k")
        top_p = _value(request, "sampling_param_top_p")
        if top_p is not None and not 0 <= top_p <= 1:
            raise RequestError(f"require 0 <= top_p <= 1, got top_p={top_p}")
        if top_k is not None and top_k < 0:
            raise RequestError(f"require top_k >= 0, got top_k={top_k}")
        if temperature is not None and temperature < 0:
            raise RequestError(f"require temperature >= 0, got temperature={temperature}")
        greedy = ((temperature is None and top_p is None and top_k is None) or top_k == 1 or top_p == 0.0
                  or temperature == 0)
        stops = [s for s in _strings(request, "sampling_param_stop") if s]
        stop_ids = [self.tokenizer.encode(s, add_special_tokens=False) for s in stops]
        prompt_ids = self.tokenizer(texts[0])["input_ids"]
        grammar = self._grammar(request)
        req = self.decode_engine.GenerationRequest(
            input_ids=prompt_ids,
            max_new_tokens=int(_value(request, "sampling_param_max_tokens", 32)),
            end_ids=self.eos,
            temperature=0.0 if greedy else float(1.0 if temperature is None else temperature),
            top_k=int(top_k or 0),
            top_p=1.0 if greedy or top_p is None else float(top_p),
            seed=int(_value(request, "sampling_param_seed", 0) or 0),
            presence_penalty=float(_value(request, "sampling_param_presence_penalty", 0.0) or 0.0),
            frequency_penalty=float(_value(request, "sampling_param_frequency_penalty", 0.0) or 0.0),
            stop_words=[ids for ids in stop_ids if ids],
            grammar=grammar,
        )
        params = {
            "request": req, "streaming": streaming, "stop": [(s, ids) for s, ids in zip(stops, stop_ids) if ids],
            "exclude": bool(_value(request, "sampling_param_exclude_input_from_output", False)),
            "perf": bool(_value(request, "sampling_param_return_perf_metrics", False)),
            "finish_reason": bool(_value(request, "return_finish_reason", False)),
            "stop_reason": bool(_value(request, "return_stop_reason", False)),
            "cum_logprob": bool(_value(request, "return_cumulative_logprob", False)),
        }
        return _Job(request, sender, user_id, prompt_ids, texts[0], params, now)

    def _grammar(self, request):
        """The request's grammar state from its guide inputs (None without a guide)."""
        import reference_guided as guided

        kind = _value(request, "guided_decoding_guide_type")
        if kind is None:
            return None
        if self.grammars is None:
            raise RequestError("guided decoding needs guided_decoding_backend in model.yaml (an LLM argument)")
        try:
            return self.grammars.matcher(kind, _value(request, "guided_decoding_guide"))
        except guided.GuideError as exc:
            raise RequestError(f"guided decoding: {exc}") from None

    def _stop(self, user_id, sender):
        if not user_id:
            self._fail(sender, RequestError("A request id must be provided for request cancellation"))
            return
        with self.lock:
            for job in self.jobs:
                if job.user_id == user_id:
                    job.cancel("stop")
        self._cancelled(sender)

    @staticmethod
    def _cancelled(sender):
        err = pb_utils.TritonError("Request cancelled by client", getattr(pb_utils.TritonError, "CANCELLED", 0))
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=err),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            pass

    @staticmethod
    def _fail(sender, exc):
        msg = str(exc) if isinstance(exc, RequestError) else f"{type(exc).__name__}: {exc}"
        try:
            sender.send(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("text_output", np.array([b"N/A"], dtype=object))],
                error=pb_utils.TritonError(f"Error generating request: {msg}")),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            pass

    # --- responses ---------------------------------------------------------------------------------------------
    def _serve(self, job):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        p = job.params
        tokens = []
        times = {"first": 0, "last": 0}
        try:
            while True:
                ev = job.events.get()
                if ev.error is not None:
                    self._fail(job.sender, ev.error)
                    return
                if ev.token is not None:
                    now = time.monotonic_ns()
                    times["first"], times["last"] = times["first"] or now, now
                    if not (ev.finish_reason == self.decode_engine.FINISH_END and ev.token in p["request"].end_ids):
                        tokens.append(ev.token)
                reason, stop_reason = ev.finish_reason, None
                if reason == self.decode_engine.FINISH_END:
                    reason = "stop"
                elif reason == self.decode_engine.FINISH_STOP:
                    reason = "stop"
                    for text, ids in p["stop"]:
                        if tokens[-len(ids):] == ids:
                            stop_reason, tokens = text, tokens[:-len(ids)]
                            break
                done = reason is not None
                if reason == "cancelled" and (job.stopped == "client" or not p["streaming"]):
                    self._cancelled(job.sender)
                    return
                if p["streaming"]:
                    text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                    if ev.token is None and not done:
                        continue
                    if text.endswith("\ufffd") and not done:  # a multi-byte character still incomplete
                        continue
                elif done:
                    ids = tokens if p["exclude"] else list(job.prompt_ids) + tokens
                    text = self.tokenizer.decode(ids, skip_special_tokens=True)
                else:
                    continue
                job.sender.send(self._response(job, text, reason, stop_reason, len(tokens), times),
                                flags=final if done else 0)
                if done:
                    return
        except Exception as exc:
            job.cancel()
            self._fail(job.sender, exc)
        finally:
            with self.lock:
                self.jobs.discard(job)

    def _response(self, job, text, reason, stop_reason, generated, times):
        p = job.params

        def strings(*values):
            return np.array([str(v).encode("utf-8") for v in values], dtype=object)

        out = {"text_output": np.array([text.encode("utf-8")], dtype=object)}
        if p["finish_reason"]:
            out["finish_reason"] = strings(reason)
        if p["stop_reason"]:
            out["stop_reason"] = strings(stop_reason)
        if p["cum_logprob"]:
            out["cumulative_logprob"] = strings(None)
        if p["perf"]:
            per = self.tokens_per_block
            prompt_blocks = -(-len(job.prompt_ids) // per)
            held = -(-(len(job.prompt_ids) + generated) // per)
            scheduled = job.handle.admitted_ns - job.wall_offset_ns if job.handle.admitted_ns else 0
            out.update({
                "kv_cache_reused_block": strings(0), "kv_cache_missed_block": strings(prompt_blocks),
                "kv_cache_alloc_new_blocks": strings(held), "kv_cache_alloc_total_blocks": strings(held),
                "kv_cache_hit_rate": strings(0.0),
                "arrival_time_ns": strings(job.arrival_ns),
                "first_scheduled_time_ns": strings(scheduled),
                "first_token_time_ns": strings(times["first"]),
                "last_token_time_ns": strings(times["last"]),
                "acceptance_rate": strings(0.0), "total_accepted_draft_tokens": strings(0),
                "total_draft_tokens": strings(0),
            })
        tensors = [pb_utils.Tensor(k, v) for k, v in out.items() if k in self.outputs]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        self.running = False
        self.load.close()
        self.engine.close()
