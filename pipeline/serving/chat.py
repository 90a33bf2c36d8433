"""``POST /v1/chat/completions`` (as vLLM's ``serving_chat.py``): messages rendered with the model's own chat template
(``chat_template_kwargs`` passed through, e.g. Qwen3's ``enable_thinking``; a BOS the layout's tokenizer step adds
again is dropped); a tokenizer without one answers with a 400 (completions still work). ``logprobs``/
``top_logprobs`` in OpenAI's chat form. ``response_format`` by guided decoding (``pipeline.serving.guide``); ``tools``
rendered through the chat template, the answer's tool calls parsed into ``tool_calls`` (streamed as tool-call
deltas, ``finish_reason: "tool_calls"``), ``tool_choice`` ``required`` or a named function enforced by guided
decoding (``pipeline.serving.tools``). The rest is :class:`~pipeline.serving.generation.Endpoint`'s."""
from __future__ import annotations

from typing import Any

from pipeline.serving import protocol as P, tools
from pipeline.serving.generation import Endpoint, Job, Stream


class ChatEndpoint(Endpoint):
    request_model = P.ChatRequest
    id_prefix = "chatcmpl"
    chunk_model = P.ChatCompletionChunk
    chunk_object = "chat.completion.chunk"
    fast_open = b'"delta":{"content":'
    fast_close = b'},"logprobs":null,"finish_reason":null}]'
    final_text = None

    def __init__(self, front):
        super().__init__(front)
        self._tool_format: tuple | None = None

    def tool_format(self) -> tuple:
        """(The served model's tool-call format or None, why not): ``tools.format_for``, once."""
        if self._tool_format is None:
            self._tool_format = tools.format_for(self.served)
        return self._tool_format

    def jobs(self, req: P.ChatRequest) -> list[Job]:
        if not self.served.has_chat_template:
            raise P.APIError(400, f"the model '{self.served.name}' has no chat template (its tokenizer defines "
                                  f"none); use /v1/completions with a plain prompt", param="messages")
        messages = tools.template_messages(req)
        guides = self.front.guides
        plan = tools.plan(req, self.served, *self.tool_format(), guides.built)
        guide, guide_param = (plan.guide, "tools") if plan.guide is not None else \
            (guides.response_format(req.response_format), "response_format")
        try:
            text = self.served.render_chat(messages, req.add_generation_prompt, req.chat_template_kwargs,
                                           tools=plan.render)
        except Exception as exc:  # jinja raises TemplateError (and the template's own raise_exception)
            raise P.APIError(400, f"the chat template refused the messages: {exc}", param="messages") from None
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        token_level = req.num_logprobs() is not None
        if not token_level and self.can_count_later(req.limit()):
            job = Job(0, self.gen_request(req, text, None, self.budget(None, req.limit(), param), False, guide,
                                          guide_param), None, "", tools=plan.format)
            self.count_later(job, text, lambda n: self.budget(n, req.limit(), param))
            return [job]
        ids = self.served.encode_prompt(text)
        max_tokens = self.budget(len(ids), req.limit(), param)
        return [Job(0, self.gen_request(req, text, ids if token_level else None, max_tokens, False, guide,
                                        guide_param), len(ids), "", tools=plan.format)]

    def message(self, job: Job) -> tuple[P.ChatMessage, str | None]:
        """The answer's message and finish reason (``tool_calls`` where the model called tools)."""
        if job.tools is None:
            return P.ChatMessage(role="assistant", content=job.text, refusal=None), job.finish
        content, calls = job.tools.parser().parse(job.text)
        if not calls:
            return P.ChatMessage(role="assistant", content=job.text, refusal=None), job.finish
        return P.ChatMessage(role="assistant", content=content, refusal=None, tool_calls=calls), "tool_calls"

    def response(self, jobs: list[Job], req: P.ChatRequest, rid: str, created: int) -> P.ChatCompletion:
        choices = []
        for j in jobs:
            message, finish = self.message(j)
            choices.append(P.ChatChoice(index=j.index, message=message, finish_reason=finish,
                                        logprobs=self.chat_logprobs(j.logprobs if j.gen.logprobs is not None
                                                                    else None)))
        return P.ChatCompletion(id=rid, object="chat.completion", created=created, model=self.served.name,
                                system_fingerprint=None, choices=choices, usage=self.usage(jobs))

    async def deltas(self, job: Job, first: str, gen):
        """Text pieces as they come; with tools, the answer's tool calls as tool-call deltas (text that may start
        one is held back until it is known), and the finish reason ``tool_calls`` where there were any."""
        if job.tools is None:
            async for item in super().deltas(job, first, gen):
                yield item
            return
        calls = job.tools.parser()
        for item in calls.feed(first):
            yield item
        async for piece in gen:
            for item in calls.feed(piece):
                yield item
        for item in calls.flush():
            yield item
        if calls.calls:
            job.finish = "tool_calls"

    def choice_chunk(self, job: Job, text, finish: str | None, logprobs, role: bool):
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if isinstance(text, P.ToolCallDelta):
            delta["tool_calls"] = [text]
        elif text is not None:
            delta["content"] = text
        return P.ChatChunkChoice(index=job.index, delta=P.ChatDelta(**delta), logprobs=logprobs,
                                 finish_reason=finish)

    def piece_logprobs(self, s: Stream, job: Job, seen: list[int]):
        return self.chat_logprobs(self.new_logprobs(job, seen))

    def role_chunk(self, s: Stream, index: int) -> bytes:
        """The stream's first chunk (the assistant's role, empty content), without per-chunk usage: bytes, as the
        per-token chunks are (the unit tests compare it with :meth:`chunk`'s)."""
        return (b"data: " + self.chunk_head(s)
                + b',"choices":[{"index":%d,"delta":{"role":"assistant","content":""},'
                b'"logprobs":null,"finish_reason":null}]' % index + self.chunk_tail(s))

    async def events_before_first_piece(self, s: Stream, job: Job, first, pending, seen: list[int]):
        """The assistant's role, first."""
        event = self.chunk(s, job, "", None, role=True) if s.continuous else self.role_chunk(s, job.index)
        return event, first, pending
