"""Triton python model serving TensorRT-LLM's LLM API (PyTorch backend) behind upstream's ``llmapi`` interface.

It answers as upstream's model does: NVIDIA/TensorRT-LLM ``triton_backend/all_models/llmapi/tensorrt_llm/1/model.py``
and its ``helpers.py`` @ 044a90d209 (the commit ``pipeline/upstream/trtllm-1.2.1.yaml`` records), written here from
reading them. The reference runtime's twin (``tensorrt_llm.llmapi_reference``) gives the same answers without
TensorRT-LLM.

- Configuration: ``1/model.yaml`` (or the file ``LLM_CONFIG_PATH`` names in this folder). Its ``triton_config``
  (``max_batch_size``, ``decoupled``, optional ``cancellation_check_period_ms``, 100 without it) completes
  config.pbtxt at load (``auto_complete_config``); every other key goes to ``tensorrt_llm.LLM(...)``, ``model`` as it
  is (an absolute path in the serving container), ``kv_cache_config`` / ``cuda_graph_config`` as ``KvCacheConfig`` /
  ``CudaGraphConfig``. The LLM is created, used and shut down on the model's own asyncio event loop.
- Instances: with an ``instance_group`` count above 1, the ``gpu_device_ids`` parameter ("0,1;2,3") gives instance
  *i* (the number its instance name ends with) the *i*-th list: it is ``CUDA_VISIBLE_DEVICES`` and
  ``TRTLLM_VISIBLE_DEVICES`` before ``tensorrt_llm`` is imported, and its length is ``gpus_per_node`` in the LLM
  arguments. Without the parameter, or with fewer lists than instances, the load fails.
- Requests: one prompt in a 1-D ``text_input`` (a 2-D one is refused); every other input holds one value. The
  ``sampling_param_*`` inputs a request carries become ``SamplingParams`` keywords (``best_of``, ``temperature``,
  ``top_k``, ``top_p``, ``frequency_penalty``, ``presence_penalty``, ``max_tokens``, ``seed``,
  ``exclude_input_from_output``, ``return_perf_metrics``, and ``stop`` as a list of strings where upstream hands
  over the numpy array); a missing one is left to the LLM API's default (``max_tokens`` included) except for
  helpers.py's three: ``best_of`` 1, ``return_perf_metrics`` False and ``exclude_input_from_output`` False, unlike
  the LLM API's True, so a single response holds the prompt before the generated text. ``streaming`` true on a model
  that is not decoupled fails with "Streaming is only supported in decoupled mode.".
- Guided decoding, this project's extension (``pipeline/upstream/trtllm-<line>.yaml`` ``extensions``; upstream's model
  takes no guide): a request's ``guided_decoding_guide_type`` and ``guided_decoding_guide`` become
  ``SamplingParams(guided_decoding=GuidedDecodingParams(...))`` (``tensorrt_llm/sampling_params.py``: ``json`` ->
  ``json_object=True``, ``json_schema`` -> ``json``, ``regex`` -> ``regex``, ``ebnf_grammar`` -> ``grammar``,
  ``structural_tag`` -> ``structural_tag``; :data:`GUIDE_FIELDS`, the record's ``guided_decoding.llm_api``), which
  the LLM applies with model.yaml's ``guided_decoding_backend``. An unknown guide type fails the request.
- Responses, through the response sender in both transaction policies: streaming, one per ``RequestOutput`` the LLM
  API yields, each with the *cumulative* text (``CompletionOutput.text``, never ``text_diff``: the front end's
  llmapi codec reads each response as the whole text so far), the finished one final; otherwise one final response
  from the last output. ``text_output`` has one string per ``CompletionOutput``; ``return_finish_reason`` /
  ``return_stop_reason`` / ``return_cumulative_logprob`` add ``str()`` of ``finish_reason`` / ``stop_reason`` /
  ``cumulative_logprob`` as STRING tensors. When the output carries ``request_perf_metrics``
  (``sampling_param_return_perf_metrics`` true) every response adds ``kv_cache_reused_block``,
  ``kv_cache_hit_rate``, ``kv_cache_alloc_new_blocks``, ``kv_cache_alloc_total_blocks``, ``kv_cache_missed_block``
  (``kv_cache_metrics``: ``num_reused_blocks``, ``kv_cache_hit_rate``, ``num_new_allocated_blocks``,
  ``num_total_allocated_blocks``, ``num_missed_blocks``), ``arrival_time_ns``, ``first_scheduled_time_ns``,
  ``first_token_time_ns``, ``last_token_time_ns`` (``timing_metrics``, in nanoseconds, as upstream's
  ``pandas.Timedelta(...).value``) and ``acceptance_rate``, ``total_accepted_draft_tokens``,
  ``total_draft_tokens`` (``speculative_decoding``), each a STRING tensor of the decimal value, as upstream builds
  them with text_output's type whatever config.pbtxt declares. A failed request gets "Error generating request:
  <reason>" with text_output "N/A".
- Stop: ``stop`` true aborts every running request with that request id (``abort()`` of its result) and answers the
  stop request with a CANCELLED error "Request cancelled by client", whether one ran or not; without a request id it
  fails with "A request id must be provided for request cancellation". An aborted streaming request ends with the
  LLM API's last output (its text so far, finish reason ``cancelled``). An aborted non-streaming request ends with
  the CANCELLED error: upstream sends it nothing, which leaves its client waiting and the request open; this model,
  as the reference twin, ends it. Each instance knows only its own requests, so with several instances a stop
  request stops what runs on the instance it reaches (as upstream's).
- Client cancellation: a thread checks every running request's ``is_cancelled()`` every
  ``cancellation_check_period_ms``, aborts a cancelled one and ends it with the CANCELLED error.
- Not taken from upstream: its MPI handling (clearing inherited MPI job variables, ranks other than 0 waiting on
  ``MPICommExecutor``, an ``MpiCommSession`` under mpirun) and ``update_llm_args_with_extra_dict``.

Exercised against a stand-in of the LLM API (``tests/helpers/trtllm_standin``) on the real Triton server bundled in
nvidia-pytriton (``tests/e2e/test_llmapi_model.py``), never against TensorRT-LLM itself, which needs NVIDIA's TRT-LLM
container and a GPU.
"""
import asyncio
import datetime
import json
import os
import queue
import re
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

