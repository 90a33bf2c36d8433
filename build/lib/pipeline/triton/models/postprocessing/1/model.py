"""Triton python model: token ids -> text (TensorRT-LLM postprocessing tensor names). Streams decode per response."""
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


def _resolve(repo_model_dir, path):
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(repo_model_dir, "..", path))


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        cfg = json.loads(args["model_config"])
        path = cfg["parameters"]["tokenizer_dir"]["string_value"]
        self.tokenizer = AutoTokenizer.from_pretrained(_resolve(args["model_repository"], path))

    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()  # [batch, beam, seq]
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()  # [batch, beam]
            out = []
            for b in range(tokens.shape[0]):
                for beam in range(tokens.shape[1]):
                    ids = tokens[b, beam, : int(lengths[b, beam])].tolist()
                    out.append(self.tokenizer.decode(ids, skip_special_tokens=True).encode("utf-8"))
            arr = np.array(out, dtype=object).reshape(tokens.shape[0], tokens.shape[1])
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", arr)]))
        return responses
