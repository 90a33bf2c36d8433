"""Triton python model serving the pipeline's reference runtime behind TensorRT-LLM's tensor names.

Decoupled: each request runs in its own worker thread and streams one response per generated token when
``streaming`` is true (one response with every token otherwise), then an empty final response. Generation stops at
the request's ``end_id`` as well as at the model's own eos ids; ``pad_id`` is accepted and unused (one unpadded prompt
per request).
"""
import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _opt(request, name, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return default if t is None else t.as_numpy().reshape(-1)[0].item()


class TritonPythonModel:
    def initialize(self, args):
        import torch
        import reference_runtime as rt

        cfg = json.loads(args["model_config"])
        p = {k: v["string_value"] for k, v in cfg["parameters"].items()}
        engine = p["engine_dir"]
        if not os.path.isabs(engine):
            engine = os.path.normpath(os.path.join(args["model_repository"], "..", engine))
        if int(p.get("torch_threads", "0") or 0) > 0:
            torch.set_num_threads(int(p["torch_threads"]))
        self.rt = rt
        self.model = rt.load(engine, dtype=getattr(torch, p["dtype"]), device=p["device"])
        gen_cfg = getattr(self.model, "generation_config", None)
        eos = getattr(gen_cfg, "eos_token_id", None) or self.model.config.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        self.max_seq_len = int(p["max_seq_len"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        self.pool = ThreadPoolExecutor(max_workers=max(1, int(cfg.get("max_batch_size", 1) or 1)))
        self.lock = threading.Lock()

    def execute(self, requests):
        if not self.decoupled:
            return [self._complete(r) for r in requests]
        for request in requests:
            self.pool.submit(self._stream, request, request.get_response_sender())
        return None

    def _params(self, request):
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
        lengths = pb_utils.get_input_tensor_by_name(request, "input_lengths").as_numpy().reshape(-1)
        if ids.shape[0] != 1:
            raise ValueError(f"batch of {ids.shape[0]} in one request; send one prompt per request")
        prompt = ids[0, : int(lengths[0])].tolist()
        max_new = int(pb_utils.get_input_tensor_by_name(request, "request_output_len").as_numpy().reshape(-1)[0])
        max_new = max(0, min(max_new, self.max_seq_len - len(prompt)))
        kw = dict(temperature=float(_opt(request, "temperature", 0.0)), top_k=int(_opt(request, "runtime_top_k", 0)),
                  top_p=float(_opt(request, "runtime_top_p", 1.0)))
        end_id = _opt(request, "end_id", None)
        eos = self.eos if end_id is None else self.eos | {int(end_id)}
        return prompt, max_new, eos, bool(_opt(request, "streaming", False)), kw

    @staticmethod
    def _tensors(tokens):
        return [pb_utils.Tensor("output_ids", np.array([[tokens]], dtype=np.int32)),
                pb_utils.Tensor("sequence_length", np.array([[len(tokens)]], dtype=np.int32))]

    def _complete(self, request):
        try:
            prompt, max_new, eos, _, kw = self._params(request)
            tokens = list(self.rt.generate(self.model, prompt, max_new, eos, **kw))
            return pb_utils.InferenceResponse(output_tensors=self._tensors(tokens))
        except Exception as exc:  # reported to the client, the server keeps running
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}"))

    def _stream(self, request, sender):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            prompt, max_new, eos, streaming, kw = self._params(request)
            tokens = []
            for tok in self.rt.generate(self.model, prompt, max_new, eos, **kw):
                if streaming:
                    sender.send(pb_utils.InferenceResponse(output_tensors=self._tensors([tok])))
                else:
                    tokens.append(tok)
            if not streaming:
                sender.send(pb_utils.InferenceResponse(output_tensors=self._tensors(tokens)))
            sender.send(flags=final)
        except Exception as exc:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}")),
                        flags=final)

    def finalize(self):
        self.pool.shutdown(wait=True, cancel_futures=True)
