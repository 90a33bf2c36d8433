"""Generation over Triton's gRPC API (``tritonclient.grpc.aio``), through the layout's own entry points, with the
tensor names and types of the recorded upstream interface (``pipeline/upstream``), read back from the server's own
model configs at start-up:

- ``inflight_batcher_llm``, text requests: ``ensemble`` (or ``tensorrt_llm_bls``) with ``text_input``,
  ``max_tokens``, ``stream``, ``exclude_input_in_output``, ``temperature``/``top_k``/``top_p``, ``seed``,
  ``min_tokens``, ``presence_penalty``/``frequency_penalty``/``repetition_penalty``, ``stop_words``, ``end_id`` (-1
  for ``ignore_eos``, as the LLM API sets it) and ``return_num_output_tokens``; each streamed response holds the
  text of its new tokens.
- ``inflight_batcher_llm``, token-level requests (token-id prompts, ``logprobs``, ``echo``): the ``tensorrt_llm``
  model itself, as NVIDIA's ``inflight_batcher_llm_client.py`` drives it, with ``input_ids``/``input_lengths``,
  ``request_output_len``, ``streaming``, ``end_id``/``pad_id``, ``runtime_top_k``/``runtime_top_p``,
  ``stop_words_list`` (TensorRT-LLM's ``[1, 2, N]`` word list), ``return_log_probs`` (``output_log_probs``),
  ``return_context_logits`` (prompt log probabilities) and ``return_generation_logits`` (top log probabilities);
  the front end detokenizes.
- ``llmapi``: the python ``tensorrt_llm`` model with ``text_input``, ``streaming``, ``sampling_param_*`` and
  ``return_finish_reason``; each streamed response holds the whole text so far.

Sampling follows OpenAI's meaning: temperature 0 decodes greedily (top-k 1); any other temperature samples (top-p 1
unless given: TensorRT-LLM decodes greedily when top-k and top-p are both unset). A field the served model has no
input for is a 400 naming the field and the missing tensor.

Transport: model configs and readiness through ``tritonclient.grpc.aio``; requests as Triton's own protobufs (the
``service_pb2`` that ``tritonclient.grpc`` ships) on ``grpc.aio``. A decoupled model's requests share long-lived
bidirectional streams (``ModelStreamInfer``; responses routed by request id, an empty final response asked for), as
upstream's clients keep one stream open; opening a stream per request cost a millisecond or more of time to first
token here. The task that makes a request writes it at once, on a stream with no write in flight (more streams are
opened, up to ``Driver.streams``, while every one is writing): handing it to a writer task instead held each request
of a burst until the whole burst had been parsed. A request left before its end is stopped with upstream's ``stop``
request for its id. A unary model gets ``ModelInfer``, cancelled with its call. A request whose stream stays silent
for the request timeout is a 504; one watchdog task checks every request, so waiting for a response arms no timer.
"""
from __future__ import annotations

import asyncio
import collections
import math
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import numpy as np

from pipeline.serving.model import ServedModel
from pipeline.serving.protocol import APIError

NP = {"TYPE_BOOL": (np.bool_, "BOOL"), "TYPE_INT32": (np.int32, "INT32"), "TYPE_INT64": (np.int64, "INT64"),
      "TYPE_UINT64": (np.uint64, "UINT64"), "TYPE_FP32": (np.float32, "FP32"), "TYPE_FP16": (np.float16, "FP16"),
      "TYPE_STRING": (object, "BYTES"), "TYPE_UINT8": (np.uint8, "UINT8")}


@dataclass
class Spec:
    """One served Triton model: its inputs (name -> (data type, dims)), outputs, batching and transaction policy."""

    name: str
    inputs: dict[str, tuple[str, list[int]]]
    outputs: set[str]
    batched: bool
    decoupled: bool
    required: tuple[str, ...] = ()  # inputs that are not optional

    @classmethod
    def from_config(cls, cfg: dict) -> "Spec":
        return cls(cfg["name"],
                   {t["name"]: (t.get("data_type", "TYPE_INVALID"), [int(d) for d in t.get("dims", [])])
                    for t in cfg.get("input", [])},
                   {t["name"] for t in cfg.get("output", [])},
                   int(cfg.get("max_batch_size", 0) or 0) > 0,
                   bool((cfg.get("model_transaction_policy") or {}).get("decoupled", False)),
                   tuple(t["name"] for t in cfg.get("input", []) if not t.get("optional", False)))


