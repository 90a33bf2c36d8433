"""What the reference runtime's two Triton python models (``tensorrt_llm.reference``, ``tensorrt_llm.llmapi_reference``)
share: the refusal error, the parameter reader, a path parameter's place in the repository, the thread-safe response
sender, the cancellation watcher and the load metrics (:class:`LoadMetrics`).

Triton's python backend imports this file on its own: the package stage copies it next to each reference
``model.py`` as ``reference_common.py``.
"""
import math
import os
import sys
import threading
import time

import triton_python_backend_utils as pb_utils


class RequestError(ValueError):
    """A request the reference refuses or cannot parse; its message goes to the client."""


def param(cfg, name, default=None):
    """A ``parameters`` string of the model config; ``default`` when absent, empty or an unfilled ``${...}``."""
    v = cfg.get("parameters", {}).get(name, {}).get("string_value")
    if v is None or v == "" or (v.startswith("${") and v.endswith("}")):
        return default
    return v


def repo_path(args, value):
    """A path parameter where it is here: relative -> under the repository root; absolute and present -> itself;
    absolute and absent (under the serving container's mount) -> the longest tail of it found in the repository."""
    root = os.path.normpath(os.path.join(args["model_repository"], ".."))
    if not os.path.isabs(value):
        return os.path.join(root, value)
    if os.path.exists(value):
        return value
    parts = value.strip("/").split("/")
    for i in range(len(parts)):
        cand = os.path.join(root, *parts[i:])
        if os.path.exists(cand):
            return cand
    return value


class Sender:
    """A request's response sender shared by threads: calls are serialized, and none reaches the server after the
    final response (the server frees the request then; even ``is_cancelled`` would touch freed memory)."""

    def __init__(self, sender):
        self._sender, self._lock, self.closed = sender, threading.Lock(), False

    def send(self, response=None, flags=0):
        with self._lock:
            if self.closed:
                return
            if flags & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                self.closed = True
            self._sender.send(response, flags=flags)

    def is_cancelled(self):
        with self._lock:
            return not self.closed and self._sender.is_cancelled()


def watch_cancellation(model):
    """Every ``model.cancel_period_s`` while ``model.running``: cancel each of ``model.jobs`` (under ``model.lock``)
    whose client cancelled it."""
    while model.running:
        time.sleep(model.cancel_period_s)
        with model.lock:
            jobs = list(model.jobs)
        for job in jobs:
            try:
                if job.sender.is_cancelled():
                    job.cancel()
            except Exception:
                pass


# TensorRT-LLM's default KV block (trtllm-build --tokens_per_block, KvCacheConfig.tokens_per_block)
TOKENS_PER_BLOCK = 32


