"""What the two generation endpoints share (:class:`Endpoint`; ``chat.py`` and ``completions.py`` are the two, as
vLLM's ``serving_chat.py`` and ``serving_completion.py`` on its ``serving_engine.py``): a request's prompts as jobs,
each job's token budget, the prompt's token count taken while Triton works on it, running a job through the driver
with stop strings applied, the usage, the non-streamed answer and the server-sent-event stream.

- ``max_tokens``/``max_completion_tokens`` default to the remaining context, capped by ``limits.max_tokens``; a
  request that does not fit the context is a 400 saying by how much.
- ``usage``: ``prompt_tokens`` as the layout's tokenizer step encodes the prompt, ``completion_tokens`` the engine's
  own count where the layout reports one and the text was not cut here, else the returned text re-tokenized (as the
  bench, genai-perf and aiperf count); ``finish_reason`` ``stop`` or ``length``.
- Stop strings are sent to the model and also enforced on the text (a stop string whose tokens differ in context
  still stops), and are not part of the returned text, as in OpenAI's API.
- Streaming: server-sent events, ``data: [DONE]`` last; ``stream_options.include_usage`` adds a final chunk with the
  usage and no choices (``continuous_usage_stats``: usage in every chunk). A stream's status line goes out once the
  front end's own checks have passed and Triton has either answered or been working on the request for
  ``limits.stream_status_wait_ms`` (the client reads the headers while the first token is made): a problem found
  before that is answered with its HTTP status, a later one as an ``error`` event.

The per-token chunk of a stream without log probabilities or per-chunk usage (and a chat stream's first chunk) is
written as bytes around the text (:meth:`Endpoint.fast_parts`); every other body is a typed model of
``pipeline.serving.protocol`` written by ``protocol.dump``, and the unit tests hold the two to the same bytes.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel

from pipeline.serving import observe, protocol as P
from pipeline.serving.driver import SENT
from pipeline.serving.transport import EventStream, Final, Last, until_done_or_gone
from pipeline.triton.layouts.contract import Delta, GenRequest, TokenLogprob


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


@dataclass
class Job:
    """One prompt's generation as the endpoint sees it."""

    index: int
    gen: GenRequest
    prompt_tokens: int | None  # None until counted (:meth:`Endpoint.settle`)
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
    agen: "AsyncIterator[Delta] | None" = None  # the driver's generation, once started (:meth:`Endpoint.start`)
    tools: Any = None  # chat: the tool-call format its answer is parsed with (pipeline.serving.tools), None: text


@dataclass
class Stream:
    """One streamed answer's constants: its id and creation time, the request and its usage options."""

    rid: str
    created: int
    req: Any
    include_usage: bool
    continuous: bool
    head: bytes | None = None  # a chunk's opening bytes, up to its choices (:meth:`Endpoint.head`)