@dataclass
class GenRequest:
    """One generation, in OpenAI's terms (the driver maps it onto the layout's tensors)."""

    prompt_text: str | None
    prompt_ids: list[int] | None
    max_tokens: int
    stream: bool
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: plus the k most likely
    prompt_logprobs: bool = False  # echo with logprobs: the prompt tokens' log probabilities
    request_id: str = ""
    # called once the request is on its way to Triton; an error it returns ends the request (stopped on the server)
    after_send: Callable[[], BaseException | None] | None = None

    @property
    def token_level(self) -> bool:
        return self.prompt_ids is not None or self.logprobs is not None or self.prompt_logprobs


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: the first prompt token (nothing predicts it)
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Delta:
    """What one Triton response adds: new text, and for token-level requests the new token ids and log probs."""

    text: str = ""
    ids: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None
    num_output_tokens: int | None = None  # the engine's count so far, where the layout reports it
    finish_reason: str | None = None  # llmapi's own finish reason on its last response
    prompt_logprobs: list[TokenLogprob] | None = None  # echo with logprobs: on the first delta


def _top(row: np.ndarray, k: int) -> tuple[np.ndarray, list[tuple[int, float]]]:
    """log_softmax of one logits row, and its k most likely (id, log prob)."""
    x = row.astype(np.float64)
    m = x.max()
    lp = x - (m + math.log(np.exp(x - m).sum()))
    if k <= 0:
        return lp, []
    idx = np.argpartition(-lp, min(k, lp.size - 1))[:k]
    idx = idx[np.argsort(-lp[idx], kind="stable")]
    return lp, [(int(i), float(lp[i])) for i in idx]


