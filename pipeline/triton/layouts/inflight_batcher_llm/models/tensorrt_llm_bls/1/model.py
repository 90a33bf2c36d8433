"""Triton python BLS model behind upstream's ``tensorrt_llm_bls`` interface (TensorRT-LLM triton_backend
all_models/inflight_batcher_llm/tensorrt_llm_bls): preprocessing -> tensorrt_llm -> postprocessing, per request.

The request's tensors go where upstream's BLS sends them (``text_input`` -> ``QUERY``, ``max_tokens`` ->
``REQUEST_OUTPUT_LEN``, ``stop_words``/``bad_words`` -> the word dicts, ``top_k`` -> ``runtime_top_k``,
``length_penalty`` -> ``len_penalty``, ``stream`` -> ``streaming``, the rest by name), and every output the
``tensorrt_llm`` model returns besides the token ids (log probs, logits, ``batch_index``, ``sequence_index``, KV-cache
and timing statistics, token counts) comes back under the same name next to ``text_output``.

Decoupled (``model_transaction_policy``): each request runs in a thread and streams one response per
``tensorrt_llm`` response (``accumulate_tokens``: each carries the text of every token so far). Not decoupled: one
response per request; ``stream=true`` is refused, as upstream.
"""
import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

TRUE = ("true", "1", "t", "y", "yes")
TO_PRE = {"text_input": "QUERY", "decoder_text_input": "DECODER_QUERY", "max_tokens": "REQUEST_OUTPUT_LEN",
          "bad_words": "BAD_WORDS_DICT", "stop_words": "STOP_WORDS_DICT",
          "embedding_bias_words": "EMBEDDING_BIAS_WORDS", "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS",
          "end_id": "END_ID", "pad_id": "PAD_ID", "prompt_table_extra_id": "PROMPT_TABLE_EXTRA_ID"}
PRE_OUT = ("INPUT_ID", "REQUEST_INPUT_LEN", "DECODER_INPUT_ID", "REQUEST_DECODER_INPUT_LEN", "REQUEST_OUTPUT_LEN",
           "BAD_WORDS_IDS", "STOP_WORDS_IDS", "EMBEDDING_BIAS", "OUT_END_ID", "OUT_PAD_ID")
TO_LLM = {"beam_width": "beam_width", "temperature": "temperature", "top_k": "runtime_top_k",
          "top_p": "runtime_top_p", "length_penalty": "len_penalty", "repetition_penalty": "repetition_penalty",
          "min_tokens": "min_tokens", "presence_penalty": "presence_penalty",
          "frequency_penalty": "frequency_penalty", "seed": "seed", "return_log_probs": "return_log_probs",
          "return_context_logits": "return_context_logits", "return_generation_logits": "return_generation_logits",
          "return_perf_metrics": "return_perf_metrics", "return_num_input_tokens": "return_num_input_tokens",
          "return_num_output_tokens": "return_num_output_tokens", "exclude_input_in_output": "exclude_input_in_output",
          "num_return_sequences": "num_return_sequences", "prompt_embedding_table": "prompt_embedding_table",
          "prompt_vocab_size": "prompt_vocab_size", "lora_task_id": "lora_task_id", "lora_weights": "lora_weights",
          "lora_config": "lora_config", "guided_decoding_guide_type": "guided_decoding_guide_type",
          "guided_decoding_guide": "guided_decoding_guide"}
PASS_THROUGH = ("cum_log_probs", "output_log_probs", "context_logits", "generation_logits", "batch_index",
                "sequence_index", "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks",
                "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
                "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "num_input_tokens",
                "num_output_tokens")
UNSUPPORTED = ("image_input", "image_bytes_input", "image_url_input", "video_bytes_input", "num_draft_tokens",
               "use_draft_logits")


def _get(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _call(model, inputs, outputs, decoupled=False, request_id=""):
    return pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=list(outputs),
                                     request_id=request_id or "").exec(decoupled=decoupled)


