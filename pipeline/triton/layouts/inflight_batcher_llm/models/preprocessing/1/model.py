"""Triton python model: text -> token ids with the checkpoint's tokenizer, behind upstream's ``preprocessing``
interface (TensorRT-LLM triton_backend all_models/inflight_batcher_llm/preprocessing).

Per request (each carries its own batch dimension):

- ``QUERY`` [batch, 1] -> ``INPUT_ID`` [batch, longest] (right-padded with the pad id) and ``REQUEST_INPUT_LEN``;
- ``DECODER_QUERY`` likewise -> ``DECODER_INPUT_ID``/``REQUEST_DECODER_INPUT_LEN`` (the pad id, length 1, without it);
- ``BAD_WORDS_DICT``/``STOP_WORDS_DICT`` [batch, N] strings -> ``BAD_WORDS_IDS``/``STOP_WORDS_IDS`` [batch, 2, width]:
  row 0 the words' token ids concatenated, row 1 the cumulative end offset of each word, padded with 0 and -1
  (TensorRT-LLM's word-list format); [batch, 2, 0] when absent;
- ``EMBEDDING_BIAS_WORDS``/``EMBEDDING_BIAS_WEIGHTS`` -> ``EMBEDDING_BIAS`` [batch, vocab] (each word's tokens get its
  weight added); [batch, 0] when absent;
- ``REQUEST_OUTPUT_LEN`` passes through; ``OUT_END_ID``/``OUT_PAD_ID`` are the request's ``END_ID``/``PAD_ID``, else
  the tokenizer's eos id, and its pad id falling back to eos; ``PROMPT_TABLE_EXTRA_ID`` -> ``OUT_PROMPT_TABLE_EXTRA_IDS``.

Parameters: ``tokenizer_dir`` (absolute under the serving container's mount, or relative to the repository root;
a container path that does not exist here is looked up in the repository), ``add_special_tokens`` (true unless one of
upstream's false words: false/0/f/n/no; absent, unfilled or any other value is true, as upstream reads it),
``multimodal_model_path`` (must be empty: no vision encoder here), ``max_input_len`` (optional limit).
"""
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

TRUE = ("true", "1", "t", "y", "yes")
FALSE = ("false", "0", "f", "n", "no")


def flag(value):
    """``add_special_tokens`` as upstream's preprocessing model reads it: one of its true or false words (any case),
    and true for anything else, an absent or unfilled parameter included."""
    v = (value or "").lower()
    return v in TRUE if v in TRUE + FALSE else True


def resolve(model_repository, path):
    """A path parameter as it exists here: relative -> under the repository root; absolute and present -> itself;
    absolute and absent (the serving container's mount) -> the longest tail of it found in the repository."""
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


def _param(cfg, key, default=None):
    v = cfg.get("parameters", {}).get(key)
    if v is None or v.get("string_value", "").startswith("${"):
        return default
    return v["string_value"]