class Driver:
    """Talks to one Triton server for one served model."""

    def __init__(self, url: str, served: ServedModel, entry: str | None = None, timeout_s: float = 600.0):
        self.url, self.served, self.timeout_s = url, served, timeout_s
        from pipeline.triton import layouts

        self.layout = layouts.get(served.layout)  # its entry points and text-request tensors
        self.entry_name = entry or self.layout.entry_points[0]
        self.client = None
        self.entry: Spec | None = None
        self.llm: Spec | None = None  # inflight_batcher_llm: the tensorrt_llm model (token-level requests)
        self._pending: set = set()  # stop requests in flight
        self._channel = None
        self._stub_obj = None
        self._muxes: list[_Mux] = []
        self._next = 0
        self.streams = 16  # the most shared gRPC streams (one more is opened while every one is writing)
        self._watchdog: asyncio.Task | None = None
        self._templates: dict[tuple, Any] = {}  # request protobufs of scalar inputs and outputs (:meth:`_request`)

    async def start(self) -> None:
        import tritonclient.grpc.aio as grpcaio

        # gRPC keeps one HTTP/2 connection; every request is one stream on it
        self.client = grpcaio.InferenceServerClient(self.url)

    async def close(self) -> None:
        pending = list(self._pending)  # stop requests and their retries
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        for m in self._muxes:
            await m.close()
        if self._channel is not None:
            await self._channel.close()
        if self.client is not None:
            await self.client.close()

    async def ready(self) -> bool:
        """Whether Triton serves the entry point now (reads the model configs the first time)."""
        try:
            if not await self.client.is_model_ready(self.entry_name):
                return False
            if self.entry is None:
                await self._load_specs()
            return True
        except Exception:
            return False

    async def _load_specs(self) -> None:
        cfg = (await self.client.get_model_config(self.entry_name, as_json=True)).get("config", {})
        entry = Spec.from_config(cfg)
        if "text_input" not in entry.inputs or "text_output" not in entry.outputs:
            raise APIError(503, f"model '{self.entry_name}' on {self.url} is not a {self.served.layout} entry point "
                                f"(no text_input/text_output)")
        llm = None
        if self.served.layout == "inflight_batcher_llm":
            try:
                if await self.client.is_model_ready("tensorrt_llm"):
                    llm = Spec.from_config((await self.client.get_model_config("tensorrt_llm", as_json=True))
                                           .get("config", {}))
            except Exception:
                llm = None
        self.entry, self.llm = entry, llm

    async def specs(self) -> tuple[Spec, Spec | None]:
        if self.entry is None:
            if not await self.ready():
                raise APIError(503, f"Triton at {self.url} is not ready to serve '{self.entry_name}'; retry shortly")
        return self.entry, self.llm

    # --- requests ----------------------------------------------------------------------------------------------
    async def generate(self, req: GenRequest) -> AsyncIterator[Delta]:
        """:data:`SENT` once the request is on its way to Triton (the caller advances to it in the task that made
        the request), then what each response adds. Closing the generator before the end stops the request."""
        entry, llm = await self.specs()
        if self.served.layout == "llmapi":
            if req.token_level:
                raise APIError(400, self._why_not_token_level(req), param=self._token_param(req))
            spec, inputs, outputs, kind = entry, self._llmapi_inputs(entry, req), None, "llmapi"
        elif req.token_level:
            if llm is None:
                raise APIError(400, f"{self._token_param(req)} needs the layout's tensorrt_llm model (token ids and "
                                    f"log probs), which this server does not serve", param=self._token_param(req))
            spec, inputs, kind = llm, self._token_inputs(llm, req), "tokens"
            outputs = ["output_ids", "sequence_length"]
            if req.logprobs is not None and not req.logprobs:
                outputs.append("output_log_probs")
            if req.logprobs:
                outputs.append("generation_logits")
            if req.prompt_logprobs:
                outputs.append("context_logits")
        else:
            spec, inputs, kind = entry, self._text_inputs(entry, req), "text"
            outputs = ["text_output"] + (["num_output_tokens"] if "num_output_tokens" in entry.outputs else [])
        if req.stream and not spec.decoupled:
            pass  # a unary model answers once; the front end still streams that one answer
        stream = req.stream and spec.decoupled
        self._set(spec, inputs, "streaming" if kind == "tokens" else self.layout.stream, stream)
        request = self._request(spec, inputs, [o for o in (outputs or []) if o in spec.outputs], req.request_id)
        state = {"ids": [], "sent_text": "", "so_far": "", "prompt_done": False}
        if spec.decoupled:
            async for resp in self._stream(spec.name, request, req.after_send):
                yield SENT if resp is SENT else self._delta(kind, resp, req, state)
        else:
            yield SENT  # a unary call starts when it is awaited
            yield self._delta(kind, await self._unary(request, req.after_send), req, state)
        tail = self._flush(kind, state)
        if tail:
            yield Delta(text=tail)
        if kind == "tokens" and not state["ids"] and state.get("eos_first") is not None:
            # the generation ended at once: its one token was the end id (a stop word stays in the output)
            yield Delta(text="", logprobs=[state["eos_first"]], num_output_tokens=0)

    # --- transport ---------------------------------------------------------------------------------------------
    def _request(self, spec: Spec, inputs: dict[str, Any], outputs: list[str], request_id: str):
        """A ``ModelInferRequest`` (Triton's protobuf, as ``tritonclient.grpc`` ships it) with the inputs in
        ``raw_input_contents``; a decoupled model is asked for its empty final response, so the end is known.
        The part made of scalar inputs (``max_tokens``, ``stream``, ``top_k``: the same few values on most
        requests) and the outputs is built once per combination and copied; the prompt is added to the copy."""
        from tritonclient.grpc import service_pb2

        scalars = tuple((n, type(v), v) for n, v in inputs.items() if type(v) in _SCALARS)
        key = (spec.name, scalars, tuple(outputs))
        template = self._templates.get(key)
        if template is None:
            template = service_pb2.ModelInferRequest(model_name=spec.name)
            for name, _, value in scalars:
                self._add_input(template, spec, name, value)
            for name in outputs:
                template.outputs.add().name = name
            if spec.decoupled:
                template.parameters["triton_enable_empty_final_response"].bool_param = True
            if len(self._templates) < 1024:  # bounded: per-request values (a seed) are not kept
                self._templates[key] = template
        msg = service_pb2.ModelInferRequest()
        msg.CopyFrom(template)
        msg.id = request_id
        for name, value in inputs.items():
            if type(value) not in _SCALARS:
                self._add_input(msg, spec, name, value)
        return msg

    def _add_input(self, msg, spec: Spec, name: str, value: Any) -> None:
        from tritonclient.utils import serialize_byte_tensor

        arr, triton_type = self._array(spec, name, value)
        t = msg.inputs.add()
        t.name, t.datatype = name, triton_type
        t.shape.extend(arr.shape)
        if triton_type == "BYTES":
            raw = serialize_byte_tensor(arr)
            msg.raw_input_contents.append(raw.item() if raw.size else b"")
        else:
            msg.raw_input_contents.append(arr.tobytes())

    def _stub(self):
        if self._channel is None:
            import grpc
            from tritonclient.grpc import service_pb2_grpc

            opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
            self._channel = grpc.aio.insecure_channel(self.url, options=opts)
            self._stub_obj = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub_obj

    async def _stream(self, model: str, request, after_send=None):
        """The responses of one request on a shared gRPC stream (:class:`_Mux`), until its final one
        (``after_send`` runs once gRPC has written the request). A request left before its end (a client gone, a
        stop string seen here) is stopped on the server."""
        mux = self._mux()
        rid = request.id
        inbox = await mux.submit(request, after_send)
        self._watch()
        finished = heard = False
        try:
            yield SENT
            while True:
                resp = inbox.items.popleft() if inbox.items else await inbox.get()
                heard = heard or not isinstance(resp, BaseException)
                if isinstance(resp, BaseException):
                    if isinstance(resp, APIError):  # the request's own after_send refused it
                        raise resp
                    if isinstance(resp, asyncio.TimeoutError):  # the watchdog's; the server may still generate it
                        raise APIError(504, f"no response from Triton for {self.timeout_s:.0f}s "
                                            f"(serve.openai.limits.request_timeout_s)")
                    finished = True
                    raise _transport_error(resp, self.url)
                if resp.error_message:
                    finished = True
                    raise _triton_error(resp.error_message)
                out = resp.infer_response
                final = out.parameters.get("triton_final_response")
                final = final is not None and final.bool_param
                if final:
                    finished = True
                if out.outputs:
                    yield out
                if final:
                    return
        finally:
            mux.abandon(rid)
            if not finished:
                self._stop_later(rid)
                if not heard:
                    self._stop_again(mux, rid)

    def _watch(self) -> None:
        """Start the watchdog that fails a request whose stream has been silent for ``timeout_s`` (one task for all
        requests, instead of a timer armed and cancelled around every wait for a response)."""
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.ensure_future(self._watchdog_loop())

    async def _watchdog_loop(self) -> None:
        loop = asyncio.get_running_loop()
        period = max(0.01, min(1.0, self.timeout_s / 10))
        while any(m.routes for m in self._muxes):
            await asyncio.sleep(period)
            now = loop.time()
            for m in self._muxes:
                for inbox in list(m.routes.values()):
                    if now - inbox.last > self.timeout_s and not inbox.timed_out:
                        inbox.timed_out = True
                        inbox.put(asyncio.TimeoutError())

    def _mux(self) -> "_Mux":
        """A shared stream with no write in flight (taken in turn); a new one while every stream is writing, up to
        ``streams``; else the one with the fewest requests waiting to be written."""
        n = len(self._muxes)
        for k in range(n):
            m = self._muxes[(self._next + k) % n]
            if not m.writing:
                self._next = (self._next + k + 1) % n
                return m
        if n < self.streams:
            self._muxes.append(_Mux(self._stub))
            return self._muxes[-1]
        return min(self._muxes, key=lambda m: len(m.backlog))

    def _stop_later(self, request_id: str) -> None:
        """Stop a generation left before its end: upstream's ``stop`` request to the ``tensorrt_llm`` model with the
        same request id (as ``inflight_batcher_llm_client.py --stop-after-ms`` stops one; both layouts' models
        take it). Requests share gRPC streams, and Triton 2.51 does not pass an ensemble's cancellation on to its
        steps, so a cancelled stream would not reach the generation."""
        target = self.llm if self.served.layout == "inflight_batcher_llm" else self.entry
        if target is None or "stop" not in target.inputs:
            return
        task = asyncio.ensure_future(self._stop(target, request_id))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _stop_again(self, mux: "_Mux", request_id: str) -> None:
        """For a request left before Triton answered it: the stop may reach the model before the request does (the
        ensemble's preprocessing runs first), and a model does not know an id it has not seen. So stop it again
        after 0.05, 0.25 and 1 s, until Triton answers for it; then once more, unless that answer was its last."""
        answered = []

        def on_answer(final: bool) -> None:
            answered.append(True)
            if not final:
                self._stop_later(request_id)

        async def retry() -> None:
            for delay in (0.05, 0.2, 0.75):
                await asyncio.sleep(delay)
                if answered:
                    return
                self._stop_later(request_id)
            mux.later.pop(request_id, None)

        mux.on_first_answer(request_id, on_answer)
        task = asyncio.ensure_future(retry())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _stop(self, spec: Spec, request_id: str) -> None:
        eos = self.served.eos_id or 0
        dummy = {"input_ids": [eos], "input_lengths": 1, "request_output_len": 1, "text_input": ""}
        values = {k: dummy.get(k, 0) for k in spec.required}
        values["stop"] = True
        try:
            msg = self._request(spec, values, [], request_id)
            if spec.decoupled:
                call = self._stub().ModelStreamInfer(_once(msg), timeout=30)
                try:
                    async for _ in call:
                        break
                finally:
                    call.cancel()
            else:
                await self._stub().ModelInfer(msg, timeout=30)
        except Exception:
            pass  # best effort: the generation may have ended meanwhile

    async def _unary(self, request, after_send=None):
        import grpc

        try:
            call = self._stub().ModelInfer(request, timeout=self.timeout_s)
            if after_send is not None:
                await asyncio.sleep(0)  # the call starts
                problem = after_send()
                if problem is not None:
                    call.cancel()
                    raise problem
            resp = await call
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise _transport_error(exc, self.url) from None
            raise _triton_error(exc.details() or str(exc)) from None
        return resp

    # --- responses ---------------------------------------------------------------------------------------------
    def _delta(self, kind: str, resp, req: GenRequest, state: dict) -> Delta:
        """One ``ModelInferResponse`` -> what it adds."""
        if kind == "text":  # the common streamed chunk: read from the raw tensors, without InferResult's numpy
            fast = _text_delta(resp)
            if fast is not None:
                return fast
        from tritonclient.grpc import InferResult

        result = InferResult(resp)
        if kind == "text":
            out = result.as_numpy("text_output")
            text = "" if out is None else "".join(x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
                                                  for x in out.reshape(-1))
            n = result.as_numpy("num_output_tokens")
            return Delta(text=text, num_output_tokens=None if n is None or not n.size else int(n.reshape(-1)[0]))
        if kind == "llmapi":
            out = result.as_numpy("text_output")
            whole = "" if out is None else "".join(x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
                                                   for x in out.reshape(-1))
            reason = result.as_numpy("finish_reason")
            reason = None if reason is None or not reason.size else _s(reason.reshape(-1)[0])
            prev = state["so_far"]
            if whole.startswith(prev):
                new = whole[len(prev):]
            else:  # a unary answer, or a text that was re-decoded: whatever is new beyond the common prefix
                common = len(_common_prefix(prev, whole))
                new = whole[common:]
            state["so_far"] = whole
            return Delta(text=new, finish_reason=reason if reason not in ("None", "") else None)
        # token level
        ids_arr = result.as_numpy("output_ids")
        lens = result.as_numpy("sequence_length")
        new_ids: list[int] = []
        if ids_arr is not None and ids_arr.size:
            row = ids_arr.reshape(-1)
            n = int(lens.reshape(-1)[0]) if lens is not None and lens.size else row.size
            new_ids = [int(x) for x in row[:n]]
        lps: list[TokenLogprob] | None = None
        if req.prompt_logprobs and not state["prompt_done"]:
            ctx = result.as_numpy("context_logits")
            if ctx is None:
                raise APIError(400, "the served tensorrt_llm model returned no context_logits: prompt log "
                                    "probabilities (echo with logprobs) need an engine built with "
                                    "--gather_context_logits", param="echo")
            state["prompt_done"] = True
            ctx = ctx.reshape(-1, ctx.shape[-1])[-len(req.prompt_ids):]
            plp = [TokenLogprob(req.prompt_ids[0], None)]
            for i in range(1, len(req.prompt_ids)):
                lp, top = _top(ctx[i - 1], req.logprobs or 0)
                plp.append(TokenLogprob(req.prompt_ids[i], float(lp[req.prompt_ids[i]]), top))
            state["prompt_lps"] = plp
            eos = self.served.eos_id
            if eos is not None and not req.ignore_eos:
                # the last row predicts the first generated token: an end id generated first (which TensorRT-LLM
                # leaves out of output_ids and its log probs) still gets its entry, as vLLM and OpenAI return it
                lp, top = _top(ctx[len(req.prompt_ids) - 1], req.logprobs or 0)
                state["eos_first"] = TokenLogprob(eos, float(lp[eos]), top)
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
                    lp, top = _top(row, req.logprobs)
                    lps.append(TokenLogprob(tok, float(lp[tok]), top))
            else:
                olp = result.as_numpy("output_log_probs")
                flat = [] if olp is None else [float(x) for x in olp.reshape(-1)]
                total = len(state["ids"]) + len(new_ids)
                vals = flat[total - len(new_ids):total] if len(flat) >= total else flat[-len(new_ids):]
                if len(vals) != len(new_ids):
                    raise APIError(500, "the served tensorrt_llm model returned fewer output_log_probs than tokens")
                lps = [TokenLogprob(t, v) for t, v in zip(new_ids, vals)]
        state["ids"] += new_ids
        text = self.served.decode(state["ids"])
        emit = ""
        if not text.endswith("\ufffd"):  # a character still incomplete waits for its next token
            emit = text[len(state["sent_text"]):] if text.startswith(state["sent_text"]) else \
                text[len(_common_prefix(state["sent_text"], text)):]
            state["sent_text"] = text
        plps, state["prompt_lps"] = state.get("prompt_lps"), None
        return Delta(text=emit, ids=new_ids, logprobs=lps, num_output_tokens=len(state["ids"]), prompt_logprobs=plps)

    def _flush(self, kind: str, state: dict) -> str:
        """The token path's text held back at the end (an incomplete character is final now)."""
        if kind != "tokens":
            return ""
        text, sent = self.served.decode(state["ids"]), state["sent_text"]
        rest = text[len(sent):] if text.startswith(sent) else text[len(_common_prefix(sent, text)):]
        state["sent_text"] = text
        return rest

    # --- inputs ------------------------------------------------------------------------------------------------
    @staticmethod
    def _token_param(req: GenRequest) -> str:
        return "echo" if req.prompt_logprobs else "logprobs" if req.logprobs is not None else "prompt"

    def _why_not_token_level(self, req: GenRequest) -> str:
        if req.prompt_logprobs:
            return ("echo with logprobs needs prompt log probabilities, which the llmapi layout's tensorrt_llm model "
                    "does not return (its outputs: text, finish reason, cumulative log prob); serve the "
                    "inflight_batcher_llm layout for log-likelihood evaluation")
        if req.logprobs is not None:
            return ("logprobs: the llmapi layout's tensorrt_llm model returns no per-token log probabilities (only "
                    "cumulative_logprob); serve the inflight_batcher_llm layout for them")
        return "prompt as token ids: the llmapi layout's tensorrt_llm model takes text only (text_input)"

    def _sampling(self, spec: Spec, req: GenRequest, names: dict[str, str], out: dict[str, Any]) -> None:
        """OpenAI sampling -> TensorRT-LLM's: temperature 0 is greedy (top-k 1); otherwise sample with top-p 1
        unless top-p or top-k is given."""
        if req.temperature == 0.0:
            out[names["top_k"]] = 1
        else:
            if req.temperature != 1.0:
                out[names["temperature"]] = req.temperature
            if req.top_k not in (None, 0, -1):
                out[names["top_k"]] = req.top_k
            if req.top_p is not None:
                out[names["top_p"]] = req.top_p
            elif req.top_k in (None, 0, -1):
                out[names["top_p"]] = 1.0
        for fld, key in (("seed", "seed"), ("presence_penalty", "presence_penalty"),
                         ("frequency_penalty", "frequency_penalty"), ("repetition_penalty", "repetition_penalty"),
                         ("min_tokens", "min_tokens")):
            v = getattr(req, fld)
            if v is not None and key in names:
                out[names[key]] = v
            elif v is not None:
                raise APIError(400, f"{fld} is not supported by the {self.served.layout} layout's '{spec.name}' "
                                    f"model (it has no input for it)", param=fld)

    def _check(self, spec: Spec, inputs: dict[str, Any], fields: dict[str, str]) -> None:
        """Every input must exist in the served model; name the request field that asked for a missing one."""
        for name in inputs:
            if name not in spec.inputs:
                fld = fields.get(name, name)
                raise APIError(400, f"{fld} is not supported by the {self.served.layout} layout's '{spec.name}' "
                                    f"model (it has no input '{name}')", param=fld)

    def _text_inputs(self, spec: Spec, req: GenRequest) -> dict[str, Any]:
        lay = self.layout
        out: dict[str, Any] = {lay.text_input: req.prompt_text, lay.max_tokens: req.max_tokens}
        if lay.exclude_input in spec.inputs:
            out[lay.exclude_input] = True
        names = {k: k for k in ("temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty",
                                "repetition_penalty", "min_tokens")}
        self._sampling(spec, req, names, out)
        if req.stop:
            out["stop_words"] = list(req.stop)
        if req.ignore_eos:
            out["end_id"] = -1
        if "return_num_output_tokens" in spec.inputs:
            out["return_num_output_tokens"] = True
        self._check(spec, out, {"stop_words": "stop", "end_id": "ignore_eos", "top_k": "top_k"})
        return out

    def _token_inputs(self, spec: Spec, req: GenRequest) -> dict[str, Any]:
        ids = req.prompt_ids
        eos, pad = self.served.eos_id, self.served.pad_id
        out: dict[str, Any] = {"input_ids": ids, "input_lengths": len(ids), "request_output_len": req.max_tokens,
                               "end_id": -1 if req.ignore_eos or eos is None else eos,
                               "pad_id": pad if pad is not None else 0}
        if "exclude_input_in_output" in spec.inputs:
            out["exclude_input_in_output"] = True
        names = {"temperature": "temperature", "top_k": "runtime_top_k", "top_p": "runtime_top_p", "seed": "seed",
                 "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                 "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens"}
        self._sampling(spec, req, names, out)
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
        self._check(spec, out, {"stop_words_list": "stop", "return_log_probs": "logprobs",
                                "return_generation_logits": "logprobs", "return_context_logits": "echo"})
        return out

    def _llmapi_inputs(self, spec: Spec, req: GenRequest) -> dict[str, Any]:
        lay = self.layout
        out: dict[str, Any] = {lay.text_input: req.prompt_text, lay.max_tokens: req.max_tokens}
        if lay.exclude_input in spec.inputs:
            out[lay.exclude_input] = True
        if "return_finish_reason" in spec.inputs:
            out["return_finish_reason"] = True
        names = {k: f"sampling_param_{k}" for k in ("temperature", "top_k", "top_p", "seed", "presence_penalty",
                                                    "frequency_penalty", "repetition_penalty", "min_tokens")}
        names = {k: v for k, v in names.items() if v in spec.inputs}
        self._sampling(spec, req, names, out)
        if req.stop:
            out["sampling_param_stop"] = list(req.stop)
        if req.ignore_eos:
            if "sampling_param_ignore_eos" not in spec.inputs:
                raise APIError(400, f"ignore_eos is not supported by the llmapi layout's '{spec.name}' model (it has "
                                    f"no input 'sampling_param_ignore_eos')", param="ignore_eos")
            out["sampling_param_ignore_eos"] = True
        self._check(spec, out, {"sampling_param_stop": "stop", **{v: k for k, v in names.items()}})
        return out

    def _set(self, spec: Spec, inputs: dict, name: str, value: Any) -> None:
        if name in spec.inputs:
            inputs[name] = value

    def _array(self, spec: Spec, name: str, value: Any) -> tuple[np.ndarray, str]:
        dtype, dims = spec.inputs[name]
        np_type, triton_type = NP[dtype]
        if isinstance(value, np.ndarray):
            arr = value.astype(np_type)
            if not spec.batched and arr.ndim > len(dims):
                arr = arr.reshape(arr.shape[1:])
        else:
            if isinstance(value, str):
                value = value.encode("utf-8")
            vals = value if isinstance(value, list) else [value]
            if np_type is object:
                vals = [v.encode("utf-8") if isinstance(v, str) else v for v in vals]
            arr = np.array(vals, dtype=np_type)
            if spec.batched:
                arr = arr.reshape(1, -1)
        return arr, triton_type


_SCALARS = (bool, int, float)


SENT = object()  # what :meth:`Driver.generate` yields first: the request is on its way


class _Inbox:
    """One request's responses as the stream's reader routes them: a deque and at most one waiting consumer (what
    an ``asyncio.Queue`` does, without its bookkeeping per item); ``last`` is when something last arrived."""

    __slots__ = ("items", "waiter", "last", "timed_out", "loop")

    def __init__(self, loop):
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.loop = loop
        self.last = loop.time()
        self.timed_out = False

    def put(self, item) -> None:
        self.items.append(item)
        self.last = self.loop.time()
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self):
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


