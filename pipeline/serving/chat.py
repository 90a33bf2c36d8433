"""``POST /v1/chat/completions`` (as vLLM's ``serving_chat.py``): messages rendered with the model's own chat template
(``chat_template_kwargs`` passed through, e.g. Qwen3's ``enable_thinking``; a BOS the layout's tokenizer step adds
again is dropped); a tokenizer without one answers with a 400 (completions still work). ``logprobs``/
``top_logprobs`` in OpenAI's chat form. The rest is :class:`~pipeline.serving.generation.Endpoint`'s."""
from __future__ import annotations

from typing import Any

from pipeline.serving import protocol as P
from pipeline.serving.generation import Endpoint, Job, Stream


class ChatEndpoint(Endpoint):
    request_model = P.ChatRequest
    id_prefix = "chatcmpl"
    chunk_model = P.ChatCompletionChunk
    chunk_object = "chat.completion.chunk"
    fast_open = b'"delta":{"content":'
    fast_close = b'},"logprobs":null,"finish_reason":null}]'
    final_text = None

    def jobs(self, req: P.ChatRequest) -> list[Job]:
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
        if not token_level and self.can_count_later(req.limit()):
            job = Job(0, self.gen_request(req, text, None, self.budget(None, req.limit(), param), False), None,
                      "")
            self.count_later(job, text, lambda n: self.budget(n, req.limit(), param))
            return [job]
        ids = self.served.encode_prompt(text)
        max_tokens = self.budget(len(ids), req.limit(), param)
        return [Job(0, self.gen_request(req, text, ids if token_level else None, max_tokens, False), len(ids),
                    "")]

    def response(self, jobs: list[Job], req: P.ChatRequest, rid: str, created: int) -> P.ChatCompletion:
        return P.ChatCompletion(
            id=rid, object="chat.completion", created=created, model=self.served.name, system_fingerprint=None,
            choices=[P.ChatChoice(index=j.index, message=P.ChatMessage(role="assistant", content=j.text, refusal=None),
                                  logprobs=self.chat_logprobs(j.logprobs if j.gen.logprobs is not None else None),
                                  finish_reason=j.finish) for j in jobs],
            usage=self.usage(jobs))

    def choice_chunk(self, job: Job, text: str | None, finish: str | None, logprobs, role: bool):
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
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