# helpers.py get_sampling_params_from_request: the SamplingParams keywords read from sampling_param_<name>, and the
# values of the three it sets when a request lacks them
_SAMPLING = ("best_of", "temperature", "top_k", "top_p", "frequency_penalty", "presence_penalty", "max_tokens", "seed",
             "exclude_input_from_output", "return_perf_metrics")
_SAMPLING_DEFAULTS = {"best_of": 1, "exclude_input_from_output": False, "return_perf_metrics": False}
_OUTPUT_FLAGS = (("return_finish_reason", "finish_reason"), ("return_stop_reason", "stop_reason"),
                 ("return_cumulative_logprob", "cumulative_logprob"))
# guided_decoding_guide_type -> the GuidedDecodingParams field that carries the guide (the record's
# guided_decoding.llm_api.guide_fields; tests/unit/test_structured.py holds the two equal)
GUIDE_FIELDS = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar",
                "structural_tag": "structural_tag"}


class RequestError(ValueError):
    """A request this model refuses; its message goes to the client."""


def _model_yaml():
    path = os.path.join(HERE, os.environ.get("LLM_CONFIG_PATH", "model.yaml"))
    if not os.path.isfile(path):
        raise pb_utils.TritonModelException(f"{path} (the LLM options and triton_config) is missing")
    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    if "triton_config" not in doc:
        raise pb_utils.TritonModelException(f"{path} has no triton_config (max_batch_size, decoupled)")
    return doc


