"""The front end's codec for ``inflight_batcher_llm``:

- text requests: the entry point (``ensemble`` or ``tensorrt_llm_bls``) with ``text_input``, ``max_tokens``,
  ``stream``, ``exclude_input_in_output``, the sampling table's tensors (the layout record's ``sampling``:
  ``temperature``/``top_k``/``top_p``, ``seed``, ``min_tokens``, ``presence_penalty``/``frequency_penalty``/
  ``repetition_penalty``, ``stop_words``), the guide (``guided_decoding_guide_type``, ``guided_decoding_guide``:
  ``response_format``, tools), ``end_id`` (-1 for ``ignore_eos``, as the LLM API sets it) and
  ``return_num_output_tokens``; its answer is the whole text, decoded once by ``postprocessing``.
- streamed text requests to a decoupled entry point: the token path below, the prompt tokenized here as the layout's
  ``preprocessing`` tokenizes it (its ``add_special_tokens``). Streamed, upstream's ``postprocessing`` decodes each
  response's new tokens on their own (TensorRT-LLM ``triton_backend/all_models/inflight_batcher_llm/postprocessing``
  ``execute``: ``batch_decode`` of ``tokens[:seq_len]``), so a character whose UTF-8 bytes span two responses (Qwen's
  Chinese, emoji) arrives as two U+FFFD and is lost; upstream's remedy, ``tensorrt_llm_bls`` with
  ``accumulate_tokens``, sends the text of every token so far in every response (each response decodes and carries
  the whole text: quadratic in the length) and is off in upstream's quick start and here. The ensemble still serves
  every unary text request and every Triton client.
- token-level requests (token-id prompts, ``logprobs``, ``echo``): the ``tensorrt_llm`` model itself, as NVIDIA's
  ``inflight_batcher_llm_client.py`` drives it, with ``input_ids``/``input_lengths``, ``request_output_len``,
  ``streaming``, ``end_id``/``pad_id``, the sampling tensors upstream's ensemble feeds ``tensorrt_llm`` with
  (:func:`llm_inputs`: ``runtime_top_k``/``runtime_top_p``, ...), ``stop_words_list`` (TensorRT-LLM's
  ``[1, 2, N]`` word list), ``return_log_probs`` (``output_log_probs``), ``return_context_logits`` (prompt log
  probabilities) and ``return_generation_logits`` (top log probabilities); the front end detokenizes incrementally
  (:class:`TokenCall`).

A generation left before its end is stopped with upstream's ``stop`` request to ``tensorrt_llm``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from pipeline.triton.layouts import sampling
from pipeline.triton.layouts.contract import (APIError, Call, Codec as _Base, Delta, GenRequest, Spec, TextCall,
                                              TokenLogprob, common_prefix, token_param, top)

LLM = "tensorrt_llm"  # the model that takes token ids


def fed(layout) -> dict[str, str]:
    """Ensemble input -> the ``tensorrt_llm`` input upstream's ensemble feeds from it (its ``tensorrt_llm`` step's
    ``input_map``: ``top_k`` -> ``runtime_top_k``, ...)."""
    step = next(s for s in layout.interface()["ensemble"]["steps"] if s["model_name"] == LLM)
    return {src: dst for dst, src in step["input_map"].items()}


def llm_inputs(layout) -> dict[str, str]:
    """Each tensor of the entry point's sampling record (``Layout(sampling=...)``: row -> ensemble input) as the
    ``tensorrt_llm`` model takes it (:func:`fed`). A row the ensemble does not hand to ``tensorrt_llm`` as it is
    (``stop_words`` goes through ``preprocessing``) is left out."""
    into = fed(layout)
    return {row: into[tensor] for row, tensor in layout.sampling.items() if tensor in into}


class Codec(_Base):
    side_models = (LLM,)
    stop_model = LLM

    def __init__(self, layout, served):
        super().__init__(layout, served)
        self.token_sampling = llm_inputs(layout)
        self.token_guide = tuple(fed(layout).get(t, t) for t in layout.guide)

    def stop_dummies(self) -> dict[str, Any]:
        return {"input_ids": [self.served.eos_id or 0], "input_lengths": 1, "request_output_len": 1}

    def call(self, req: GenRequest, entry: Spec, side: dict[str, Spec]) -> Call:
        llm = side.get(LLM)
        if not req.token_level and req.stream and entry.decoupled and llm is not None:
            # each streamed response of the entry point holds its new tokens decoded alone (see the module's doc)
            req = replace(req, prompt_ids=self.served.encode_prompt(req.prompt_text))
        elif not req.token_level:
            outputs = ("text_output", "num_output_tokens") if "num_output_tokens" in entry.outputs else ("text_output",)
            return TextCall(entry, self.text_inputs(entry, req), outputs, self.layout.stream)
        if llm is None:
            raise APIError(400, f"{token_param(req)} needs the layout's tensorrt_llm model (token ids and log probs), "
                                f"which this server does not serve", param=token_param(req))
        outputs = ["output_ids", "sequence_length"]
        if req.logprobs is not None and not req.logprobs:
            outputs.append("output_log_probs")
        if req.logprobs:
            outputs.append("generation_logits")
        if req.prompt_logprobs:
            outputs.append("context_logits")
        return TokenCall(llm, self.token_inputs(llm, req), tuple(outputs), "streaming", req, self.served)

    def text_inputs(self, spec: Spec, req: GenRequest) -> dict[str, Any]:
        lay = self.layout
        out: dict[str, Any] = {lay.text_input: req.prompt_text, lay.max_tokens: req.max_tokens}
        if lay.exclude_input in spec.inputs:
            out[lay.exclude_input] = True
        self.sampling(spec, req, lay.sampling, out)
        self.guide_inputs(spec, req, lay.guide, out)
        if req.ignore_eos:
            out["end_id"] = -1
        if "return_num_output_tokens" in spec.inputs:
            out["return_num_output_tokens"] = True
        self.check(spec, out, {"end_id": "ignore_eos", **{v: k for k, v in lay.sampling.items()},
                               **{t: req.guide_param for t in lay.guide}})
        return out

    def token_inputs(self, spec: Spec, req: GenRequest) -> dict[str, Any]:
        ids = req.prompt_ids
        eos, pad = self.served.eos_id, self.served.pad_id
        out: dict[str, Any] = {"input_ids": ids, "input_lengths": len(ids), "request_output_len": req.max_tokens,
                               "end_id": -1 if req.ignore_eos or eos is None else eos,
                               "pad_id": pad if pad is not None else 0}
        if "exclude_input_in_output" in spec.inputs:
            out["exclude_input_in_output"] = True
        self.sampling(spec, req, self.token_sampling, out, own=(sampling.STOP,))  # stop: a word list, below
        self.guide_inputs(spec, req, self.token_guide, out)
        if req.stop:
            words = [self.served.tokenizer.encode(s, add_special_tokens=False) for s in req.stop]
            flat, ends = [], []
            for w in words:
                if w:
                    flat += w
                    ends.append(len(flat))
            width = max(1, len(flat))
            arr = np.zeros((1, 2, width), dtype=np.int32)
            arr[0, 1, :] = -1
            arr[0, 0, :len(flat)] = flat
            arr[0, 1, :len(ends)] = ends
            out["stop_words_list"] = arr
        if req.logprobs is not None and not req.logprobs:
            out["return_log_probs"] = True
        if req.logprobs:
            out["return_generation_logits"] = True
        if req.prompt_logprobs:
            out["return_context_logits"] = True
        self.check(spec, out, {"stop_words_list": "stop", "return_log_probs": "logprobs",
                               "return_generation_logits": "logprobs", "return_context_logits": "echo",
                               **{v: k for k, v in self.token_sampling.items()},
                               **{t: req.guide_param for t in self.token_guide}})
        return out


class TokenCall(Call):
    """A token-level request's responses: ``output_ids`` (TensorRT-LLM leaves a generated end id out) with their log
    probabilities (``output_log_probs``, or ``generation_logits`` for the top ones) and, on the first response,
    ``context_logits`` (the prompt's log probabilities); the text is the ids detokenized here, incrementally: each
    response decodes a window of the last tokens (vLLM's and TGI's prefix and read offsets: the text of the tokens
    from ``prefix`` on, less that of those before ``read``), not every token so far, and a character still
    incomplete (a trailing U+FFFD) waits for its next token."""

    __slots__ = ("req", "served", "ids", "prefix", "read", "prompt_done", "prompt_lps", "eos_first")

    def __init__(self, spec, inputs, outputs, stream_input, req: GenRequest, served):
        super().__init__(spec, inputs, outputs, stream_input)
        self.req, self.served = req, served
        self.ids: list[int] = []
        self.prefix = self.read = 0  # the window: ids[prefix:read] were sent, ids[read:] not yet
        self.prompt_done = False
        self.prompt_lps: list[TokenLogprob] | None = None
        self.eos_first: TokenLogprob | None = None

    def decode(self, resp) -> Delta:
        from tritonclient.grpc import InferResult

        req = self.req
        result = InferResult(resp)
        ids_arr = result.as_numpy("output_ids")
        lens = result.as_numpy("sequence_length")
        new_ids: list[int] = []
        if ids_arr is not None and ids_arr.size:
            row = ids_arr.reshape(-1)
            n = int(lens.reshape(-1)[0]) if lens is not None and lens.size else row.size
            new_ids = [int(x) for x in row[:n]]
        lps: list[TokenLogprob] | None = None
        if req.prompt_logprobs and not self.prompt_done:
            ctx = result.as_numpy("context_logits")
            if ctx is None:
                raise APIError(400, "the served tensorrt_llm model returned no context_logits: prompt log "
                                    "probabilities (echo with logprobs) need an engine built with "
                                    "--gather_context_logits", param="echo")
            self.prompt_done = True
            ctx = ctx.reshape(-1, ctx.shape[-1])[-len(req.prompt_ids):]
            plp = [TokenLogprob(req.prompt_ids[0], None)]
            for i in range(1, len(req.prompt_ids)):
                lp, best = top(ctx[i - 1], req.logprobs or 0)
                plp.append(TokenLogprob(req.prompt_ids[i], float(lp[req.prompt_ids[i]]), best))
            self.prompt_lps = plp
            eos = self.served.eos_id
            if eos is not None and not req.ignore_eos:
                # the last row predicts the first generated token: an end id generated first (which TensorRT-LLM
                # leaves out of output_ids and its log probs) still gets its entry, as vLLM and OpenAI return it
                lp, best = top(ctx[len(req.prompt_ids) - 1], req.logprobs or 0)
                self.eos_first = TokenLogprob(eos, float(lp[eos]), best)
        if req.logprobs is not None and new_ids:
            lps = []
            if req.logprobs:
                gen = result.as_numpy("generation_logits")
                if gen is None:
                    raise APIError(400, "the served tensorrt_llm model returned no generation_logits: top log "
                                        "probabilities need an engine built with --gather_generation_logits",
                                   param="logprobs")
                gen = gen.reshape(-1, gen.shape[-1])[-len(new_ids):]
                for tok, row in zip(new_ids, gen):
                    lp, best = top(row, req.logprobs)
                    lps.append(TokenLogprob(tok, float(lp[tok]), best))
            else:
                olp = result.as_numpy("output_log_probs")
                flat = [] if olp is None else [float(x) for x in olp.reshape(-1)]
                total = len(self.ids) + len(new_ids)
                vals = flat[total - len(new_ids):total] if len(flat) >= total else flat[-len(new_ids):]
                if len(vals) != len(new_ids):
                    raise APIError(500, "the served tensorrt_llm model returned fewer output_log_probs than tokens")
                lps = [TokenLogprob(t, v) for t, v in zip(new_ids, vals)]
        self.ids += new_ids
        emit = self._advance(final=False) if new_ids else ""
        plps, self.prompt_lps = self.prompt_lps, None
        return Delta(text=emit, ids=new_ids, logprobs=lps, num_output_tokens=len(self.ids), prompt_logprobs=plps)

    def _advance(self, final: bool) -> str:
        """The text the tokens after ``read`` add; none while it ends in a character still incomplete, unless
        ``final``."""
        before = self.served.decode(self.ids[self.prefix:self.read])
        now = self.served.decode(self.ids[self.prefix:])
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):
            return ""
        new = now[len(before):] if now.startswith(before) else now[len(common_prefix(before, now)):]
        self.prefix, self.read = self.read, len(self.ids)
        return new

    def finish(self) -> tuple[Delta, ...]:
        """The text held back at the end (an incomplete character is final now); and where the generation ended at
        once, its one token the end id, that token's entry (a stop word stays in the output)."""
        out = []
        rest = self._advance(final=True) if self.read < len(self.ids) else ""
        if rest:
            out.append(Delta(text=rest))
        if not self.ids and self.eos_first is not None:
            out.append(Delta(text="", logprobs=[self.eos_first], num_output_tokens=0))
        return tuple(out)
