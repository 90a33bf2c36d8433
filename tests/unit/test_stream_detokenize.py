"""Streamed text of the ``inflight_batcher_llm`` layout, decoded as the front end decodes it.

A byte-level BPE tokenizer splits a multi-byte UTF-8 character over several tokens (Qwen's Chinese, emoji; the
tiny-qwen3 build's ``ћ``). Upstream's ``postprocessing`` model decodes each streamed response's new tokens on their
own, so an ``ensemble`` stream turns every half of such a character into U+FFFD. The front end must stream what the
unary answer holds: each test feeds a call the responses the server sends for it and joins what the front end makes
of them.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

# characters of 2, 3 and 4 UTF-8 bytes, ASCII runs and spaces between them
TEXTS = ["你好，世界。今天的天气很好", " A com\x0eightћ and ћћ", "naïve café — 東京 🙂 ok", "🙂🙂 x 中"]


@pytest.fixture(scope="module")
def served():
    from pipeline.serving.model import ServedModel
    from pipeline.stages.fetch import train_tokenizer

    return ServedModel(Path("."), "inflight_batcher_llm", "m", Path("."), 4096, True, tokenizer=train_tokenizer(512))


def _spec(model: str, decoupled: bool = True):
    """The recorded upstream interface of one ``inflight_batcher_llm`` model, as the driver reads a served config."""
    from pipeline import upstream
    from pipeline.triton.layouts.contract import Spec

    rec = upstream.interface()[model]
    return Spec.from_config({"name": model, "max_batch_size": 8, "input": rec["inputs"], "output": rec["outputs"],
                             "model_transaction_policy": {"decoupled": decoupled}})


def _tensor(r, name: str, datatype: str, arr: np.ndarray) -> None:
    from tritonclient.utils import serialize_byte_tensor

    out = r.outputs.add()
    out.name, out.datatype = name, datatype
    out.shape.extend(arr.shape)
    r.raw_output_contents.append(serialize_byte_tensor(arr).item() if datatype == "BYTES" else arr.tobytes())


def _responses(call, tok, ids: list[int], per: int = 1):
    """What the server streams for ``call``, ``per`` new tokens a response: from ``tensorrt_llm`` the new
    ``output_ids`` and their ``sequence_length``; from ``ensemble``/``tensorrt_llm_bls`` the ``text_output`` that
    upstream's postprocessing makes of them (``batch_decode`` of the new tokens alone) and ``num_output_tokens``."""
    from tritonclient.grpc import service_pb2

    for i in range(0, len(ids), per):
        new = ids[i:i + per]
        r = service_pb2.ModelInferResponse(model_name=call.spec.name, id="r1")
        if call.spec.name == "tensorrt_llm":
            _tensor(r, "output_ids", "INT32", np.array([[new]], dtype=np.int32))
            _tensor(r, "sequence_length", "INT32", np.array([[len(new)]], dtype=np.int32))
        else:
            text = tok.batch_decode([new], skip_special_tokens=True)[0]
            _tensor(r, "text_output", "BYTES", np.array([[text.encode("utf-8")]], dtype=object))
            _tensor(r, "num_output_tokens", "INT32", np.array([[i + len(new)]], dtype=np.int32))
        yield r


def _streamed(call, tok, ids: list[int], per: int = 1) -> list[str]:
    pieces = [call.decode(r).text for r in _responses(call, tok, ids, per)]
    return pieces + [d.text for d in call.finish()]


def _request(text: str | None = "Say something", stream: bool = True):
    from pipeline.triton.layouts.contract import GenRequest

    return GenRequest(prompt_text=text, prompt_ids=None, max_tokens=64, stream=stream,
                      sampling={"temperature": 0.0}, request_id="r1")


def test_the_tokenizer_splits_characters_over_tokens(served):
    """The control: per-token decoding (upstream's postprocessing on a streamed response) garbles these texts."""
    tok = served.tokenizer
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert "\ufffd" in "".join(tok.decode([i]) for i in ids), text


@pytest.mark.parametrize("entry", ["ensemble", "tensorrt_llm_bls"])
@pytest.mark.parametrize("per", [1, 3])
def test_a_streamed_text_request_streams_the_text_the_unary_answer_holds(served, entry, per):
    """A streamed text request to a decoupled entry point: the pieces join to the tokens decoded whole, none holds
    U+FFFD, and the prompt goes as the layout's tokenizer step would make its ids."""
    from pipeline.triton import layouts

    codec = layouts.get("inflight_batcher_llm").codec(served)
    tok = served.tokenizer
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        req = _request()
        call = codec.call(req, _spec(entry), {"tensorrt_llm": _spec("tensorrt_llm")})
        pieces = _streamed(call, tok, ids, per)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text, (entry, pieces)
        assert not any("\ufffd" in p for p in pieces), pieces
        assert call.inputs["input_ids"] == served.encode_prompt(req.prompt_text)
        assert req.prompt_ids is None  # the request itself stays a text request (its prompt counted as text)


def test_unary_text_requests_and_unary_entry_points_keep_the_entry_points_whole_text(served):
    """Only a stream is decoded per response: a unary request, and a stream to a unary entry point (one response,
    the whole text), stay on the entry point."""
    from pipeline.triton import layouts
    from pipeline.triton.layouts.contract import TextCall

    codec = layouts.get("inflight_batcher_llm").codec(served)
    side = {"tensorrt_llm": _spec("tensorrt_llm")}
    for entry, stream in (("ensemble", False), ("tensorrt_llm_bls", False)):
        call = codec.call(_request(stream=stream), _spec(entry), side)
        assert isinstance(call, TextCall) and call.spec.name == entry
    call = codec.call(_request(stream=True), _spec("ensemble", decoupled=False), side)
    assert isinstance(call, TextCall) and call.spec.name == "ensemble"


def test_the_token_path_decodes_a_window_not_the_whole_text_each_response(served):
    """Each response decodes the last few tokens, not every token so far (that is quadratic in the length), and the
    pieces still join to the whole text."""
    from pipeline.triton import layouts

    codec = layouts.get("inflight_batcher_llm").codec(served)
    tok = served.tokenizer
    text = " ".join(TEXTS) * 12
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 300
    seen: list[int] = []

    class Counting:
        def __getattr__(self, name):
            return getattr(served, name)

        def decode(self, window):
            seen.append(len(window))
            return served.decode(window)

    codec.served = Counting()
    call = codec.call(_request(), _spec("ensemble"), {"tensorrt_llm": _spec("tensorrt_llm")})
    pieces = [call.decode(r).text for r in _responses(call, tok, ids)]
    assert max(seen) <= 16, max(seen)
    assert "".join(pieces) + "".join(d.text for d in call.finish()) == text