class _Mux:
    """One long-lived gRPC stream (``ModelStreamInfer``) that carries many requests: responses are routed by
    request id to each request's inbox. A request is written by the task that submits it, at once, unless a write
    is in flight on this stream (gRPC allows one at a time): it then waits in ``backlog`` and the writing task
    writes it next. A broken stream fails its requests and is reopened by the next one."""

    def __init__(self, stub_factory):
        self.stub_factory = stub_factory
        self.routes: dict[str, _Inbox] = {}
        self.call = None
        self.reader: asyncio.Task | None = None
        self.writing = False
        self.backlog: collections.deque = collections.deque()  # (request, after_send) waiting for the write
        self.later: collections.OrderedDict[str, Any] = collections.OrderedDict()  # see on_first_answer

    def on_first_answer(self, request_id: str, then) -> None:
        """Call ``then(final)`` when the first response for an abandoned request arrives (at most 1024 kept)."""
        self.later[request_id] = then
        while len(self.later) > 1024:
            self.later.popitem(last=False)

    async def submit(self, request, after_send=None) -> _Inbox:
        """Route the request's responses to a new inbox and write the request (or leave it to the write in flight).
        Its ``after_send`` runs once it is written: work that can wait for the response is done while Triton works,
        and the next request is not held up by it."""
        if self.reader is None or self.reader.done():
            self.call = self.stub_factory().ModelStreamInfer()  # no request iterator: written with call.write
            self.reader = asyncio.ensure_future(self._read(self.call))
            self.backlog.clear()  # a broken stream's reader has failed their requests
        inbox = _Inbox(asyncio.get_running_loop())
        self.routes[request.id] = inbox
        if self.writing:
            self.backlog.append((request, after_send))
            return inbox
        self.writing = True
        call, item = self.call, (request, after_send)
        try:
            while item is not None:
                msg, then = item
                try:
                    await call.write(msg)
                except Exception as exc:  # noqa: BLE001 - the stream broke: this request and those waiting fail
                    for m, _ in [item, *self.backlog]:
                        if m.id in self.routes:
                            self.routes[m.id].put(exc)
                    self.backlog.clear()
                    break
                if then is not None:
                    self._after_send(msg.id, then)
                item = self.backlog.popleft() if self.backlog else None
        finally:
            self.writing = False
        return inbox

    def abandon(self, request_id: str) -> None:
        self.routes.pop(request_id, None)

    def _after_send(self, request_id: str, after_send) -> None:
        """Run a request's ``after_send``; an error it returns (or raises) goes to the request's inbox."""
        try:
            problem = after_send()
        except Exception as exc:  # noqa: BLE001 - the request fails with it, not the shared stream
            problem = exc
        inbox = self.routes.get(request_id)
        if problem is not None and inbox is not None:
            inbox.put(problem)

    async def _read(self, call) -> None:
        problem: BaseException | None = None
        try:
            async for resp in call:
                rid = resp.infer_response.id
                inbox = self.routes.get(rid)
                if inbox is not None:
                    inbox.put(resp)
                elif self.later:
                    then = self.later.pop(rid, None)
                    if then is not None:
                        final = resp.infer_response.parameters.get("triton_final_response")
                        then(final is not None and final.bool_param)
        except asyncio.CancelledError:
            call.cancel()
            raise
        except BaseException as exc:  # the stream broke (server gone): every request on it fails
            problem = exc
        problem = problem or ConnectionError("the gRPC stream to Triton closed")
        for inbox in self.routes.values():
            inbox.put(problem)
        self.routes.clear()

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()  # cancels the call
            await asyncio.gather(self.reader, return_exceptions=True)