def _opt(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _text(x):
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        cfg = json.loads(args["model_config"])
        if _param(cfg, "multimodal_model_path", ""):
            raise ValueError("multimodal_model_path is set, but this preprocessing model has no vision encoder; "
                             "leave it empty")
        path = resolve(args["model_repository"], _param(cfg, "tokenizer_dir"))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.add_special_tokens = flag(_param(cfg, "add_special_tokens"))
        limit = _param(cfg, "max_input_len", "")
        self.max_input_len = int(limit) if limit else None
        self.end_id = self.tokenizer.eos_token_id
        if self.end_id is None:
            raise ValueError(f"the tokenizer in {path} has no eos token; set eos_token in its tokenizer_config.json")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.end_id
        self.vocab = len(self.tokenizer)

    def _encode(self, rows):
        ids = [self.tokenizer.encode(_text(r.reshape(-1)[0]), add_special_tokens=self.add_special_tokens)
               for r in rows]
        width = max(1, max(len(i) for i in ids))
        batch = np.full((len(ids), width), self.pad_id, dtype=np.int32)
        for row, toks in enumerate(ids):
            batch[row, : len(toks)] = toks
        return batch, np.array([[len(i)] for i in ids], dtype=np.int32)

    def word_list(self, words, batch):
        """TensorRT-LLM's [batch, 2, width] stop/bad words format from [batch, N] strings."""
        if words is None:
            return np.empty((batch, 2, 0), dtype=np.int32)
        flat, offsets = [], []
        for row in words.reshape(batch, -1):
            ids, ends = [], []
            for w in row:
                toks = self.tokenizer.encode(_text(w), add_special_tokens=False)
                if toks:
                    ids += toks
                    ends.append(len(ids))
            flat.append(ids)
            offsets.append(ends)
        width = max(1, max(len(i) for i in flat))
        out = np.zeros((batch, 2, width), dtype=np.int32)
        out[:, 1, :] = -1
        for b, (ids, ends) in enumerate(zip(flat, offsets)):
            out[b, 0, : len(ids)] = ids
            out[b, 1, : len(ends)] = ends
        return out

    def embedding_bias(self, words, weights, batch):
        if words is None or weights is None:
            return np.empty((batch, 0), dtype=np.float32)
        out = np.zeros((batch, self.vocab), dtype=np.float32)
        for b, (ws, vs) in enumerate(zip(words.reshape(batch, -1), weights.reshape(batch, -1))):
            if len(ws) != len(vs):
                raise ValueError("EMBEDDING_BIAS_WORDS and EMBEDDING_BIAS_WEIGHTS differ in length")
            for w, v in zip(ws, vs):
                for tok in self.tokenizer.encode(_text(w), add_special_tokens=False):
                    out[b, tok] += float(v)
        return out

    def _ids(self, request, name, default, batch):
        t = _opt(request, name)
        if t is None:
            return np.full((batch, 1), default, dtype=np.int32)
        return t.astype(np.int32).reshape(batch, 1)

    def _one(self, request):
        query = _opt(request, "QUERY")
        batch = query.shape[0]
        input_id, input_len = self._encode(query)
        if self.max_input_len is not None and int(input_len.max()) > self.max_input_len:
            raise ValueError(f"prompt has {int(input_len.max())} tokens, more than max_input_len={self.max_input_len}")
        decoder = _opt(request, "DECODER_QUERY")
        pad = self._ids(request, "PAD_ID", self.pad_id, batch)
        if decoder is not None:
            dec_id, dec_len = self._encode(decoder)
        else:
            dec_id, dec_len = pad.copy(), np.ones((batch, 1), dtype=np.int32)
        out = [pb_utils.Tensor("INPUT_ID", input_id),
               pb_utils.Tensor("REQUEST_INPUT_LEN", input_len),
               pb_utils.Tensor("DECODER_INPUT_ID", dec_id),
               pb_utils.Tensor("REQUEST_DECODER_INPUT_LEN", dec_len),
               pb_utils.Tensor("REQUEST_OUTPUT_LEN", _opt(request, "REQUEST_OUTPUT_LEN").astype(np.int32)
                               .reshape(batch, -1)),
               pb_utils.Tensor("BAD_WORDS_IDS", self.word_list(_opt(request, "BAD_WORDS_DICT"), batch)),
               pb_utils.Tensor("STOP_WORDS_IDS", self.word_list(_opt(request, "STOP_WORDS_DICT"), batch)),
               pb_utils.Tensor("EMBEDDING_BIAS", self.embedding_bias(_opt(request, "EMBEDDING_BIAS_WORDS"),
                                                                     _opt(request, "EMBEDDING_BIAS_WEIGHTS"), batch)),
               pb_utils.Tensor("OUT_END_ID", self._ids(request, "END_ID", self.end_id, batch)),
               pb_utils.Tensor("OUT_PAD_ID", pad)]
        extra = _opt(request, "PROMPT_TABLE_EXTRA_ID")
        if extra is not None:
            ids = np.where(input_id >= self.vocab, extra.astype(np.uint64).reshape(batch, 1), 0).astype(np.uint64)
            out.append(pb_utils.Tensor("OUT_PROMPT_TABLE_EXTRA_IDS", ids))
        for name in ("IMAGE_BYTES", "IMAGE_URL", "IMAGES", "VIDEO_BYTES"):
            if _opt(request, name) is not None:
                raise ValueError(f"{name} given, but this deployment has no vision encoder")
        return pb_utils.InferenceResponse(output_tensors=out)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except Exception as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}")))
        return responses
