"""Triton python model: text -> token ids with the checkpoint's tokenizer (TensorRT-LLM preprocessing tensor names).

Also emits the ids the tensorrt_llm model stops and pads with: ``OUT_END_ID`` is the request's ``END_ID``, else the
tokenizer's eos id; ``OUT_PAD_ID`` is the request's ``PAD_ID``, else the tokenizer's pad id, else its eos id.
"""
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


def _param(cfg, key):
    return cfg["parameters"][key]["string_value"]


def _resolve(repo_model_dir, path):
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(repo_model_dir, "..", path))


def _ids(request, name, default, rows):
    """The request's optional per-row id input, else ``default`` for every row: int32 [rows, 1]."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return np.full((rows, 1), default, dtype=np.int32)
    return t.as_numpy().astype(np.int32).reshape(rows, 1)


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        cfg = json.loads(args["model_config"])
        path = _resolve(args["model_repository"], _param(cfg, "tokenizer_dir"))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.max_input_len = int(_param(cfg, "max_input_len"))
        self.end_id = self.tokenizer.eos_token_id
        if self.end_id is None:
            raise ValueError(f"the tokenizer in {path} has no eos token; set eos_token in its tokenizer_config.json")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.end_id

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
                pb_utils.Tensor("OUT_END_ID", _ids(request, "END_ID", self.end_id, len(ids))),
                pb_utils.Tensor("OUT_PAD_ID", _ids(request, "PAD_ID", self.pad_id, len(ids))),
            ]))
        return responses
