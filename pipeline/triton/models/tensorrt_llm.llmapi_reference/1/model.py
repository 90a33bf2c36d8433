"""TensorRT-LLM's ``llmapi`` layout ``tensorrt_llm`` model computed by the reference runtime.

Same ``config.pbtxt`` and ``1/model.yaml`` as TensorRT-LLM's LLM-API model gets (TensorRT-LLM
triton_backend/all_models/llmapi/tensorrt_llm/1/model.py): ``auto_complete_config`` takes ``max_batch_size`` and the
transaction policy from model.yaml's ``triton_config``; the model reads the inputs and outputs the config declares.

- Requests: ``text_input`` holds one prompt (a 1-D tensor, as upstream's ``llmapi_client.py`` sends; a leading batch
  dimension of 1 is accepted too). ``streaming`` (decoupled only) sends one response per generated token, each with
  the text generated so far, as the LLM API's ``RequestOutput.outputs[0].text`` is; otherwise one response.
- ``sampling_param_*``: ``max_tokens`` (default 32, the LLM API's), ``temperature``, ``top_k``, ``top_p``,
  ``frequency_penalty``, ``presence_penalty``, ``seed``, ``stop`` (strings: generation stops when the text contains
  one, which is cut from the output), ``exclude_input_from_output`` (default false, as upstream's model: the prompt
  leads the text), ``return_perf_metrics``; ``best_of`` above 1 is refused.
- ``return_finish_reason`` / ``return_stop_reason`` / ``return_cumulative_logprob`` add ``finish_reason``
  (``stop`` / ``length`` / ``cancelled``), ``stop_reason`` (the stop string, or the end token id; ``None`` otherwise)
  and ``cumulative_logprob`` as strings, as upstream does.
- ``stop`` with the request id of running requests cancels them (answered with a CANCELLED error), and a client
  cancellation is honoured.
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
from reference_common import RequestError, Sender as _Sender, param as _param, watch_cancellation  # noqa: E402


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
        self.events = queue.Queue()
        self.handle = None
        self.stopped = False   # by a stop request or a client cancellation

    def cancel(self):
        self.stopped = True
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
        import reference_batching as batching
        import reference_runtime as rt
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
        dtype = _param(cfg, "dtype") or doc.get("dtype") or "bfloat16"
        if dtype == "auto":
            dtype = "bfloat16"
        device = _param(cfg, "device", "cpu")
        self.model = rt.load(path, dtype=getattr(torch, dtype), device=device)
        self.tokenizer = AutoTokenizer.from_pretrained(doc.get("tokenizer") or path)
        gen_cfg = getattr(self.model, "generation_config", None)
        eos = getattr(gen_cfg, "eos_token_id", None) or self.model.config.eos_token_id
        self.eos = frozenset(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        max_seq = _param(cfg, "max_seq_len") or doc.get("max_seq_len")
        self.batching = batching
        self.engine = batching.BatchEngine(self.model, max_batch_size=int(doc.get("max_batch_size") or 8),
                                           max_seq_len=int(max_seq) if max_seq else None)
        period = doc["triton_config"].get("cancellation_check_period_ms", 100)
        self.cancel_period_s = int(period) / 1000.0
        self.jobs = set()
        self.lock = threading.Lock()
        self.running = True
        threading.Thread(target=watch_cancellation, args=(self,), daemon=True).start()

    # --- requests ----------------------------------------------------------------------------------------------
    def execute(self, requests):
        now = time.time_ns()
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
        prompt_ids = self.tokenizer(texts[0])["input_ids"]
        top_k = _value(request, "sampling_param_top_k", 0) or 0
        top_p = _value(request, "sampling_param_top_p", 1.0)
        req = self.batching.GenerationRequest(
            input_ids=prompt_ids,
            max_new_tokens=int(_value(request, "sampling_param_max_tokens", 32)),
            end_ids=self.eos,
            temperature=float(_value(request, "sampling_param_temperature", 0.0) or 0.0),
            top_k=int(top_k),
            top_p=float(top_p) if top_p and top_p > 0 else 1.0,
            seed=int(_value(request, "sampling_param_seed", 0) or 0),
            presence_penalty=float(_value(request, "sampling_param_presence_penalty", 0.0) or 0.0),
            frequency_penalty=float(_value(request, "sampling_param_frequency_penalty", 0.0) or 0.0),
            return_log_probs=bool(_value(request, "return_cumulative_logprob", False)),
        )
        params = {
            "request": req, "streaming": streaming, "stop": [s for s in _strings(request, "sampling_param_stop") if s],
            "exclude": bool(_value(request, "sampling_param_exclude_input_from_output", False)),
            "perf": bool(_value(request, "sampling_param_return_perf_metrics", False)),
            "finish_reason": bool(_value(request, "return_finish_reason", False)),
            "stop_reason": bool(_value(request, "return_stop_reason", False)),
            "cum_logprob": bool(_value(request, "return_cumulative_logprob", False)),
        }
        return _Job(request, sender, user_id, prompt_ids, texts[0], params, now)

    def _stop(self, user_id, sender):
        if not user_id:
            self._fail(sender, RequestError("A request id must be provided for request cancellation"))
            return
        with self.lock:
            for job in self.jobs:
                if job.user_id == user_id:
                    job.cancel()
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
        tokens, cum = [], 0.0
        first_ns = last_ns = 0
        try:
            while True:
                ev = job.events.get()
                if ev.error is not None:
                    self._fail(job.sender, ev.error)
                    return
                if ev.token is not None:
                    now = time.time_ns()
                    first_ns, last_ns = first_ns or now, now
                    if ev.log_prob is not None:
                        cum += ev.log_prob
                    if not (ev.finish_reason == "end_id" and ev.token in job.params["request"].end_ids):
                        tokens.append(ev.token)
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                reason, stop_reason = ev.finish_reason, None
                if ev.finish_reason == "end_id":
                    reason, stop_reason = "stop", ev.token
                hit = next((s for s in p["stop"] if s in text), None)
                cut_short = hit is not None and reason is None
                if cut_short:
                    job.handle.cancel()  # generation stops here; the stop string is cut from the text
                    reason, stop_reason = "stop", hit
                if hit is not None:
                    text = text[:text.index(hit)]
                if reason == "cancelled" and job.stopped:
                    self._cancelled(job.sender)
                    return
                done = reason is not None
                if p["streaming"] and (ev.token is not None or done):
                    if text.endswith("\ufffd") and not done:  # a multi-byte character still incomplete
                        continue
                    job.sender.send(self._response(job, text, reason, stop_reason, cum, first_ns, last_ns),
                                    flags=final if done else 0)
                elif done:
                    job.sender.send(self._response(job, text, reason, stop_reason, cum, first_ns, last_ns),
                                    flags=final)
                if done:
                    if cut_short:
                        while job.events.get().finish_reason is None:  # drain the engine's cancellation event
                            pass
                    return
        except Exception as exc:
            job.cancel()
            self._fail(job.sender, exc)
        finally:
            with self.lock:
                self.jobs.discard(job)

    def _response(self, job, text, reason, stop_reason, cum, first_ns, last_ns):
        p = job.params
        if not p["exclude"]:
            text = job.prompt_text + text
        out = {"text_output": np.array([text.encode("utf-8")], dtype=object)}
        if p["finish_reason"]:
            out["finish_reason"] = np.array([str(reason).encode()], dtype=object)
        if p["stop_reason"]:
            out["stop_reason"] = np.array([str(stop_reason).encode()], dtype=object)
        if p["cum_logprob"]:
            out["cumulative_logprob"] = np.array([str(cum).encode()], dtype=object)
        if p["perf"]:
            zeros = np.zeros(1, np.int32)
            out.update({
                "kv_cache_reused_block": zeros, "kv_cache_missed_block": zeros, "kv_cache_alloc_new_blocks": zeros,
                "kv_cache_alloc_total_blocks": zeros, "kv_cache_hit_rate": np.zeros(1, np.float32),
                "arrival_time_ns": np.array([job.arrival_ns], np.int64),
                "first_scheduled_time_ns": np.array([job.handle.admitted_ns], np.int64),
                "first_token_time_ns": np.array([first_ns], np.int64),
                "last_token_time_ns": np.array([last_ns], np.int64),
                "acceptance_rate": np.zeros(1, np.float32), "total_accepted_draft_tokens": zeros,
                "total_draft_tokens": zeros,
            })
        tensors = [pb_utils.Tensor(k, v) for k, v in out.items() if k in self.outputs]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        self.running = False
        self.engine.close()