def _check(resp):
    if resp.has_error():
        raise RuntimeError(resp.error().message())
    return resp


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        name = params.get("tensorrt_llm_model_name", "") or "tensorrt_llm"
        self.llm = "tensorrt_llm" if name.startswith("${") else name
        self.accumulate = params.get("accumulate_tokens", "false").lower() in TRUE
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(cfg)

    def execute(self, requests):
        if not self.decoupled:
            out = []
            for request in requests:
                try:
                    responses = list(self._generate(request, streaming_allowed=False))
                    out.append(responses[-1] if responses else pb_utils.InferenceResponse(
                        error=pb_utils.TritonError("tensorrt_llm returned no response")))
                except Exception as exc:
                    out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}")))
            return out
        for request in requests:
            threading.Thread(target=self._serve, args=(request, request.get_response_sender()), daemon=True).start()
        return None

    def _serve(self, request, sender):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            for response in self._generate(request, streaming_allowed=True):
                sender.send(response)
            sender.send(flags=final)
        except Exception as exc:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}")),
                        flags=final)

    def _generate(self, request, *, streaming_allowed):
        for name in UNSUPPORTED:
            if _get(request, name) is not None:
                raise ValueError(f"{name} is not supported by this deployment")
        stream = _get(request, "stream")
        streaming = bool(stream.reshape(-1)[0]) if stream is not None else False
        if streaming and not streaming_allowed:
            raise ValueError("streaming (stream=true) needs a decoupled tensorrt_llm_bls model; this one is not")
        pre_inputs = [pb_utils.Tensor(dst, _get(request, src)) for src, dst in TO_PRE.items()
                      if _get(request, src) is not None]
        pre = _check(_call("preprocessing", pre_inputs, list(PRE_OUT)))
        got = {n: pb_utils.get_output_tensor_by_name(pre, n) for n in PRE_OUT}
        batch = got["INPUT_ID"].as_numpy().shape[0]
        inputs = [pb_utils.Tensor("input_ids", got["INPUT_ID"].as_numpy()),
                  pb_utils.Tensor("input_lengths", got["REQUEST_INPUT_LEN"].as_numpy()),
                  pb_utils.Tensor("request_output_len", got["REQUEST_OUTPUT_LEN"].as_numpy()),
                  pb_utils.Tensor("end_id", got["OUT_END_ID"].as_numpy()),
                  pb_utils.Tensor("pad_id", got["OUT_PAD_ID"].as_numpy()),
                  pb_utils.Tensor("streaming", np.full((batch, 1), streaming, dtype=bool))]
        for src, dst in (("STOP_WORDS_IDS", "stop_words_list"), ("BAD_WORDS_IDS", "bad_words_list"),
                         ("EMBEDDING_BIAS", "embedding_bias")):
            arr = got[src].as_numpy() if got[src] is not None else None
            if arr is not None and arr.size:
                inputs.append(pb_utils.Tensor(dst, arr))
        if _get(request, "decoder_text_input") is not None:
            inputs += [pb_utils.Tensor("decoder_input_ids", got["DECODER_INPUT_ID"].as_numpy()),
                       pb_utils.Tensor("decoder_input_lengths", got["REQUEST_DECODER_INPUT_LEN"].as_numpy())]
        for src, dst in TO_LLM.items():
            arr = _get(request, src)
            if arr is not None:
                if arr.ndim == 1:  # an input with reshape [] arrives as [batch]; tensorrt_llm takes [batch, 1]
                    arr = arr.reshape(-1, 1)
                inputs.append(pb_utils.Tensor(dst, arr))
        # the tensorrt_llm model shares this model's transaction policy (both from decoupled_mode); the request id
        # goes with it, so that upstream's stop request for that id reaches the generation
        results = _call(self.llm, inputs, ("output_ids", "sequence_length", *PASS_THROUGH), decoupled=self.decoupled,
                        request_id=request.request_id())
        if not self.decoupled:
            results = [results]
        acc = None
        for resp in results:
            _check(resp)
            ids = pb_utils.get_output_tensor_by_name(resp, "output_ids")
            if ids is None:  # the empty final response of a decoupled model
                continue
            tokens = ids.as_numpy()
            lengths = pb_utils.get_output_tensor_by_name(resp, "sequence_length").as_numpy()
            if self.accumulate and streaming:
                acc = _accumulate(acc, tokens, lengths)
                tokens, lengths = acc
            post = _check(_call("postprocessing", [pb_utils.Tensor("TOKENS_BATCH", tokens),
                                                   pb_utils.Tensor("SEQUENCE_LENGTH", lengths)], ["OUTPUT"]))
            text = pb_utils.get_output_tensor_by_name(post, "OUTPUT").as_numpy()
            out = [pb_utils.Tensor("text_output", text.astype(object))]
            for name in PASS_THROUGH:
                t = pb_utils.get_output_tensor_by_name(resp, name)
                if t is not None:
                    out.append(pb_utils.Tensor(name, t.as_numpy()))
            yield pb_utils.InferenceResponse(output_tensors=out)


def _accumulate(acc, tokens, lengths):
    """Append this response's tokens to the ones so far: ([batch, beams, seq], [batch, beams])."""
    if tokens.ndim == 2:
        tokens = tokens[:, None, :]
    lengths = lengths.reshape(tokens.shape[0], tokens.shape[1])
    new = [[tokens[b, k, : int(lengths[b, k])].tolist() for k in range(tokens.shape[1])]
           for b in range(tokens.shape[0])]
    if acc is not None:
        old_t, old_l = acc
        new = [[old_t[b, k, : int(old_l[b, k])].tolist() + new[b][k] for k in range(len(new[b]))]
               for b in range(len(new))]
    width = max(1, max(len(s) for row in new for s in row))
    out = np.zeros((len(new), len(new[0]), width), dtype=np.int32)
    lens = np.zeros((len(new), len(new[0])), dtype=np.int32)
    for b, row in enumerate(new):
        for k, s in enumerate(row):
            out[b, k, : len(s)] = s
            lens[b, k] = len(s)
    return out, lens