class LoadMetrics:
    """The load metrics TensorRT-LLM's Triton backend reports, under its names and labels and with its meaning, read
    from the reference batching engine every ``period_s`` (a value is sent to the server only when it changed). The
    families and labels are the C++ backend's (TensorRT-LLM triton_backend/inflight_batcher_llm/src/
    custom_metrics_reporter/custom_metrics_reporter.cc @ 0d5352f5fc) with ``model`` and ``version`` labels; the
    values as its ``WaitForStats`` computes them (model_instance_state.cc @ c8c6df08bd); the python ``tensorrt_llm``
    model makes them with ``pb_utils.MetricFamily``, as here.

    - ``nv_trt_llm_request_metrics``: ``scheduled`` the sequences in the batch (those being prefilled included),
      ``context`` those being prefilled, ``waiting`` those queued for the batch, ``active`` scheduled + waiting,
      ``max`` the engine's batch size.
    - ``nv_trt_llm_kv_cache_block_metrics``: the reference holds each sequence's keys and values in one tensor of the
      batch, not in blocks; a block here is what a paged cache of ``tokens_per_block`` tokens would hold for it.
      ``used``: the blocks the batch's sequences fill (each sequence's prompt and output so far, rounded up to whole
      blocks); ``max``: ``max_batch_size`` sequences of ``max_seq_len`` tokens; ``free`` = max - used; ``reused`` 0
      (no prefix reuse); ``tokens_per``; ``fraction`` = used / max, what inference gateways balance on.
    - ``nv_trt_llm_general_metrics``: ``iteration_counter`` (forward passes) and ``timestamp`` (microseconds since
      the epoch, at the latest iteration seen).

    A server without metrics (``--allow-metrics=false``) takes the values and shows none.
    """

    def __init__(self, engine, model_name, version, tokens_per_block=TOKENS_PER_BLOCK, period_s=0.1):
        self.engine, self.period_s = engine, float(period_s)
        self.tokens_per = max(1, int(tokens_per_block))
        self.max_seqs = int(engine.max_batch_size)
        self.max_blocks = (self.max_seqs * math.ceil(engine.max_seq_len / self.tokens_per)
                           if engine.max_seq_len else None)
        self.last = {}
        self.running = True
        try:
            labels = {"model": str(model_name), "version": str(version)}
            kinds = {
                "nv_trt_llm_request_metrics": ("TRT LLM request metrics", "request_type",
                                               ("active", "max", "scheduled", "context", "waiting")),
                "nv_trt_llm_kv_cache_block_metrics": ("TRT LLM KV cache block metrics", "kv_cache_block_type",
                                                      ("max", "free", "used", "tokens_per", "reused", "fraction")),
                "nv_trt_llm_general_metrics": ("General TRT LLM metrics", "general_type",
                                               ("timestamp", "iteration_counter")),
            }
            self.metrics, self.families = {}, []  # a family must outlive its metrics: kept here
            for name, (text, key, values) in kinds.items():
                family = pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.GAUGE)
                self.families.append(family)
                for v in values:
                    self.metrics[(name, v)] = family.Metric(labels={key: v, **labels})
        except Exception as exc:  # a server without custom metrics: the model serves without them
            print(f"reference runtime: no load metrics ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
            self.metrics = {}
        if self.metrics:
            threading.Thread(target=self._loop, name="reference-load-metrics", daemon=True).start()

    def values(self):
        """The metrics' current values: {(family, label value): value}."""
        st = self.engine.stats()
        req, kv = "nv_trt_llm_request_metrics", "nv_trt_llm_kv_cache_block_metrics"
        out = {(req, "scheduled"): st["scheduled"], (req, "context"): st["context"], (req, "waiting"): st["waiting"],
               (req, "active"): st["scheduled"] + st["waiting"], (req, "max"): self.max_seqs,
               ("nv_trt_llm_general_metrics", "iteration_counter"): st["iterations"]}
        if self.max_blocks:
            used = sum(-(-n // self.tokens_per) for n in st["sequence_tokens"])
            out.update({(kv, "max"): self.max_blocks, (kv, "used"): used, (kv, "free"): self.max_blocks - used,
                        (kv, "tokens_per"): self.tokens_per, (kv, "reused"): 0,
                        (kv, "fraction"): used / self.max_blocks})
        return out

    def _loop(self):
        told = False
        while self.running:
            try:
                values = self.values()
                if values.get(("nv_trt_llm_general_metrics", "iteration_counter")) != \
                        self.last.get(("nv_trt_llm_general_metrics", "iteration_counter")):
                    values[("nv_trt_llm_general_metrics", "timestamp")] = time.time_ns() // 1000
                for key, value in values.items():
                    if key in self.metrics and self.last.get(key) != value:
                        self.metrics[key].set(float(value))
                        self.last[key] = value
            except Exception as exc:  # a metric that cannot be sent now (the server is stopping): try again
                if not told:  # said once, in the server's log
                    print(f"reference runtime: load metrics not updated ({type(exc).__name__}: {exc})",
                          file=sys.stderr, flush=True)
                    told = True
            time.sleep(self.period_s)

    def close(self):
        self.running = False