def _scalar(request, name):
    """The one value of an optional input (None without it), as a Python scalar."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    a = t.as_numpy()
    if a.size != 1:
        raise RequestError(f"Expected a scalar tensor for tensor {name}")
    return a.item(0)


def _text(request, name):
    value = _scalar(request, name)
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _guided(request):
    """The request's ``GuidedDecodingParams`` from its guide inputs (None without them)."""
    kind = _text(request, "guided_decoding_guide_type")
    if kind is None:
        return None
    if kind not in GUIDE_FIELDS:
        raise RequestError(f"unknown guided_decoding_guide_type {kind!r} (one of {', '.join(GUIDE_FIELDS)})")
    from tensorrt_llm.llmapi import GuidedDecodingParams

    field = GUIDE_FIELDS[kind]
    return GuidedDecodingParams(**{field: True if field == "json_object" else _text(request, "guided_decoding_guide")})


def _strings(values):
    return np.array([str(v).encode("utf-8") for v in values], dtype=object)


def _ns(value):
    """A duration in integer nanoseconds: a ``datetime.timedelta`` (what TensorRT-LLM's bindings give) exactly, as
    ``pandas.Timedelta(value).value``; a number is taken as nanoseconds already, as pandas takes it."""
    if isinstance(value, datetime.timedelta):
        return (value.days * 86400 + value.seconds) * 10**9 + value.microseconds * 1000
    if isinstance(value, np.timedelta64):
        return int(value.astype("timedelta64[ns]").astype(np.int64))
    return int(value)


def _perf_outputs(metrics):
    kv, timing, spec = metrics.kv_cache_metrics, metrics.timing_metrics, metrics.speculative_decoding
    return (("kv_cache_reused_block", kv.num_reused_blocks), ("kv_cache_hit_rate", kv.kv_cache_hit_rate),
            ("kv_cache_alloc_new_blocks", kv.num_new_allocated_blocks),
            ("kv_cache_alloc_total_blocks", kv.num_total_allocated_blocks),
            ("kv_cache_missed_block", kv.num_missed_blocks),
            ("arrival_time_ns", _ns(timing.arrival_time)),
            ("first_scheduled_time_ns", _ns(timing.first_scheduled_time)),
            ("first_token_time_ns", _ns(timing.first_token_time)),
            ("last_token_time_ns", _ns(timing.last_token_time)),
            ("acceptance_rate", spec.acceptance_rate),
            ("total_accepted_draft_tokens", spec.total_accepted_draft_tokens),
            ("total_draft_tokens", spec.total_draft_tokens))


def _cancelled():
    return pb_utils.InferenceResponse(error=pb_utils.TritonError("Request cancelled by client",
                                                                 pb_utils.TritonError.CANCELLED))


def _instance_gpus(cfg, instance_name):
    """This instance's GPU list from ``gpu_device_ids`` (None for a single instance)."""
    count = int((cfg.get("instance_group") or [{}])[0].get("count", 1))
    if count <= 1:
        return None
    ids = cfg.get("parameters", {}).get("gpu_device_ids", {}).get("string_value", "")
    if not ids or (ids.startswith("${") and ids.endswith("}")):
        raise ValueError("gpu_device_ids parameter required when instance count > 1")
    m = re.search(r"_(\d+)$", instance_name or "")
    index = int(m.group(1)) if m else 0
    lists = ids.split(";")
    if index >= len(lists):
        raise ValueError(f"gpu_device_ids mismatch: instance {index} >= {len(lists)} entries ('{ids}')")
    return lists[index].strip()


class _Sender:
    """A request's response sender shared by the event loop, the response thread and the cancellation thread: sends
    are serialized, and nothing reaches the server after the final response (Triton frees the request then, so even
    ``is_cancelled`` would touch freed memory)."""

    def __init__(self, request):
        self.request = request
        self._sender = request.get_response_sender()
        self._lock = threading.Lock()
        self.closed = False

    def send(self, response=None, flags=0):
        with self._lock:
            if self.closed:
                return
            if flags & FINAL:
                self.closed = True
            self._sender.send(response, flags=flags)

    def is_cancelled(self):
        with self._lock:
            return not self.closed and self.request.is_cancelled()


