"""Triton python model: text -> token ids with the checkpoint's tokenizer (TensorRT-LLM preprocessing tensor names)."""
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


def _param(cfg, key):
    return cfg["parameters"][key]["string_value"]


def _resolve(repo_model_dir, path):
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(repo_model_dir, "..", path))


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        cfg = json.loads(args["model_config"])
        self.tokenizer = AutoTokenizer.from_pretrained(_resolve(args["model_repository"], _param(cfg, "tokenizer_dir")))
        self.max_input_len = int(_param(cfg, "max_input_len"))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def execute(self, requests):
        responses = []
        for request in requests:
            query = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy()
            out_len = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN").as_numpy()
            texts = [q.decode("utf-8") if isinstance(q, bytes) else str(q) for q in query.reshape(-1)]
            ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            too_long = [len(i) for i in ids if len(i) > self.max_input_len]
            if too_long:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"prompt has {too_long[0]} tokens, more than max_input_len={self.max_input_len}")))
                continue
            width = max(1, max(len(i) for i in ids))
            batch = np.full((len(ids), width), self.pad_id, dtype=np.int32)
            for row, toks in enumerate(ids):
                batch[row, : len(toks)] = toks
            lengths = np.array([[len(i)] for i in ids], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("INPUT_ID", batch),
                pb_utils.Tensor("REQUEST_INPUT_LEN", lengths),
                pb_utils.Tensor("OUT_REQUEST_OUTPUT_LEN", out_len.astype(np.int32).reshape(len(ids), 1)),
            ]))
        return responses
