"""What the reference runtime's two Triton python models (``tensorrt_llm.reference``, ``tensorrt_llm.llmapi_reference``)
share: the refusal error, the parameter reader, a path parameter's place in the repository, the thread-safe response
sender and the cancellation watcher.

Triton's python backend imports this file on its own: the package stage copies it next to each reference
``model.py`` as ``reference_common.py``.
"""
import os
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