async def _once(msg):
    yield msg


def _text_delta(resp) -> Delta | None:
    """``text_output`` (BYTES) and ``num_output_tokens`` (INT32/INT64) of a text response, straight from
    ``raw_output_contents`` (tritonclient's ``deserialize_bytes_tensor``, without ``InferResult``'s numpy arrays per
    output); None when the response is not in that form (the caller falls back to ``InferResult``)."""
    import struct

    from tritonclient.utils import deserialize_bytes_tensor

    raw = resp.raw_output_contents
    if len(raw) != len(resp.outputs):
        return None
    text, n = "", None
    for out, buf in zip(resp.outputs, raw):
        if out.name == "text_output":
            if out.datatype != "BYTES":
                return None
            try:
                text = b"".join(deserialize_bytes_tensor(buf)).decode("utf-8", "replace")
            except struct.error:  # a length prefix that runs past the buffer
                return None
        elif out.name == "num_output_tokens":
            width = {"INT32": 4, "INT64": 8}.get(out.datatype)
            if width is None or len(buf) < width:
                return None
            n = int.from_bytes(buf[:width], "little", signed=True)
    return Delta(text=text, num_output_tokens=n)


def _s(x) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def _transport_error(exc, url: str) -> APIError:
    return APIError(503, f"Triton at {url} is not available: {str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}")


def _triton_error(exc) -> APIError:
    """A Triton error -> the status a client should see: the server not ready -> 503; the model's own fault (the
    reference runtime words it ``internal error``) -> 500; a request the model refused -> 400 with its message."""
    msg = str(exc).strip()
    low = msg.lower()
    if "failed to connect" in low or "connection refused" in low or "not ready" in low or "unavailable" in low:
        return APIError(503, f"Triton is not available: {msg.splitlines()[0][:300]}")
    if "cancel" in low:
        return APIError(499, "the request was cancelled")
    if "internal error" in low:
        return APIError(500, f"the model failed: {msg.splitlines()[0][:500]}")
    return APIError(400, f"the model refused the request: {msg.splitlines()[0][:500]}")
