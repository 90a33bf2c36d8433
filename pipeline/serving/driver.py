"""Generation over Triton's gRPC API (``tritonclient.grpc.aio``), through the layout's own entry points. What goes in
and comes out is the layout's codec (its folder's ``openai_codec.py``, ``pipeline/triton/layouts/<name>/``): an
OpenAI request becomes the entry point's tensors, each response a :class:`~pipeline.triton.layouts.contract.Delta`.
The tensor names and types are those of the layout's interface (NVIDIA's recorded upstream one for
``inflight_batcher_llm`` and ``llmapi``), read back from the server's own model configs at start-up; an input a request needs and the model lacks
is a 400 naming both.

Transport (``pipeline.serving.transport``): model configs and readiness through ``tritonclient.grpc.aio``; requests
as Triton's own protobufs (the ``service_pb2`` that ``tritonclient.grpc`` ships) on ``grpc.aio``. A decoupled model's
requests share long-lived bidirectional streams, written at once by the task that makes them; a unary model gets
``ModelInfer``, cancelled with its call. A request left before its end is stopped with upstream's ``stop`` request
for its id (the codec names the model that takes it). A request whose stream stays silent for the request timeout is
a 504.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import numpy as np

from pipeline.serving import observe
from pipeline.serving.model import ServedModel
from pipeline.serving.transport import Mux, StreamPool, once
from pipeline.triton import layouts
from pipeline.triton.layouts.contract import APIError, Delta, GenRequest, Spec

NP = {"TYPE_BOOL": (np.bool_, "BOOL"), "TYPE_INT32": (np.int32, "INT32"), "TYPE_INT64": (np.int64, "INT64"),
      "TYPE_UINT64": (np.uint64, "UINT64"), "TYPE_FP32": (np.float32, "FP32"), "TYPE_FP16": (np.float16, "FP16"),
      "TYPE_STRING": (object, "BYTES"), "TYPE_UINT8": (np.uint8, "UINT8")}
SENT = object()  # what :meth:`Driver.generate` yields first: the request is on its way
_SCALARS = (bool, int, float)


class Driver:
    """Talks to one Triton server for one served model."""

    def __init__(self, url: str, served: ServedModel, entry: str | None = None, timeout_s: float = 600.0):
        self.url, self.served, self.timeout_s = url, served, timeout_s
        self.down: str | None = None  # why the server is gone, set by whoever watches it (pipeline serve)
        self.why_down = None  # () -> why the server is gone, or None while it runs (pipeline serve sets it)
        self.metrics_url: str | None = None  # Triton's metrics (http://HOST:PORT/metrics), where pipeline serve has it
        self.layout = layouts.get(served.layout)  # its entry points and text-request tensors
        self.codec = self.layout.codec(served)  # OpenAI requests <-> its tensors
        self.entry_name = entry or self.layout.entry_points[0]
        self.client = None
        self.entry: Spec | None = None
        self.side: dict[str, Spec] = {}  # the codec's side models that the server serves (its tensorrt_llm)
        self._pending: set = set()  # stop requests in flight
        self._channel = None
        self._stub_obj = None
        self.pool = StreamPool(self._stub, timeout_s)  # the shared gRPC streams and their watchdog
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
        await self.pool.close()
        if self._channel is not None:
            await self._channel.close()
        if self.client is not None:
            await self.client.close()

    async def reconnect(self, url: str) -> None:
        """Talk to the server at ``url`` from now on (a restarted Triton, on new ports): the old connection, its
        streams and what was read from the old server's model configs are dropped."""
        await self.close()
        self.url, self.entry, self.side = url, None, {}
        self._pending, self._channel, self._stub_obj, self._templates = set(), None, None, {}
        self.pool = StreamPool(self._stub, self.timeout_s)
        await self.start()

    async def down_reason(self) -> str | None:
        """Why the server is gone, asked when a request lost its connection: what the watcher recorded, else its
        own ``why_down`` (in a thread: it may wait a moment for the server's exit status)."""
        if self.down is None and self.why_down is not None:
            with contextlib.suppress(Exception):
                self.down = await asyncio.to_thread(self.why_down)
        return self.down

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
        problem = self.codec.entry_problem(entry)
        if problem:
            raise APIError(503, f"model '{self.entry_name}' on {self.url} is not a {self.served.layout} entry point "
                                f"({problem})")
        side = {}
        for name in self.codec.side_models:
            try:
                if await self.client.is_model_ready(name):
                    side[name] = Spec.from_config((await self.client.get_model_config(name, as_json=True))
                                                  .get("config", {}))
            except Exception:
                pass
        self.entry, self.side = entry, side

    async def specs(self) -> tuple[Spec, dict[str, Spec]]:
        if self.entry is None:
            if not await self.ready():
                down = await self.down_reason()
                if down:
                    raise APIError(503, f"Triton at {self.url} is down: {down}")
                raise APIError(503, f"Triton at {self.url} is not ready to serve '{self.entry_name}'; retry shortly")
        return self.entry, self.side

    # --- requests ----------------------------------------------------------------------------------------------
    async def generate(self, req: GenRequest) -> AsyncIterator[Delta]:
        """:data:`SENT` once the request is on its way to Triton (the caller advances to it in the task that made
        the request), then what each response adds. Closing the generator before the end stops the request."""
        entry, side = await self.specs()
        call = self.codec.call(req, entry, side)
        spec = call.spec
        if call.stream_input in spec.inputs:  # a unary model answers once; the front end still streams that one
            call.inputs[call.stream_input] = req.stream and spec.decoupled
        request = self._request(spec, call.inputs, [o for o in call.outputs if o in spec.outputs], req.request_id)
        decode = call.decode
        record = observe.current()  # the request's metrics and access log see each response arrive
        if spec.decoupled:
            async for resp in self._stream(spec.name, request, req.after_send):
                if resp is SENT:
                    yield SENT
                    continue
                if record is not None:
                    record.response(request.id)
                yield decode(resp)
        else:
            yield SENT  # a unary call starts when it is awaited
            resp = await self._unary(request, req.after_send)
            if record is not None:
                record.response(request.id)
            yield decode(resp)
        for d in call.finish():
            yield d

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

    def _stub(self):
        if self._channel is None:
            import grpc
            from tritonclient.grpc import service_pb2_grpc

            opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
            self._channel = grpc.aio.insecure_channel(self.url, options=opts)
            self._stub_obj = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub_obj

    async def _stream(self, model: str, request, after_send=None):
        """The responses of one request on a shared gRPC stream (:class:`~pipeline.serving.transport.Mux`), until its
        final one (``after_send`` runs once gRPC has written the request). A request left before its end (a client
        gone, a stop string seen here) is stopped on the server."""
        pool = self.pool
        mux = pool.mux()
        rid = request.id
        inbox = await mux.submit(request, after_send)
        pool.watch()
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
                    raise _transport_error(resp, self.url, await self.down_reason())
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

    def _stop_later(self, request_id: str) -> None:
        """Stop a generation left before its end: upstream's ``stop`` request to the model the codec names (the
        ``tensorrt_llm`` model of NVIDIA's layouts) with the same request id (as ``inflight_batcher_llm_client.py
        --stop-after-ms`` stops one). Requests share gRPC streams, and Triton 2.51 does not pass an ensemble's
        cancellation on to its steps, so a cancelled stream would not reach the generation."""
        target = self.codec.stop_target(self.entry, self.side)
        if target is None or "stop" not in target.inputs:
            return
        task = asyncio.ensure_future(self._stop(target, request_id))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _stop_again(self, mux: Mux, request_id: str) -> None:
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
        try:
            msg = self._request(spec, self.codec.stop_inputs(spec), [], request_id)
            if spec.decoupled:
                call = self._stub().ModelStreamInfer(once(msg), timeout=30)
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
                raise _transport_error(exc, self.url, await self.down_reason()) from None
            raise _triton_error(exc.details() or str(exc)) from None
        return resp


def _transport_error(exc, url: str, down: str | None = None) -> APIError:
    """A lost connection to Triton -> 503 with the whole reason: why the server is down where the caller knows it
    (``Driver.down``: its exit code or signal), else the gRPC status and details (an ``AioRpcError``'s ``str`` is a
    multi-line block whose first line says nothing)."""
    if down:
        return APIError(503, f"Triton at {url} is down: {down}")
    code = getattr(exc, "code", None)
    if callable(code):
        with contextlib.suppress(Exception):
            detail = exc.details() or ""
            return APIError(503, f"Triton at {url} is not available: {code().name}: {' '.join(detail.split())[:500]}")
    text = " ".join(str(exc).split())
    return APIError(503, f"Triton at {url} is not available: {text[:500] if text else type(exc).__name__}")


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
