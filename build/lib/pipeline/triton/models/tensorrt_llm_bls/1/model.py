"""Triton python BLS model: preprocessing -> tensorrt_llm (streaming when asked) -> postprocessing, per request.

The tensorrt_llm model gets preprocessing's end/pad ids (the request's ``end_id``/``pad_id``, else the tokenizer's).
"""
import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


def _tensor(request, name):
    return pb_utils.get_input_tensor_by_name(request, name)


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.llm = cfg["parameters"]["tensorrt_llm_model_name"]["string_value"]

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._serve, args=(request, request.get_response_sender()), daemon=True).start()
        return None

    @staticmethod
    def _call(model, inputs, outputs, decoupled=False):
        req = pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs)
        return req.exec(decoupled=decoupled)

    def _serve(self, request, sender):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            pre_inputs = [pb_utils.Tensor("QUERY", _tensor(request, "text_input").as_numpy()),
                          pb_utils.Tensor("REQUEST_OUTPUT_LEN", _tensor(request, "max_tokens").as_numpy())]
            for src, dst in (("end_id", "END_ID"), ("pad_id", "PAD_ID")):
                t = _tensor(request, src)
                if t is not None:
                    pre_inputs.append(pb_utils.Tensor(dst, t.as_numpy()))
            pre = self._call("preprocessing", pre_inputs, ["INPUT_ID", "REQUEST_INPUT_LEN", "OUT_REQUEST_OUTPUT_LEN",
                                                           "OUT_END_ID", "OUT_PAD_ID"])
            if pre.has_error():
                raise RuntimeError(pre.error().message())
            get = lambda n: pb_utils.get_output_tensor_by_name(pre, n).as_numpy()  # noqa: E731
            stream = _tensor(request, "stream")
            streaming = bool(stream.as_numpy().reshape(-1)[0]) if stream is not None else False
            inputs = [pb_utils.Tensor("input_ids", get("INPUT_ID")),
                      pb_utils.Tensor("input_lengths", get("REQUEST_INPUT_LEN")),
                      pb_utils.Tensor("request_output_len", get("OUT_REQUEST_OUTPUT_LEN")),
                      pb_utils.Tensor("end_id", get("OUT_END_ID")),
                      pb_utils.Tensor("pad_id", get("OUT_PAD_ID")),
                      pb_utils.Tensor("streaming", np.array([[streaming]], dtype=bool))]
            for src, dst in (("temperature", "temperature"), ("top_k", "runtime_top_k"), ("top_p", "runtime_top_p")):
                t = _tensor(request, src)
                if t is not None:
                    inputs.append(pb_utils.Tensor(dst, t.as_numpy()))
            for resp in self._call(self.llm, inputs, ["output_ids", "sequence_length"], decoupled=True):
                if resp.has_error():
                    raise RuntimeError(resp.error().message())
                ids = pb_utils.get_output_tensor_by_name(resp, "output_ids")
                if ids is None:  # the empty final response of a decoupled model
                    continue
                post = self._call("postprocessing", [
                    pb_utils.Tensor("TOKENS_BATCH", ids.as_numpy()),
                    pb_utils.Tensor("SEQUENCE_LENGTH",
                                    pb_utils.get_output_tensor_by_name(resp, "sequence_length").as_numpy())],
                    ["OUTPUT"])
                if post.has_error():
                    raise RuntimeError(post.error().message())
                text = pb_utils.get_output_tensor_by_name(post, "OUTPUT").as_numpy().reshape(-1)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text.astype(object))]))
            sender.send(flags=final)
        except Exception as exc:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}")),
                        flags=final)