class Endpoint:
    """One generation endpoint of the front end (``front``: its :class:`~pipeline.serving.frontend.FrontEnd`, for the
    served model, the driver, the settings and the request checks). A subclass gives the request model, the id
    prefix, the response and chunk models, and: :meth:`jobs` (a request's prompts), :meth:`response` (the whole
    answer), :meth:`choice_chunk` and :meth:`piece_logprobs` (a chunk's choice), :meth:`events_before_first_piece`
    (the events before the first piece) and ``fast_open``/``fast_close`` (the bytes around a chunk's text)."""

    request_model: type[BaseModel]
    id_prefix: str
    chunk_model: type[BaseModel]
    chunk_object: str
    fast_open: bytes  # a per-token chunk's bytes before its text, after the choice's index
    fast_close: bytes  # ... after its text, to the end of the choices
    final_text: str | None = None  # the finish chunk's text (completions: "", chat: none)

    def __init__(self, front):
        self.front = front
        self.served, self.driver, self.settings = front.served, front.driver, front.settings

    # --- the request ------------------------------------------------------------------------------------------
    async def handle(self, request):
        """The route: parse and check the body, make the jobs, answer whole or streamed."""
        req = await self.front.parse(request, self.request_model)
        jobs = self.jobs(req)
        observe.started(req.model, req.stream, jobs)
        rid, created = f"{self.id_prefix}-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return await self.stream(request, jobs, req, rid, created)
        return await self.answer_unstreamed(request, jobs, req, rid, created)

    def jobs(self, req) -> list[Job]:
        raise NotImplementedError

    def budget(self, prompt_tokens: int | None, asked: int | None, param: str) -> int:
        """``max_tokens`` for a prompt of ``prompt_tokens`` (None: not counted yet, which :meth:`can_count_later`
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

    @staticmethod
    def gen_request(req, prompt_text: str | None, prompt_ids: list[int] | None, max_tokens: int,
            prompt_logprobs: bool, guide=None, guide_param: str = "response_format") -> GenRequest:
        return GenRequest(
            prompt_text=prompt_text, prompt_ids=prompt_ids, max_tokens=max_tokens, stream=req.stream,
            sampling=req.sampling(), guide=guide, guide_param=guide_param, ignore_eos=req.ignore_eos,
            logprobs=req.num_logprobs(), prompt_logprobs=prompt_logprobs, request_id=observe.next_triton_id())

    # --- the prompt's token count, while Triton works on it --------------------------------------------------
    def can_count_later(self, asked: int | None) -> bool:
        """Whether the request to Triton can be made without the prompt's token count: its ``max_tokens`` is
        given, or the context length is unknown (the default is then the configured cap). The count, and the
        checks that need it, then run once the request is on its way (:meth:`count_prompt_and_check`)."""
        return asked is not None or self.served.max_seq_len is None

    def count_later(self, job: Job, text: str, checks: Callable[[int], Any]) -> None:
        job.check = checks
        job.counted = asyncio.get_running_loop().create_future()
        job.gen.after_send = lambda: self.count_prompt_and_check(job, text)

    def count_prompt_and_check(self, job: Job, text: str | None = None) -> P.APIError | None:
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
    async def start(self, jobs: list[Job]) -> None:
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
    async def close(jobs: list[Job]) -> None:
        """Close every job's generation (a request still running is stopped on the server; closing one that has
        ended does nothing)."""
        for job in jobs:
            if job.agen is not None:
                await job.agen.aclose()

    async def run(self, job: Job) -> AsyncIterator[str]:
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
                    if self.count_prompt_and_check(job) is not None:
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
            # refused for its count (by the checks or Triton)
            if not settled and self.count_prompt_and_check(job) is not None:
                raise job.problem from None
            raise
        finally:
            await agen.aclose()  # a stop string or a client gone: the Triton request is cancelled
        if not settled and self.count_prompt_and_check(job) is not None:  # nothing came back at all
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

    # --- answers ----------------------------------------------------------------------------------------------
    @staticmethod
    def usage(jobs: list[Job]) -> P.Usage:
        p = sum(j.prompt_tokens for j in jobs)
        c = sum(j.completion_tokens for j in jobs)
        return P.Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def response(self, jobs: list[Job], req, rid: str, created: int) -> BaseModel:
        raise NotImplementedError

    async def answer_unstreamed(self, request, jobs: list[Job], req, rid: str, created: int):
        """A non-streamed answer: every job run to its end (cancelled if the client leaves), then one body."""
        from starlette.responses import Response

        await self.start(jobs)
        try:
            await until_done_or_gone(request, [_drain(self.run(j)) for j in jobs])
        finally:
            await self.close(jobs)  # also those whose task was cancelled before it began
        return Response(P.dump(self.response(jobs, req, rid, created)), media_type="application/json")

    # --- the stream -------------------------------------------------------------------------------------------
    def choice_chunk(self, job: Job, text: str | None, finish: str | None, logprobs, role: bool) -> BaseModel:
        """One chunk's choice (``text`` None: none; ``role``: the chat stream's first chunk)."""
        raise NotImplementedError

    def piece_logprobs(self, s: Stream, job: Job, seen: list[int]) -> Any:
        """The log probs of the tokens that arrived since the job's last chunk (``seen``: how many were sent, and
        whether the prompt's were), in the endpoint's form."""
        raise NotImplementedError

    @staticmethod
    def new_logprobs(job: Job, seen: list[int]) -> list[TokenLogprob] | None:
        """The log probs of the job's tokens since ``seen[0]`` (then counted as sent); None where none were asked."""
        if job.gen.logprobs is None:
            return None
        have = job.logprobs or []
        new = have[seen[0]:]
        seen[0] = len(have)
        return new

    async def deltas(self, job: Job, first: str, gen):
        """What the job's chunks carry, from its text pieces (``first``, then ``gen``'s): the pieces themselves (chat
        turns tool-call text into tool-call deltas)."""
        yield first
        async for piece in gen:
            yield piece

    async def events_before_first_piece(self, s: Stream, job: Job, first, pending, seen: list[int]):
        """The job's events before its first piece: (event or None, first, pending); it may wait for the first
        piece (``pending``, a future) when the opening needs what comes with it."""
        return None, first, pending

    def chunk(self, s: Stream, job: Job, text: str | None, finish: str | None, logprobs=None,
              role: bool = False) -> bytes:
        """One chunk event, built as a typed model."""
        extra: dict[str, Any] = {}
        if s.continuous:
            n = self.served.count(job.text)
            extra["usage"] = P.Usage(prompt_tokens=job.prompt_tokens, completion_tokens=n,
                                     total_tokens=job.prompt_tokens + n)
        elif s.include_usage:
            extra["usage"] = None
        body = self.chunk_model(id=s.rid, object=self.chunk_object, created=s.created, model=self.served.name,
                                system_fingerprint=None, choices=[self.choice_chunk(job, text, finish, logprobs, role)],
                                **extra)
        return b"data: " + P.dump(body) + b"\n\n"

    def chunk_head(self, s: Stream) -> bytes:
        """A chunk's bytes up to its choices (the same for every chunk of the stream), made once."""
        if s.head is None:
            s.head = P.dumps({"id": s.rid, "object": self.chunk_object, "created": s.created,
                              "model": self.served.name, "system_fingerprint": None})[:-1]
        return s.head

    @staticmethod
    def chunk_tail(s: Stream) -> bytes:
        """A chunk's bytes after its choices, without per-chunk usage."""
        return b',"usage":null}\n\n' if s.include_usage else b'}\n\n'

    def fast_parts(self, s: Stream, index: int) -> tuple[bytes, bytes]:
        """The bytes of a per-token chunk before and after its text (JSON-quoted), for a stream without log probs
        and per-chunk usage: what :meth:`chunk` writes for that chunk (the unit tests compare them)."""
        return (self.chunk_head(s) + b',"choices":[{"index":%d,' % index + self.fast_open,
                self.fast_close + self.chunk_tail(s))

    async def stream(self, request, jobs: list[Job], req, rid: str, created: int):
        """Start every job (problems found while :func:`prime` waits keep their status), then stream server-sent
        events."""
        s = Stream(rid, created, req, bool(req.stream_options and req.stream_options.include_usage),
                   bool(req.stream_options and req.stream_options.continuous_usage_stats))
        await self.start(jobs)
        gens = [self.run(j) for j in jobs]
        try:
            firsts = await prime(jobs, gens, self.settings.stream_status_wait_s)
        except BaseException:
            for g in gens:
                await g.aclose()
            await self.close(jobs)
            raise
        if len(jobs) == 1:
            events = self._events_one(s, jobs, gens[0], firsts[0])
        else:
            events = self._events(s, jobs, gens, firsts)
        return EventStream(events, lambda: self.close(jobs))

    async def job_events(self, s: Stream, job: Job, gen, first):
        """One job's chunks, as bytes (``first``: its first piece, or a future of it); a problem after the status
        line becomes an ``error`` event."""
        pending = first if isinstance(first, asyncio.Future) else None
        waited = pending
        seen = [0, 0]
        fast = None
        if job.gen.logprobs is None and not s.continuous and job.tools is None:  # the common chunk, text alone
            fast = self.fast_parts(s, job.index)
        try:
            event, first, pending = await self.events_before_first_piece(s, job, first, pending, seen)
            if event is not None:
                yield event
            if pending is not None:
                first = await pending
            if first is not None:
                if fast is not None:
                    yield b"data: " + fast[0] + json.dumps(first, ensure_ascii=False).encode() + fast[1]
                    async for piece in gen:
                        yield b"data: " + fast[0] + json.dumps(piece, ensure_ascii=False).encode() + fast[1]
                else:
                    async for item in self.deltas(job, first, gen):
                        yield self.chunk(s, job, item, None, self.piece_logprobs(s, job, seen))
            yield Final(self.chunk(s, job, self.final_text, job.finish, self.piece_logprobs(s, job, seen)
                                   if (job.logprobs or [])[seen[0]:] else None))
        except P.APIError as exc:
            observe.failed(exc.status)
            yield b"data: " + P.dumps(exc.body()) + b"\n\n"
        finally:
            if waited is not None and not waited.done():  # closed before its first piece (a client gone)
                waited.cancel()
                await asyncio.gather(waited, return_exceptions=True)
            await gen.aclose()

    def closing_events(self, s: Stream, jobs: list[Job], before: bytes = b"") -> Last:
        """The last events (the usage chunk, ``[DONE]``) after ``before``, sent in one write with the stream's
        end."""
        usage = b""
        if s.include_usage:
            usage = b"data: " + P.dump(self.chunk_model(id=s.rid, object=self.chunk_object, created=s.created,
                                                        model=self.served.name, system_fingerprint=None, choices=[],
                                                        usage=self.usage(jobs))) + b"\n\n"
        return Last(before + usage + b"data: [DONE]\n\n")

    async def _events_one(self, s: Stream, jobs: list[Job], gen, first):
        it = self.job_events(s, jobs[0], gen, first)
        final = b""
        try:
            async for item in it:
                if type(item) is Final:  # the finish chunk goes out with the closing events
                    final = item
                    continue
                if final:  # an error event after it (not expected): keep the order
                    yield final
                    final = b""
                yield item
            yield self.closing_events(s, jobs, final)
        finally:  # the client went away: stop the generation
            await it.aclose()

    async def _events(self, s: Stream, jobs: list[Job], gens, firsts):
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(job: Job, gen, first):
            try:
                async for item in self.job_events(s, job, gen, first):
                    await queue.put(item)
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(j, g, f)) for j, g, f in zip(jobs, gens, firsts)]
        try:
            done = 0
            while done < len(tasks):
                item = await queue.get()
                if item is None:
                    done += 1
                    continue
                yield item
            yield self.closing_events(s, jobs)
        finally:  # the client went away (the event stream closes this generator): stop every generation
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # --- log probabilities ------------------------------------------------------------------------------------
    def completion_logprobs(self, items: list[TokenLogprob], top_k: int | None,
                            offset0: int = 0) -> P.CompletionLogprobs | None:
        """``/v1/completions``' log probs of ``items`` (``top_k``: the request's ``logprobs``; None: none asked)."""
        if top_k is None:
            return None
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
                best = {self.served.token_str(t): lp for t, lp in it.top}
                if top_k:
                    best.setdefault(s, it.logprob)
                tops.append(best if top_k else None)
        return P.CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops, text_offset=offsets)

    def chat_logprobs(self, items: list[TokenLogprob] | None) -> P.ChoiceLogprobs | None:
        if items is None:
            return None

        def one(t: int, lp: float) -> dict:
            s = self.served.token_str(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return P.ChoiceLogprobs(content=[{**one(it.token_id, it.logprob),
                                          "top_logprobs": [one(t, lp) for t, lp in it.top]} for it in items],
                                refusal=None)


async def prime(jobs: list[Job], gens: list, wait_s: float) -> list[Any]:
    """Each job's first piece (None: it ended without one) where it came in time, else a future of it. The wait
    ends when every job has its first piece, or when every job's own checks have run (its prompt counted, see
    :meth:`Endpoint.settle`) and ``wait_s`` has passed. A problem found meanwhile is raised here, so that the
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
