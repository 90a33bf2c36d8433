"""The OpenAI-compatible HTTP front end (Starlette): ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream`` true or false), ``GET /health``.

- Chat prompts are rendered with the model's own chat template (``chat_template_kwargs`` passed through, e.g.
  Qwen3's ``enable_thinking``); a tokenizer without one answers chat with a 400 (completions still work).
- ``max_tokens``/``max_completion_tokens`` default to the remaining context, capped by ``limits.max_tokens``; a
  request that does not fit the context is a 400 saying by how much.
- ``usage``: ``prompt_tokens`` as the layout's tokenizer step encodes the prompt, ``completion_tokens`` the returned
  text re-tokenized (as the bench, genai-perf and aiperf count); ``finish_reason`` ``stop`` or ``length``.
- Stop strings are sent to the model and also enforced on the text (a stop string whose tokens differ in context
  still stops), and are not part of the returned text, as in OpenAI's API.
- Streaming: server-sent events, ``data: [DONE]`` last; ``stream_options.include_usage`` adds a final chunk with the
  usage and no choices (``continuous_usage_stats``: usage in every chunk). A stream's status line goes out once the
  front end's own checks have passed and Triton has either answered or been working on the request for
  ``limits.stream_status_wait_ms`` (the client reads the headers while the first token is made): a problem found
  before that is answered with its HTTP status, a later one as an ``error`` event.
- Errors use OpenAI's schema; a client that goes away cancels its generation on the Triton server.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response as _Response

from pipeline.serving import protocol as P
from pipeline.serving.driver import SENT, Delta, Driver, GenRequest, TokenLogprob
from pipeline.serving.model import ServedModel

log = logging.getLogger("pipeline.serving")


@dataclass
class Settings:
    api_key: str | None = None  # required as "Authorization: Bearer KEY" when set
    max_body_bytes: int = 8 << 20
    max_tokens: int = 4096  # the default max_tokens is the remaining context, capped here
    request_timeout_s: float = 600.0
    stream_status_wait_s: float = 0.005  # a stream's status waits this long for Triton's verdict (module docstring)


# ------------------------------------------------------------------------------------------------ stop strings
class StopScanner:
    """Cuts the text at the first stop string; holds back a tail that may be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.hit = False

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        buf = self.pending + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self.pending = True, ""
            return buf[:cut]
        safe = len(buf) - self.keep if self.keep else len(buf)
        # hold back only what could begin a stop string
        while safe < len(buf) and not any(s.startswith(buf[safe:]) for s in self.stops):
            safe += 1
        self.pending = buf[max(safe, 0):]
        return buf[:max(safe, 0)]

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# --------------------------------------------------------------------------------------------------- helpers
def _now() -> int:
    return int(time.time())


