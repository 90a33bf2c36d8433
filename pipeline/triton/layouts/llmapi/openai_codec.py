"""The front end's codec for ``llmapi``: the python ``tensorrt_llm`` model with ``text_input``, ``streaming``,
``sampling_param_*`` (the layout record's ``sampling``: the sampling table's rows the served model has an input for;
``repetition_penalty`` and ``min_tokens`` have none upstream: a 400), the guide (this project's
``guided_decoding_guide_type``/``guided_decoding_guide`` inputs, which its ``model.py`` turns into
``GuidedDecodingParams``), ``sampling_param_exclude_input_from_output`` and
``return_finish_reason``; each streamed response holds the whole text so far. Token ids and log probabilities are a
400: the model takes text and returns text. A generation left before its end is stopped with upstream's ``stop``
request to the model itself."""
from __future__ import annotations

from typing import Any

from pipeline.triton.layouts.contract import APIError, Call, Codec as _Base, CumulativeCall, GenRequest, Spec


class Codec(_Base):
    def call(self, req: GenRequest, entry: Spec, side: dict[str, Spec]) -> Call:
        self.refuse_token_level(req)
        return CumulativeCall(entry, self.inputs(entry, req), (), self.layout.stream)

    def inputs(self, spec: Spec, req: GenRequest) -> dict[str, Any]:
        lay = self.layout
        out: dict[str, Any] = {lay.text_input: req.prompt_text, lay.max_tokens: req.max_tokens}
        if lay.exclude_input in spec.inputs:
            out[lay.exclude_input] = True
        if "return_finish_reason" in spec.inputs:
            out["return_finish_reason"] = True
        names = {k: v for k, v in lay.sampling.items() if v in spec.inputs}
        self.sampling(spec, req, names, out)
        self.guide_inputs(spec, req, lay.guide, out)
        if req.ignore_eos:
            if "sampling_param_ignore_eos" not in spec.inputs:
                raise APIError(400, f"ignore_eos is not supported by the llmapi layout's '{spec.name}' model (it has "
                                    f"no input 'sampling_param_ignore_eos')", param="ignore_eos")
            out["sampling_param_ignore_eos"] = True
        self.check(spec, out, {**{v: k for k, v in names.items()}, **{t: req.guide_param for t in lay.guide}})
        return out

    def why_not_token_level(self, req: GenRequest) -> str:
        if req.prompt_logprobs:
            return ("echo with logprobs needs prompt log probabilities, which the llmapi layout's tensorrt_llm model "
                    "does not return (its outputs: text, finish reason, cumulative log prob); serve the "
                    "inflight_batcher_llm layout for log-likelihood evaluation")
        if req.logprobs is not None:
            return ("logprobs: the llmapi layout's tensorrt_llm model returns no per-token log probabilities (only "
                    "cumulative_logprob); serve the inflight_batcher_llm layout for them")
        return "prompt as token ids: the llmapi layout's tensorrt_llm model takes text only (text_input)"
