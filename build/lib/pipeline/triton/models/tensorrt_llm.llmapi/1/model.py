"""Triton python model serving TensorRT-LLM's LLM API (PyTorch backend) from 1/model.yaml (`llmapi` layout).

Every key of model.yaml except ``triton_config`` goes to ``tensorrt_llm.LLM(...)``; ``model`` is the checkpoint
directory, relative to this file's folder unless absolute. Needs NVIDIA's TRT-LLM container and a GPU.
"""
import asyncio
import os
import threading

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml


def _opt(request, name, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return default if t is None else t.as_numpy().reshape(-1)[0].item()


class TritonPythonModel:
    def initialize(self, args):
        from tensorrt_llm import LLM
        from tensorrt_llm.llmapi import CudaGraphConfig, KvCacheConfig

        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "model.yaml")) as f:
            cfg = yaml.safe_load(f)
        cfg.pop("triton_config", None)
        if not os.path.isabs(cfg["model"]):
            cfg["model"] = os.path.join(here, cfg["model"])
        cfg["kv_cache_config"] = KvCacheConfig(**cfg.get("kv_cache_config", {}))
        cfg["cuda_graph_config"] = CudaGraphConfig(**cfg.get("cuda_graph_config", {}))
        self.llm = LLM(**cfg)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def execute(self, requests):
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._serve(request, request.get_response_sender()), self.loop)
        return None

    async def _serve(self, request, sender):
        from tensorrt_llm import SamplingParams

        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
            params = SamplingParams(max_tokens=int(_opt(request, "sampling_param_max_tokens", 64)),
                                    temperature=float(_opt(request, "sampling_param_temperature", 0.0)),
                                    top_k=int(_opt(request, "sampling_param_top_k", 0)) or None,
                                    top_p=float(_opt(request, "sampling_param_top_p", 1.0)))
            streaming = bool(_opt(request, "streaming", False))
            sent = 0
            async for out in self.llm.generate_async(text, params, streaming=streaming):
                piece = out.outputs[0].text[sent:]
                sent += len(piece)
                if streaming and piece:
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(
                        "text_output", np.array([piece.encode("utf-8")], dtype=object))]))
            if not streaming:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(
                    "text_output", np.array([out.outputs[0].text.encode("utf-8")], dtype=object))]))
            sender.send(flags=final)
        except Exception as exc:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}")),
                        flags=final)

    def finalize(self):
        self.llm.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
