"""The toy's codec: a text request is ``prompt``, ``max_new_tokens`` and ``temperature`` (0: greedy); each response
holds the text of its new tokens in ``completion``. Anything else that would change the output is a 400."""
from __future__ import annotations

from pipeline.triton.layouts.contract import APIError, Call, Codec as _Base, GenRequest, Spec, TextCall


class Codec(_Base):
    def call(self, req: GenRequest, entry: Spec, side: dict[str, Spec]) -> Call:
        self.refuse_token_level(req)
        for fld in req.sampling:
            if fld not in self.layout.sampling:
                raise APIError(400, f"{fld} is not supported by the toy layout", param=fld)
        lay = self.layout
        inputs = {lay.text_input: req.prompt_text, lay.max_tokens: req.max_tokens,
                  lay.sampling["temperature"]: float(req.temperature)}
        self.check(entry, inputs, {lay.sampling["temperature"]: "temperature"})
        return TextCall(entry, inputs, (lay.output,), lay.stream, output=lay.output, count="")
