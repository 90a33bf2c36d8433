"""The toy layout's model: the reference runtime (copied beside this file by the package stage) behind its own
tensors. Decoupled: one response per new piece of text (``completion``), then the final flag; unary: one response
with the whole text."""
import json
import os
import queue
import sys
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from reference_common import param  # noqa: E402


def _value(request, name, default=None):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None or t.as_numpy().size == 0:
        return default
    v = t.as_numpy().reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else v.item()


class TritonPythonModel:
    def initialize(self, args):
        import torch
        import reference_decode_engine as decode_engine
        import reference_runtime as rt
        from transformers import AutoTokenizer

        cfg = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)
        path = os.path.normpath(os.path.join(args["model_repository"], "..", param(cfg, "checkpoint_dir")))
        threads = int(param(cfg, "torch_threads", "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        device = param(cfg, "device", "cpu")
        self.model = rt.load(path, dtype=rt.compute_dtype(param(cfg, "dtype", "auto"), device), device=device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        eos = self.model.config.eos_token_id
        self.eos = frozenset(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        self.decode_engine = decode_engine
        max_seq = param(cfg, "max_seq_len")
        self.engine = decode_engine.BatchEngine(self.model, max_batch_size=4, max_seq_len=int(max_seq) if max_seq else None)

    def execute(self, requests):
        if not self.decoupled:
            return [self._whole(r) for r in requests]
        for r in requests:
            threading.Thread(target=self._stream, args=(r, r.get_response_sender()), daemon=True).start()
        return None

    def _events(self, request):
        ids = self.tokenizer(_value(request, "prompt", ""))["input_ids"]
        temperature = float(_value(request, "temperature", 0.0))
        req = self.decode_engine.GenerationRequest(input_ids=ids, max_new_tokens=int(_value(request, "max_new_tokens", 16)),
                                              end_ids=self.eos, temperature=temperature)
        events = queue.Queue()
        self.engine.submit(req, on_event=events.put)
        tokens = []
        while True:
            ev = events.get()
            if ev.error is not None:
                raise ev.error
            if ev.token is not None and ev.token not in self.eos:
                tokens.append(ev.token)
            yield tokens, ev.finish_reason is not None
            if ev.finish_reason is not None:
                return

    @staticmethod
    def _response(text):
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("completion", np.array([text.encode("utf-8")], dtype=object))])

    def _whole(self, request):
        try:
            tokens = []
            for tokens, _ in self._events(request):
                pass
            return self._response(self.tokenizer.decode(tokens, skip_special_tokens=True))
        except Exception as exc:
            return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"internal error: {exc}"))

    def _stream(self, request, sender):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        sent = ""
        try:
            for tokens, done in self._events(request):
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                if text.endswith("\ufffd") and not done:  # a character still incomplete
                    continue
                if len(text) > len(sent):
                    sender.send(self._response(text[len(sent):]))
                    sent = text
            sender.send(flags=final)
        except Exception as exc:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                f"internal error: {exc}")), flags=final)

    def finalize(self):
        self.engine.close()