def _json(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _error_response(exc: P.APIError):
    from starlette.responses import Response

    # what the client is told, logged here too: a server fault as an error, a refused request at info level
    log.log(logging.ERROR if exc.status >= 500 else logging.INFO, "%d %s", exc.status, exc.message)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return Response(_json(exc.body()), status_code=exc.status, media_type="application/json", headers=headers)


@dataclass
class _Job:
    """One prompt's generation as the endpoint sees it."""

    index: int
    gen: GenRequest
    prompt_tokens: int | None  # None until counted (:meth:`FrontEnd.settle`)
    echo_text: str  # the prompt text, when echoed
    text: str = ""
    finish: str | None = None
    num_output_tokens: int | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    completion_tokens: int = 0
    zero: bool = False  # max_tokens=0 with echo: the prompt's log probs only
    check: "Callable[[int], Any] | None" = None  # the prompt's checks that need its token count, run once counted
    problem: "P.APIError | None" = None  # what those checks found
    counted: "asyncio.Future | None" = None  # done once those checks have run
    agen: "AsyncIterator[Delta] | None" = None  # the driver's generation, once started (:meth:`FrontEnd.start`)


class FrontEnd:
    def __init__(self, served: ServedModel, driver: Driver, settings: Settings):
        self.served, self.driver, self.settings = served, driver, settings

    # --- request checks ---------------------------------------------------------------------------------------
    def authorize(self, request) -> None:
        key = self.settings.api_key
        if not key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise P.APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                             code="invalid_api_key")

    async def body(self, request) -> dict:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise P.APIError(413, f"request body of {int(declared)} bytes is over the limit of {limit} bytes "
                                  f"(serve.openai.limits.max_body_bytes)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise P.APIError(413, f"request body is over the limit of {limit} bytes "
                                      f"(serve.openai.limits.max_body_bytes)")
            chunks.append(chunk)
        try:
            data = json.loads(b"".join(chunks) or b"null")
        except ValueError as exc:
            raise P.APIError(400, f"the body is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise P.APIError(400, "the body must be a JSON object")
        return data

    def check_model(self, name: str) -> None:
        if name != self.served.name:
            raise P.APIError(404, f"The model '{name}' does not exist; this server serves '{self.served.name}' "
                                  f"(GET /v1/models)", param="model", code="model_not_found")

    def _budget(self, prompt_tokens: int | None, asked: int | None, param: str) -> int:
        """``max_tokens`` for a prompt of ``prompt_tokens`` (None: not counted yet, which :meth:`_can_count_later`
        allows only where the answer does not depend on it); a prompt that does not fit is a 400."""
        ctx = self.served.max_seq_len
        if prompt_tokens is None:
            return asked if asked is not None else self.settings.max_tokens
        if ctx is not None and prompt_tokens >= ctx:
            raise P.APIError(400, f"This model's maximum context length is {ctx} tokens; the prompt has "
                                  f"{prompt_tokens} tokens", param="messages" if param == "max_completion_tokens"
                             else "prompt", code="context_length_exceeded")
        if asked is None:
            room = (ctx - prompt_tokens) if ctx is not None else self.settings.max_tokens
            return max(1, min(room, self.settings.max_tokens))
        if ctx is not None and prompt_tokens + asked > ctx:
            raise P.APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                  f"{prompt_tokens + asked} tokens ({prompt_tokens} in the prompt, {asked} in the "
                                  f"completion); lower {param}", param=param, code="context_length_exceeded")
        return asked

    def _gen(self, req, prompt_text: str | None, prompt_ids: list[int] | None, max_tokens: int,
             prompt_logprobs: bool) -> GenRequest:
        return GenRequest(
            prompt_text=prompt_text, prompt_ids=prompt_ids, max_tokens=max_tokens, stream=req.stream,
            temperature=1.0 if req.temperature is None else req.temperature, top_p=req.top_p, top_k=req.top_k,
            seed=req.seed, stop=req.stops(), presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            min_tokens=req.min_tokens or None, ignore_eos=req.ignore_eos, logprobs=req.num_logprobs(),
            prompt_logprobs=prompt_logprobs, request_id=uuid.uuid4().hex[:16])

    def chat_jobs(self, req: P.ChatRequest) -> list[_Job]:
        if not self.served.has_chat_template:
            raise P.APIError(400, f"the model '{self.served.name}' has no chat template (its tokenizer defines "
                                  f"none); use /v1/completions with a plain prompt", param="messages")
        messages = []
        for i, m in enumerate(req.messages):
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
            if m.name:
                msg["name"] = m.name
            messages.append(msg)
        try:
            text = self.served.render_chat(messages, req.add_generation_prompt, req.chat_template_kwargs)
        except Exception as exc:  # jinja raises TemplateError (and the template's own raise_exception)
            raise P.APIError(400, f"the chat template refused the messages: {exc}", param="messages") from None
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        token_level = req.num_logprobs() is not None
        if not token_level and self._can_count_later(req.limit()):
            job = _Job(0, self._gen(req, text, None, self._budget(None, req.limit(), param), False), None, "")
            self._count_later(job, text, lambda n: self._budget(n, req.limit(), param))
            return [job]
        ids = self.served.encode_prompt(text)
        max_tokens = self._budget(len(ids), req.limit(), param)
        return [_Job(0, self._gen(req, text, ids if token_level else None, max_tokens, False), len(ids), "")]

    def completion_jobs(self, req: P.CompletionRequest) -> list[_Job]:
        jobs = []
        prompt_logprobs = bool(req.echo and req.logprobs is not None)
        prompts = req.prompts()
        for i, p in enumerate(prompts):
            if isinstance(p, list):
                if not p or not all(isinstance(x, int) for x in p):
                    raise P.APIError(400, f"prompt[{i}]: a token prompt is a non-empty list of token ids",
                                     param="prompt")
                vocab = len(self.served.tokenizer)
                bad = [x for x in p if x < 0 or x >= vocab]
                if bad:
                    raise P.APIError(400, f"prompt[{i}]: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                                     param="prompt")
                text, ids = self.served.decode(p), list(p)
            else:
                text, ids = p, None
            if ids is None and (prompt_logprobs or req.logprobs is not None):
                ids = self.served.encode_prompt(text)
            asked = req.limit()
            if asked == 0 and not req.echo:
                raise P.APIError(400, "max_tokens=0 generates nothing; it is allowed only with echo", param="max_tokens")
            budget = asked or (1 if asked == 0 else None)
            empty = f"prompt[{i}] is empty" if len(prompts) > 1 else "prompt is empty"

            def checks(count: int, budget=budget, empty=empty) -> int:
                if count == 0:
                    raise P.APIError(400, empty, param="prompt")
                return self._budget(count, budget, "max_tokens")

            if ids is None and text and self._can_count_later(budget):  # an empty text: counted now
                job = _Job(i, self._gen(req, text, None, self._budget(None, budget, "max_tokens"), False), None,
                           text if req.echo else "")
                self._count_later(job, text, checks)
            else:
                count = len(ids) if ids is not None else len(self.served.encode_prompt(text))
                job = _Job(i, self._gen(req, text, ids, checks(count), prompt_logprobs), count,
                           text if req.echo else "")
            job.zero = asked == 0  # echo only: the one token generated for the prompt's log probs is not returned
            jobs.append(job)
        return jobs

    # --- the prompt's token count, while Triton works on it --------------------------------------------------
    def _can_count_later(self, asked: int | None) -> bool:
        """Whether the request to Triton can be made without the prompt's token count: its ``max_tokens`` is
        given, or the context length is unknown (the default is then the configured cap). The count, and the
        checks that need it, then run once the request is on its way (:meth:`settle`)."""
        return asked is not None or self.served.max_seq_len is None

    def _count_later(self, job: _Job, text: str, checks: Callable[[int], Any]) -> None:
        job.check = checks
        job.counted = asyncio.get_running_loop().create_future()
        job.gen.after_send = lambda: self.settle(job, text)

    def settle(self, job: _Job, text: str | None = None) -> P.APIError | None:
        """Count the prompt's tokens (once) and run the checks that need the count. A failed check is kept in
        ``job.problem`` and returned: the driver then ends the request, and :meth:`run` answers with it before
        anything else."""
        if job.prompt_tokens is None:
            job.prompt_tokens = len(self.served.encode_prompt(job.gen.prompt_text if text is None else text))
            try:
                job.check(job.prompt_tokens)
            except P.APIError as exc:
                job.problem = exc
            if job.counted is not None and not job.counted.done():
                job.counted.set_result(None)
        return job.problem

    # --- generation -------------------------------------------------------------------------------------------
    async def start(self, jobs: list[_Job]) -> None:
        """Send each job's request to Triton now, in the caller's task: the first request of a burst is on its way
        before the next one is parsed. A job that cannot start (a 400 of the driver's) closes those started."""
        try:
            for job in jobs:
                job.agen = self.driver.generate(job.gen)
                if await job.agen.__anext__() is not SENT:
                    raise RuntimeError("the driver's generation did not start with SENT")
        except BaseException:
            await self.close(jobs)
            raise

    @staticmethod
    async def close(jobs: list[_Job]) -> None:
        """Close every job's generation (a request still running is stopped on the server; closing one that has
        ended does nothing)."""
        for job in jobs:
            if job.agen is not None:
                await job.agen.aclose()

    async def run(self, job: _Job) -> AsyncIterator[str]:
        """Yield the job's new text pieces (stop strings applied) and keep its record up to date; the job was
        started by :meth:`start`."""
        scanner = StopScanner(job.gen.stop)
        zero = job.zero
        reason = None
        agen = job.agen
        settled = job.check is None
        try:
            async for d in agen:
                if not settled:  # the prompt's own checks come before anything it returns
                    settled = True
                    if self.settle(job) is not None:
                        raise job.problem
                if d.prompt_logprobs is not None:
                    job.prompt_logprobs = d.prompt_logprobs
                if zero:
                    continue
                if d.logprobs:
                    job.logprobs = (job.logprobs or []) + d.logprobs
                if d.num_output_tokens is not None:
                    job.num_output_tokens = d.num_output_tokens
                if d.finish_reason:
                    reason = d.finish_reason
                piece = scanner.feed(d.text) if d.text else ""
                if piece:
                    job.text += piece
                    yield piece
                if scanner.hit:
                    break
        except P.APIError:
            if not settled and self.settle(job) is not None:  # refused for its count (by the checks or Triton)
                raise job.problem from None
            raise
        finally:
            await agen.aclose()  # a stop string or a client gone: the Triton request is cancelled
        if not settled and self.settle(job) is not None:  # nothing came back at all
            raise job.problem
        if not scanner.hit:
            tail = scanner.flush()
            if tail:
                job.text += tail
                yield tail
        # the engine's own count where the layout reports it and the text was not cut here; else the returned text
        # re-tokenized (as the bench counts)
        exact = job.num_output_tokens is not None and not scanner.hit and not zero
        job.completion_tokens = job.num_output_tokens if exact else self.served.count(job.text)
        if zero:
            job.finish = "length"
        elif scanner.hit:
            job.finish = "stop"
        elif reason in ("stop", "length"):
            job.finish = reason
        else:
            n = job.num_output_tokens if job.num_output_tokens is not None else job.completion_tokens
            job.finish = "length" if n >= job.gen.max_tokens else "stop"

    # --- responses --------------------------------------------------------------------------------------------
    def _usage(self, jobs: list[_Job]) -> dict:
        p = sum(j.prompt_tokens for j in jobs)
        c = sum(j.completion_tokens for j in jobs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def completion_logprobs(self, job: _Job, echo: bool, offset0: int = 0) -> dict | None:
        if job.gen.logprobs is None:
            return None
        items: list[TokenLogprob] = []
        if echo and job.prompt_logprobs:
            items += job.prompt_logprobs
        items += job.logprobs or []
        tokens, lps, tops, offsets = [], [], [], []
        pos = offset0
        for it in items:
            s = self.served.token_str(it.token_id)
            tokens.append(s)
            lps.append(it.logprob)
            offsets.append(pos)
            pos += len(s)
            if it.logprob is None:
                tops.append(None)
            else:
                top = {self.served.token_str(t): lp for t, lp in it.top}
                if job.gen.logprobs:
                    top.setdefault(s, it.logprob)
                tops.append(top if job.gen.logprobs else None)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, items: list[TokenLogprob] | None) -> dict | None:
        if items is None:
            return None

        def one(t: int, lp: float) -> dict:
            s = self.served.token_str(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {"content": [{**one(it.token_id, it.logprob), "top_logprobs": [one(t, lp) for t, lp in it.top]}
                            for it in items], "refusal": None}


# ------------------------------------------------------------------------------------------------------ app
def create_app(served: ServedModel, driver: Driver, settings: Settings | None = None):
    """The ASGI application: plain Starlette routes (request in, response out, no dependency injection on the
    request path), OpenAI's error schema for every error."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    settings = settings or Settings()
    fe = FrontEnd(served, driver, settings)

    @asynccontextmanager
    async def lifespan(app):
        app.state.loop = asyncio.get_running_loop()
        await driver.start()
        try:
            yield
        finally:
            await driver.close()

    async def _api_error(request, exc: P.APIError):
        return _error_response(exc)

    async def _http_error(request, exc):
        status = exc.status_code
        msg = f"no route {request.method} {request.url.path}" if status in (404, 405) else str(exc.detail)
        return _error_response(P.APIError(status, msg))

    async def _internal(request, exc):
        return _error_response(P.APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    async def health(request: Request):
        if await driver.ready():
            return JSONResponse({"status": "ok"})
        return _error_response(P.APIError(503, f"Triton at {driver.url} is not ready"))

    def model_card() -> dict:
        return {"id": served.name, "object": "model", "created": served.created, "owned_by": "llm-pipeline",
                "root": served.name, "max_model_len": served.max_seq_len,
                "metadata": {k: v for k, v in served.metadata.items() if v is not None}}

    async def models(request: Request):
        fe.authorize(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request):
        fe.authorize(request)
        fe.check_model(request.path_params["name"])
        return JSONResponse(model_card())

    async def parse(request: Request, cls):
        fe.authorize(request)
        data = await fe.body(request)
        try:
            req = cls.model_validate(data)
        except ValidationError as exc:
            raise P.from_validation(exc) from None
        P.unsupported(req)
        fe.check_model(req.model)
        return req

    async def _whole(request, jobs: list[_Job], rid: str, created: int, obj: str, choice) -> Response:
        """A non-streamed answer: every job run to its end (cancelled if the client leaves), then one body with
        ``choice(job)`` for each."""
        await fe.start(jobs)
        try:
            await _until_done_or_gone(request, [_drain(fe.run(j)) for j in jobs])
        finally:
            await fe.close(jobs)  # also those whose task was cancelled before it began
        return Response(_json({"id": rid, "object": obj, "created": created, "model": served.name,
                               "system_fingerprint": None, "choices": [choice(j) for j in jobs],
                               "usage": fe._usage(jobs)}), media_type="application/json")

    async def completions(request: Request):
        req = await parse(request, P.CompletionRequest)
        jobs = fe.completion_jobs(req)
        rid, created = f"cmpl-{uuid.uuid4().hex}", _now()
        if req.stream:
            return await _stream(request, jobs, req, rid, created, chat=False)
        return await _whole(request, jobs, rid, created, "text_completion", lambda j: {
            "index": j.index, "text": (j.echo_text if req.echo else "") + j.text,
            "logprobs": fe.completion_logprobs(j, req.echo), "finish_reason": j.finish})

    async def chat(request: Request):
        req = await parse(request, P.ChatRequest)
        jobs = fe.chat_jobs(req)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", _now()
        if req.stream:
            return await _stream(request, jobs, req, rid, created, chat=True)
        return await _whole(request, jobs, rid, created, "chat.completion", lambda j: {
            "index": j.index, "message": {"role": "assistant", "content": j.text, "refusal": None},
            "logprobs": fe.chat_logprobs(j.logprobs if j.gen.logprobs is not None else None),
            "finish_reason": j.finish})

    async def _stream(request, jobs: list[_Job], req, rid: str, created: int, chat: bool):
        """Start every job (problems found while :func:`_prime` waits keep their status), then stream server-sent
        events."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        obj = "chat.completion.chunk" if chat else "text_completion"
        queue: asyncio.Queue = asyncio.Queue()
        await fe.start(jobs)
        gens = [fe.run(j) for j in jobs]
        try:
            firsts = await _prime(jobs, gens, settings.stream_status_wait_s)
        except BaseException:
            for g in gens:
                await g.aclose()
            await fe.close(jobs)
            raise

        def chunk(job: _Job, text: str | None, finish: str | None, logprobs=None, role: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice = {"index": job.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": job.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": served.name,
                                    "system_fingerprint": None, "choices": [choice]}
            if continuous:
                body["usage"] = {"prompt_tokens": job.prompt_tokens,
                                 "completion_tokens": served.count(job.text),
                                 "total_tokens": job.prompt_tokens + served.count(job.text)}
            elif include_usage:
                body["usage"] = None
            return b"data: " + _json(body) + b"\n\n"

        def piece_logprobs(job: _Job, seen: list[int]) -> Any:
            """The log probs of the tokens that arrived since the last chunk of this job."""
            if job.gen.logprobs is None:
                return None
            have = job.logprobs or []
            new = have[seen[0]:]
            seen[0] = len(have)
            if chat:
                return fe.chat_logprobs(new)
            items = list(new)
            if job.prompt_logprobs is not None and seen[1] == 0 and req.echo:
                items = job.prompt_logprobs + items
            seen[1] = 1
            tmp = _Job(job.index, job.gen, 0, "")
            tmp.logprobs = items
            return fe.completion_logprobs(tmp, False)

        async def job_events(job: _Job, gen, first):
            """One job's chunks, as bytes (``first``: its first piece, or a future of it); a problem after the status
            line becomes an ``error`` event."""
            pending = first if isinstance(first, asyncio.Future) else None
            waited = pending
            seen = [0, 0]
            fast = None
            if job.gen.logprobs is None and not continuous:  # the common chunk, built around the text alone
                head = _json({"id": rid, "object": obj, "created": created, "model": served.name,
                              "system_fingerprint": None})[:-1]
                tail = b'},"logprobs":null,"finish_reason":null}]' if chat else \
                    b',"logprobs":null,"finish_reason":null}]'
                fast = (head + b',"choices":[{"index":%d,' % job.index + (b'"delta":{"content":' if chat
                                                                           else b'"text":'),
                        tail + (b',"usage":null}\n\n' if include_usage else b'}\n\n'))

            def piece_chunk(text: str) -> bytes:
                if fast is not None:
                    return b"data: " + fast[0] + json.dumps(text, ensure_ascii=False).encode() + fast[1]
                return chunk(job, text, None, piece_logprobs(job, seen))

            try:
                if chat:
                    yield chunk(job, "", None, role=True)
                elif req.echo and job.echo_text:  # the prompt, with its own log probs only
                    if pending is not None and job.gen.prompt_logprobs:  # they come with the first answer
                        first, pending = await pending, None
                    lps = None
                    if job.prompt_logprobs and job.gen.logprobs is not None:
                        tmp = _Job(job.index, job.gen, 0, "")
                        tmp.logprobs = list(job.prompt_logprobs)
                        lps = fe.completion_logprobs(tmp, False)
                    yield chunk(job, job.echo_text, None, lps)
                    seen[1] = 1
                if pending is not None:
                    first = await pending
                if first is not None:
                    yield piece_chunk(first)
                    async for piece in gen:
                        yield piece_chunk(piece)
                yield _Final(chunk(job, None if chat else "", job.finish, piece_logprobs(job, seen)
                                   if (job.logprobs or [])[seen[0]:] else None))
            except P.APIError as exc:
                yield b"data: " + _json(exc.body()) + b"\n\n"
            finally:
                if waited is not None and not waited.done():  # closed before its first piece (a client gone)
                    waited.cancel()
                    await asyncio.gather(waited, return_exceptions=True)
                await gen.aclose()

        def closing(before: bytes = b"") -> "_Last":
            """The last events (the usage chunk, ``[DONE]``) after ``before``, sent in one write with the stream's
            end."""
            usage = b""
            if include_usage:
                usage = b"data: " + _json({"id": rid, "object": obj, "created": created, "model": served.name,
                                           "system_fingerprint": None, "choices": [],
                                           "usage": fe._usage(jobs)}) + b"\n\n"
            return _Last(before + usage + b"data: [DONE]\n\n")

        async def events_one():
            it = job_events(jobs[0], gens[0], firsts[0])
            final = b""
            try:
                async for item in it:
                    if type(item) is _Final:  # the finish chunk goes out with the closing events
                        final = item
                        continue
                    if final:  # an error event after it (not expected): keep the order
                        yield final
                        final = b""
                    yield item
                yield closing(final)
            finally:  # the client went away: stop the generation
                await it.aclose()

        async def pump(job: _Job, gen, first):
            try:
                async for item in job_events(job, gen, first):
                    await queue.put(item)
            finally:
                await queue.put(None)

        async def events():
            tasks = [asyncio.create_task(pump(j, g, f)) for j, g, f in zip(jobs, gens, firsts)]
            try:
                done = 0
                while done < len(tasks):
                    item = await queue.get()
                    if item is None:
                        done += 1
                        continue
                    yield item
                yield closing()
            finally:  # the client went away (the event stream closes this generator): stop every generation
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        return _EventStream(events_one() if len(jobs) == 1 else events(), lambda: fe.close(jobs))

    routes = [Route("/health", health, methods=["GET"]), Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{name:path}", model, methods=["GET"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        P.APIError: _api_error, StarletteHTTPException: _http_error, Exception: _internal})
    app.state.front_end = fe
    return app


class _Final(bytes):
    """A job's finish chunk (its ``finish_reason``)."""


class _Last(bytes):
    """The stream's closing events: the response body ends with them."""


class _EventStream(_Response):
    """A server-sent-event response (an ASGI app): the events as they come; a client that disconnects cancels
    the stream at once (its generations with it), also while it waits for a token. Starlette's StreamingResponse
    does the same with an anyio task group per response; this costs one watcher task."""

    headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Any]):
        """A Response (Starlette calls it as is) with no body; ``on_close()`` is awaited last, whatever happened
        (it closes every generation, also one whose events were never asked for)."""
        self.events, self.on_close = events, on_close
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.current_task()
        state = {"open": True, "gone": False}  # open: this task is inside the try below

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            state["gone"] = True
            if state["open"]:
                streaming.cancel()  # delivered at the stream's current await, inside the try

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            last = False
            async for event in self.events:
                last = type(event) is _Last  # the closing events end the body in the same write
                await send({"type": "http.response.body", "body": event, "more_body": not last})
                if last:
                    break
            if not last:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:
                raise  # cancelled from outside (shutdown): not ours to swallow
        finally:
            state["open"] = False
            watcher.cancel()
            await self.events.aclose()  # a generation still running stops here
            await self.on_close()


async def _prime(jobs: list[_Job], gens: list, wait_s: float) -> list[Any]:
    """Each job's first piece (None: it ended without one) where it came in time, else a future of it. The wait
    ends when every job has its first piece, or when every job's own checks have run (its prompt counted, see
    :meth:`FrontEnd.settle`) and ``wait_s`` has passed. A problem found meanwhile is raised here, so that the
    response carries its status; the streamed response's headers go out after this."""
    loop = asyncio.get_running_loop()
    firsts = [asyncio.ensure_future(_first(g)) for g in gens]
    deadline = loop.time() + wait_s
    try:
        while True:
            for job in jobs:
                if job.problem is not None:
                    raise job.problem
            for f in firsts:
                if f.done() and f.exception() is not None:
                    raise f.exception()
            waiting = [f for f in firsts if not f.done()]
            checks = [j.counted for j in jobs if j.counted is not None and not j.counted.done()]
            left = deadline - loop.time()
            if not waiting or (left <= 0 and not checks):
                break
            await asyncio.wait(waiting + checks, timeout=left if left > 0 else None,
                               return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        for f in firsts:
            f.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        raise
    return [f.result() if f.done() else f for f in firsts]


async def _first(gen) -> Any:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None


async def _drain(agen) -> None:
    async for _ in agen:
        pass


async def _until_done_or_gone(request, coros) -> None:
    """Run the generations; when the client disconnects first, cancel them (and so their Triton requests)."""
    work = asyncio.ensure_future(asyncio.gather(*coros))

    async def gone():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise P.APIError(499, "client closed the request")
    work.result()
