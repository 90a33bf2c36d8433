"""``POST /v1/completions`` (as vLLM's ``serving_completion.py``): a prompt as a string, a list of strings, a list of
token ids or a list of such lists (one choice each); ``echo`` (the prompt first), ``logprobs`` (0-20) with prompt log
probabilities under ``echo`` (what lm-evaluation-harness's log-likelihood requests send), ``max_tokens: 0`` with
``echo`` for the prompt's log probabilities only; ``response_format`` (vLLM's extension) as on chat, by guided
decoding (``pipeline.serving.guide``). The rest is :class:`~pipeline.serving.generation.Endpoint`'s."""
from __future__ import annotations

from pipeline.serving import protocol as P
from pipeline.serving.generation import Endpoint, Job, Stream


class CompletionsEndpoint(Endpoint):
    request_model = P.CompletionRequest
    id_prefix = "cmpl"
    chunk_model = P.Completion
    chunk_object = "text_completion"
    fast_open = b'"text":'
    fast_close = b',"logprobs":null,"finish_reason":null}]'
    final_text = ""

    def jobs(self, req: P.CompletionRequest) -> list[Job]:
        jobs = []
        guide = self.front.guides.response_format(req.response_format)
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
                return self.budget(count, budget, "max_tokens")

            if ids is None and text and self.can_count_later(budget):  # an empty text: counted now
                job = Job(i, self.gen_request(req, text, None, self.budget(None, budget, "max_tokens"), False,
                                              guide), None, text if req.echo else "")
                self.count_later(job, text, checks)
            else:
                count = len(ids) if ids is not None else len(self.served.encode_prompt(text))
                job = Job(i, self.gen_request(req, text, ids, checks(count), prompt_logprobs, guide), count,
                          text if req.echo else "")
            job.zero = asked == 0  # echo only: the one token generated for the prompt's log probs is not returned
            jobs.append(job)
        return jobs

    def logprobs(self, job: Job, echo: bool) -> P.CompletionLogprobs | None:
        """A whole answer's log probs: the prompt's (with ``echo``) and the generated tokens'."""
        items = list(job.prompt_logprobs) if echo and job.prompt_logprobs else []
        return self.completion_logprobs(items + (job.logprobs or []), job.gen.logprobs)

    def response(self, jobs: list[Job], req: P.CompletionRequest, rid: str, created: int) -> P.Completion:
        return P.Completion(
            id=rid, object="text_completion", created=created, model=self.served.name, system_fingerprint=None,
            choices=[P.CompletionChoice(index=j.index, text=(j.echo_text if req.echo else "") + j.text,
                                        logprobs=self.logprobs(j, req.echo), finish_reason=j.finish) for j in jobs],
            usage=self.usage(jobs))

    def choice_chunk(self, job: Job, text: str | None, finish: str | None, logprobs, role: bool):
        return P.CompletionChoice(index=job.index, text=text or "", logprobs=logprobs, finish_reason=finish)

    def piece_logprobs(self, s: Stream, job: Job, seen: list[int]):
        items = self.new_logprobs(job, seen)
        if items is None:
            return None
        if job.prompt_logprobs is not None and seen[1] == 0 and s.req.echo:
            items = job.prompt_logprobs + items
        seen[1] = 1
        return self.completion_logprobs(items, job.gen.logprobs)

    async def events_before_first_piece(self, s: Stream, job: Job, first, pending, seen: list[int]):
        """With ``echo``, the prompt first, with its own log probs only (they come with the first answer)."""
        if not (s.req.echo and job.echo_text):
            return None, first, pending
        if pending is not None and job.gen.prompt_logprobs:
            first, pending = await pending, None
        lps = None
        if job.prompt_logprobs and job.gen.logprobs is not None:
            lps = self.completion_logprobs(list(job.prompt_logprobs), job.gen.logprobs)
        seen[1] = 1
        return self.chunk(s, job, job.echo_text, None, lps), first, pending