class _Job:
    """A running generation: its sender, its Triton request id, the LLM API's result, and how it was ended early
    (``stop``: a stop request; ``client``: a client cancellation)."""

    def __init__(self, sender, user_id):
        self.sender, self.user_id = sender, user_id
        self.result = None
        self.ended = None

    def abort(self, how):
        self.ended = self.ended or how
        self.result.abort()


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        tc = _model_yaml()["triton_config"]
        auto_complete_model_config.set_model_transaction_policy(dict(decoupled=bool(tc["decoupled"])))
        auto_complete_model_config.set_max_batch_size(int(tc["max_batch_size"]))
        return auto_complete_model_config

    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        doc = _model_yaml()
        tc = doc["triton_config"]
        self.decoupled = bool(tc["decoupled"])
        self.cancel_period_s = int(tc.get("cancellation_check_period_ms", 100)) / 1000.0
        options = {k: v for k, v in doc.items() if k != "triton_config"}
        gpus = _instance_gpus(cfg, args.get("model_instance_name"))
        if gpus is not None:
            # before tensorrt_llm (and torch, CUDA) is imported: its workers inherit them
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus
            os.environ["TRTLLM_VISIBLE_DEVICES"] = gpus
            options["gpus_per_node"] = len([g for g in gpus.split(",") if g.strip()])
        from tensorrt_llm import LLM
        from tensorrt_llm.llmapi import CudaGraphConfig, KvCacheConfig

        if "kv_cache_config" in options:
            options["kv_cache_config"] = KvCacheConfig(**options["kv_cache_config"])
        if "cuda_graph_config" in options:
            options["cuda_graph_config"] = CudaGraphConfig(**options["cuda_graph_config"])

        self.jobs = set()
        self.lock = threading.Lock()
        self.ongoing = 0  # requests started and not yet ended (touched on the event loop only)
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.loop_thread.start()

        async def create():
            return await asyncio.get_running_loop().run_in_executor(None, lambda: LLM(**options))

        try:
            self.llm = asyncio.run_coroutine_threadsafe(create(), self.loop).result()
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise
        # responses are sent from a thread of their own, so that the LLM API's loop keeps going meanwhile
        self.replies = queue.Queue()
        self.reply_thread = threading.Thread(target=self._send_replies, daemon=True)
        self.reply_thread.start()
        self.running = True
        self.watch_thread = threading.Thread(target=self._watch_cancellation, daemon=True)
        self.watch_thread.start()

    # --- requests ----------------------------------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._serve(request), self.loop)
        return None

    def _convert(self, request):
        t = pb_utils.get_input_tensor_by_name(request, "text_input")
        if t is None:
            raise RequestError("text_input is missing from the request")
        texts = t.as_numpy()
        if texts.ndim > 1:
            raise RequestError("The current implementation only supports text_input being a 1D tensor.")
        if texts.size == 0:
            raise RequestError("text_input is empty")
        prompt = texts[0]
        prompt = prompt.decode("utf-8") if isinstance(prompt, bytes) else str(prompt)
        sampling = {}
        for name in _SAMPLING:
            value = _scalar(request, f"sampling_param_{name}")
            if value is None:
                value = _SAMPLING_DEFAULTS.get(name)
            if value is not None:
                sampling[name] = value
        stop = pb_utils.get_input_tensor_by_name(request, "sampling_param_stop")
        if stop is not None:
            sampling["stop"] = [s.decode("utf-8") if isinstance(s, bytes) else str(s)
                                for s in stop.as_numpy().reshape(-1)]
        guide = _guided(request)
        if guide is not None:
            sampling["guided_decoding"] = guide
        wanted = {flag: bool(_scalar(request, flag) or False) for flag, _ in _OUTPUT_FLAGS}
        streaming = bool(_scalar(request, "streaming") or False)
        return prompt, sampling, streaming, wanted

    async def _serve(self, request):
        from tensorrt_llm import SamplingParams

        sender = _Sender(request)
        user_id = request.request_id()
        self.ongoing += 1
        job = None
        try:
            if _scalar(request, "stop"):
                self._stop(user_id, sender)
                return
            prompt, sampling, streaming, wanted = self._convert(request)
            if streaming and not self.decoupled:
                raise RequestError("Streaming is only supported in decoupled mode.")
            job = _Job(sender, user_id)
            job.result = self.llm.generate_async(prompt, SamplingParams(**sampling), streaming=streaming)
            with self.lock:
                self.jobs.add(job)
            out = None
            async for out in job.result:
                if streaming:
                    self._post(sender, self._response(out, wanted), FINAL if out.finished else 0)
            if streaming:
                if out is None or not out.finished:
                    self._post(sender, None, FINAL)
            elif job.ended is not None:
                self._post(sender, _cancelled(), FINAL)
            else:
                self._post(sender, self._response(out, wanted), FINAL)
        except Exception as exc:
            msg = str(exc) if isinstance(exc, (RequestError, pb_utils.TritonModelException)) else \
                f"{type(exc).__name__}: {exc}"
            self._post(sender, pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("text_output", np.array([b"N/A"], dtype=object))],
                error=pb_utils.TritonError(f"Error generating request: {msg}")), FINAL)
        finally:
            self.ongoing -= 1
            if job is not None:
                with self.lock:
                    self.jobs.discard(job)

    def _stop(self, user_id, sender):
        """Upstream's ``handle_stop_request``: abort every running request with ``user_id``; the stop request itself
        is answered CANCELLED."""
        if not user_id:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                "A request id must be provided for request cancellation")), FINAL)
            return
        with self.lock:
            for job in self.jobs:
                if job.user_id == user_id and job.ended is None:
                    job.abort("stop")
        sender.send(_cancelled(), FINAL)

    def _watch_cancellation(self):
        """Upstream's ``cancellation_loop``: a request its client cancelled is aborted and ended CANCELLED."""
        while self.running:
            time.sleep(self.cancel_period_s)
            with self.lock:
                jobs = [j for j in self.jobs if j.ended is None]
            for job in jobs:
                try:
                    if job.sender.is_cancelled():
                        job.abort("client")
                        job.sender.send(_cancelled(), FINAL)
                except Exception as exc:
                    pb_utils.Logger.log_error(f"[trtllm] cancelling a request failed: {exc}")
            jobs = job = None  # no request is kept alive here until the next round

    # --- responses ---------------------------------------------------------------------------------------------
    def _post(self, sender, response, flags):
        self.replies.put((sender, response, flags))

    def _send_replies(self):
        while True:
            item = self.replies.get()
            if item is None:
                return
            sender, response, flags = item
            try:
                sender.send(response, flags)
            except Exception as exc:
                pb_utils.Logger.log_error(f"[trtllm] sending a response failed: {exc}")
            item = sender = response = None  # nor here until the next response

    def _response(self, out, wanted):
        seqs = out.outputs
        tensors = [pb_utils.Tensor("text_output", _strings(s.text for s in seqs))]
        for flag, name in _OUTPUT_FLAGS:
            if wanted[flag]:
                tensors.append(pb_utils.Tensor(name, _strings(getattr(s, name) for s in seqs)))
        metrics = getattr(seqs[0], "request_perf_metrics", None)
        if metrics:
            tensors += [pb_utils.Tensor(name, _strings([value])) for name, value in _perf_outputs(metrics)]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        """As upstream's engine loop ends: the requests still running finish, then the LLM shuts down."""
        self.running = False
        pb_utils.Logger.log_info(f"[trtllm] finalize: waiting for {self.ongoing} running requests")

        async def shutdown():
            while self.ongoing > 0:
                await asyncio.sleep(0.1)
            await asyncio.get_running_loop().run_in_executor(None, self.llm.shutdown)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.replies.put(None)
            self.reply_thread.join(10)
            self.watch_thread.join(10)
