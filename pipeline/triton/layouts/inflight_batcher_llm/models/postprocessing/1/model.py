"""Triton python model: token ids -> text, behind upstream's ``postprocessing`` interface (TensorRT-LLM
triton_backend all_models/inflight_batcher_llm/postprocessing).

``TOKENS_BATCH`` [batch, beams, seq] and ``SEQUENCE_LENGTH`` [batch, beams] -> ``OUTPUT``: one string per batch row
and beam, flat ([batch * beams]), each the first ``SEQUENCE_LENGTH`` tokens decoded. Parameters: ``tokenizer_dir``
(resolved like preprocessing's) and ``skip_special_tokens`` (default true).
"""
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

TRUE = ("true", "1", "t", "y", "yes")


def _resolve(model_repository, path):
    root = os.path.normpath(os.path.join(model_repository, ".."))
    if not os.path.isabs(path):
        return os.path.normpath(os.path.join(root, path))
    if os.path.exists(path):
        return path
    parts = os.path.normpath(path).strip(os.sep).split(os.sep)
    for i in range(len(parts)):
        cand = os.path.join(root, *parts[i:])
        if os.path.exists(cand):
            return cand
    return path


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        self.tokenizer = AutoTokenizer.from_pretrained(_resolve(args["model_repository"], params["tokenizer_dir"]))
        skip = params.get("skip_special_tokens", "true")
        self.skip_special_tokens = True if skip.startswith("${") else skip.lower() in TRUE

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
                lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
                if tokens.ndim == 2:  # [batch, seq]: one beam
                    tokens = tokens[:, None, :]
                lengths = lengths.reshape(tokens.shape[0], tokens.shape[1])
                seqs = [tokens[b, k, : int(lengths[b, k])].tolist()
                        for b in range(tokens.shape[0]) for k in range(tokens.shape[1])]
                texts = self.tokenizer.batch_decode(seqs, skip_special_tokens=self.skip_special_tokens)
                out = np.array([t.encode("utf-8") for t in texts], dtype=object)
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out)]))
            except Exception as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}")))
        return responses
