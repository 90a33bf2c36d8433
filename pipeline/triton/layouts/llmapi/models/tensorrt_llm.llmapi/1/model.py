"""Triton python model serving TensorRT-LLM's LLM API (PyTorch backend) behind upstream's ``llmapi`` interface
(TensorRT-LLM triton_backend all_models/llmapi/tensorrt_llm).

``1/model.yaml`` drives it as upstream's: ``triton_config`` (``max_batch_size``, ``decoupled``) completes
config.pbtxt at load (``auto_complete_config``); every other key goes to ``tensorrt_llm.LLM(...)``, ``model`` as it
is (an absolute path in the serving container). Requests carry 1-D tensors (``max_batch_size`` 0): ``text_input``,
``streaming``, ``sampling_param_*`` (``max_tokens``, ``temperature``, ``top_k``, ``top_p``, penalties, ``stop``,
``seed``, ``exclude_input_from_output``, ``best_of``), ``return_finish_reason``/``return_stop_reason``/
``return_cumulative_logprob``. With N instances, ``gpu_device_ids`` ("0,1;2,3") gives each its GPUs.
Needs NVIDIA's TRT-LLM container and a GPU.
"""
import asyncio
import json
import os
import re
import threading

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))


def _model_yaml():
    with open(os.path.join(HERE, "model.yaml")) as f:
        return yaml.safe_load(f) or {}


def _opt(request, name, default=None):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    return t.as_numpy().reshape(-1)[0].item()


def _strings(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    return [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in t.as_numpy().reshape(-1)]


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
        self.decoupled = bool(doc["triton_config"]["decoupled"])
        count = int((cfg.get("instance_group") or [{}])[0].get("count", 1))
        if count > 1:
            groups = cfg["parameters"]["gpu_device_ids"]["string_value"].split(";")
            m = re.search(r"_(\d+)$", args.get("model_instance_name", ""))
            gpus = groups[int(m.group(1)) if m else 0].strip()
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus
            os.environ["TRTLLM_VISIBLE_DEVICES"] = gpus
        from tensorrt_llm import LLM
        from tensorrt_llm.llmapi import CudaGraphConfig, KvCacheConfig

        options = {k: v for k, v in doc.items() if k != "triton_config"}
        if "kv_cache_config" in options:
            options["kv_cache_config"] = KvCacheConfig(**options["kv_cache_config"])
        if "cuda_graph_config" in options:
            options["cuda_graph_config"] = CudaGraphConfig(**options["cuda_graph_config"])
        self.llm = LLM(**options)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def execute(self, requests):
        if not self.decoupled:
            futures = [asyncio.run_coroutine_threadsafe(self._collect(r), self.loop) for r in requests]
            return [f.result() for f in futures]
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._stream(request, request.get_response_sender()), self.loop)
        return None

    def _sampling(self, request):
        from tensorrt_llm import SamplingParams

        kw = {"max_tokens": _opt(request, "sampling_param_max_tokens"),
              "temperature": _opt(request, "sampling_param_temperature"),
              "top_k": _opt(request, "sampling_param_top_k"), "top_p": _opt(request, "sampling_param_top_p"),
              "frequency_penalty": _opt(request, "sampling_param_frequency_penalty"),
              "presence_penalty": _opt(request, "sampling_param_presence_penalty"),
              "seed": _opt(request, "sampling_param_seed"), "best_of": _opt(request, "sampling_param_best_of"),
              "stop": _strings(request, "sampling_param_stop"),
              "exclude_input_from_output": _opt(request, "sampling_param_exclude_input_from_output")}
        return SamplingParams(**{k: v for k, v in kw.items() if v is not None})

    def _response(self, request, out, text):
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object))]
        first = out.outputs[0]
        if _opt(request, "return_finish_reason", False):
            tensors.append(pb_utils.Tensor("finish_reason", np.array([str(first.finish_reason).encode()],
                                                                     dtype=object)))
        if _opt(request, "return_stop_reason", False):
            tensors.append(pb_utils.Tensor("stop_reason", np.array([str(first.stop_reason).encode()], dtype=object)))
        if _opt(request, "return_cumulative_logprob", False):
            # str() of the LLM API's value, as upstream's model sends it (a string tensor; it never asks for log
            # probs, so the value is None): the same as the reference runtime's llmapi model
            tensors.append(pb_utils.Tensor("cumulative_logprob",
                                           np.array([str(first.cumulative_logprob).encode()], dtype=object)))
        return pb_utils.InferenceResponse(tensors)

    def _text(self, request):
        texts = _strings(request, "text_input")
        if not texts:
            raise ValueError("text_input is empty")
        return texts[0]

    async def _collect(self, request):
        try:
            if _opt(request, "streaming", False):
                raise ValueError("streaming needs decoupled mode (model.yaml triton_config.decoupled: true)")
            out = await self.llm.generate_async(self._text(request), self._sampling(request))
            return self._response(request, out, out.outputs[0].text)
        except Exception as exc:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}"))

    async def _stream(self, request, sender):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            streaming = bool(_opt(request, "streaming", False))
            sent, out = 0, None
            async for out in self.llm.generate_async(self._text(request), self._sampling(request),
                                                     streaming=streaming):
                piece = out.outputs[0].text[sent:]
                sent += len(piece)
                if streaming and piece:
                    sender.send(self._response(request, out, piece))
            if not streaming and out is not None:
                sender.send(self._response(request, out, out.outputs[0].text))
            sender.send(flags=final)
        except Exception as exc:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}")),
                        flags=final)

    def finalize(self):
        self.llm.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
