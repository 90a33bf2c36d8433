"""Step-synchronous batched decoding for the reference runtime: concurrent requests share every forward pass.

One engine thread owns the model. At each step boundary it admits waiting requests (their prompts are prefilled
together, left-padded, in forward passes of up to ``max_prefill_tokens`` padded tokens, then their KV caches are merged
into the batch), advances every active sequence by one token in a single forward pass, and retires the ones that
finished or were cancelled. Prefill and batch are left-padded: an attention mask hides the padding and explicit
position ids keep each sequence's positions what they would be alone, so a greedy request yields the same tokens
whether it runs alone or beside others. Prompts that ask for every position's logits (log-likelihood requests) are
prefilled apart, in passes of a fixed shape chosen by each prompt's own length (``BatchEngine.context_shape``), so
that a prompt's log probabilities are the same bits whichever prompts share its pass. The forward pass is the
model's own, so whatever attention implementation it was loaded with (the reference loader's FP8/NVFP4 KV-cache fake
quantization included) is what the batch runs.

Per request: greedy or sampled decoding (temperature, top-k, top-p, a per-request ``torch.Generator`` seeded from the
request, so a seed reproduces its tokens whatever else is in the batch), end ids, stop words (token sequences; the
request stops when its output ends with one), bad words (masked), min tokens, repetition/presence/frequency
penalties, an embedding bias, guided decoding (a grammar's token mask applied last, before temperature and
truncation, as TensorRT-LLM applies XGrammar's bitmask to the logits before sampling; the grammar then accepts the
chosen token), max tokens, log probabilities of the chosen tokens, and optionally the context and generation
logits. A request can be cancelled at any time; a failure of one request never ends the others.

Self-contained (torch and transformers only): Triton's python backend imports this file on its own, copied next to
the served ``model.py`` as ``reference_decode_engine.py``.
"""
from __future__ import annotations

import inspect
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

FINISH_END = "end_id"          # an end id was generated (it is the request's last token)
FINISH_STOP = "stop_words"     # the output ends with one of the request's stop words
FINISH_LENGTH = "length"       # max_new_tokens, or the engine's max_seq_len, was reached
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"
CONTEXT_WIDTH_STEP = 8         # log-likelihood passes are a multiple of this wide (BatchEngine.context_shape)


@dataclass
class GenerationRequest:
    """What one sequence asks of the engine. Greedy when ``temperature`` is 0."""

    input_ids: Sequence[int]
    max_new_tokens: int
    end_ids: frozenset[int] = frozenset()
    temperature: float = 0.0
    top_k: int = 0                  # 0: no top-k truncation
    top_p: float = 1.0              # 1 (or <= 0): no nucleus truncation
    seed: int = 0
    stop_words: Sequence[Sequence[int]] = ()
    bad_words: Sequence[Sequence[int]] = ()
    min_tokens: int = 0             # end ids are masked until this many tokens were generated
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of every token seen so far
    presence_penalty: float = 0.0   # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence from the logit of every token already generated
    embedding_bias: Sequence[float] | None = None  # added to the logits (one value per vocabulary entry)
    # guided decoding: the sequence's grammar state (``reference_guided.Matcher``: ``constrain(row)`` masks the tokens
    # the grammar does not allow next, ``accept(token)`` advances it); None: unconstrained
    grammar: object | None = None
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False


@dataclass
class Event:
    """One step of a request. Exactly one event per request has ``finish_reason`` set, and it is the last.

    ``token`` is None only on a last event that carries no token (cancelled, failed, or nothing to generate).
    ``log_prob`` is the log-probability of ``token`` under the distribution it was drawn from (after bias, bad words,
    penalties and temperature; before top-k/top-p truncation), when the request asked for log probs. ``logits`` is
    the model's raw float32 logits row for this step, on the CPU whatever the model's device, when it asked for
    generation logits.
    """

    index: int
    token: int | None = None
    log_prob: float | None = None
    logits: torch.Tensor | None = None
    finish_reason: str | None = None
    error: BaseException | None = None


class Handle:
    """A submitted request: iterate it for its events (unless a callback receives them), cancel it at any time.

    ``context_logits`` (float32 ``[prompt_len, vocab]``, on the CPU whatever the model's device: callers hand it to
    numpy) is set before the first event when the request asked for it.
    """

    def __init__(self, request: GenerationRequest, on_event: Callable[[Event], None] | None):
        self.request = request
        self.context_logits: torch.Tensor | None = None
        self.admitted_ns = 0  # time.time_ns() when the engine started its prefill
        self.finish_reason: str | None = None
        self._cancelled = threading.Event()
        self._queue: queue.Queue[Event] | None = None if on_event else queue.Queue()
        self._on_event = on_event or self._queue.put

    def cancel(self) -> None:
        """Stop generating for this request; its last event (``cancelled``) follows at the next step boundary."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _emit(self, event: Event) -> None:
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
        self._on_event(event)

    def __iter__(self) -> Iterator[Event]:
        if self._queue is None:
            raise TypeError("this request's events go to its callback")
        while True:
            ev = self._queue.get()
            yield ev
            if ev.finish_reason is not None:
                return

    def tokens(self) -> list[int]:
        """Every generated token (the end id included when one ended the request); raises if the request failed."""
        out = []
        for ev in self:
            if ev.error is not None:
                raise ev.error
            if ev.token is not None:
                out.append(ev.token)
        return out


@dataclass
class _Seq:
    handle: Handle
    req: GenerationRequest
    generator: torch.Generator
    seen: list[int]                       # prompt + generated tokens
    generated: list[int] = field(default_factory=list)
    cum_log_prob: float = 0.0


class BatchEngine:
    """Serves :class:`GenerationRequest` s from one background thread, batching whatever is active at each step.

    ``max_batch_size`` bounds the sequences decoded together (more wait in a queue); ``max_seq_len`` bounds prompt +
    output of each sequence; ``max_prefill_tokens`` bounds one prefill pass (joining prompts × the longest of them;
    a longer prompt is prefilled alone).
    """

    def __init__(self, model: torch.nn.Module, *, max_batch_size: int = 8, max_seq_len: int | None = None,
                 max_prefill_tokens: int = 4096):
        from transformers import DynamicCache  # noqa: F401  (fail at construction, not on the first request)

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.device = next(model.parameters()).device
        text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = int(text_cfg.vocab_size)
        window = getattr(text_cfg, "sliding_window", None)
        layer_types = getattr(text_cfg, "layer_types", None) or ()
        sliding = any(t != "full_attention" for t in layer_types) if layer_types else bool(
            window and getattr(text_cfg, "use_sliding_window", True))
        # A sliding-window cache cannot be left-padded safely: such models decode one sequence at a time.
        self.max_batch_size = 1 if sliding else int(max_batch_size)
        limit = max_seq_len or getattr(text_cfg, "max_position_embeddings", None)
        self.max_seq_len = int(limit) if limit else None
        self.max_prefill_tokens = int(max_prefill_tokens)
        _ensure_padding_mask_support(model)
        # transformers renamed ``past_key_values`` to ``cache`` (5.x); pass whichever this model's forward takes.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._cv = threading.Condition()
        self._pending: deque[_Seq] = deque()
        self._active: list[_Seq] = []
        self._cache = None                      # the batch's DynamicCache, [B, kv_heads, T, head_dim] per layer
        self._mask: torch.Tensor | None = None  # [B, T], 1 = real token, 0 = left padding
        self._closed = False
        self.steps = 0            # decode forward passes run (for tests and stats)
        self.prefills = 0         # prefill forward passes run
        self.max_batch_seen = 0
        self._joining: list[_Seq] = []  # sequences taken from the queue for the prefill now running (stats)
        self._thread = threading.Thread(target=self._loop, name="reference-batching", daemon=True)
        self._thread.start()

    # --- public -----------------------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, on_event: Callable[[Event], None] | None = None) -> Handle:
        """Queue a request. Invalid requests raise ``ValueError`` here, naming the problem; nothing is queued."""
        self._validate(request)
        handle = Handle(request, on_event)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(request.seed) & 0xFFFF_FFFF_FFFF_FFFF)
        seq = _Seq(handle, request, gen, [int(t) for t in request.input_ids])
        with self._cv:
            if self._closed:
                raise RuntimeError("the batching engine is closed")
            self._pending.append(seq)
            self._cv.notify()
        return handle

    def stats(self) -> dict:
        """A snapshot of the engine's load, for the runtime's metrics: ``waiting`` (queued, not yet in the batch),
        ``context`` (being prefilled now), ``scheduled`` (in the batch, ``context`` included), ``iterations``
        (forward passes so far) and ``sequence_tokens`` (prompt + output tokens of each sequence in the batch: what
        its KV cache holds)."""
        with self._cv:
            waiting, joining = len(self._pending), self._joining
        active = self._active  # replaced, never changed in place, by the engine thread
        batch = {id(s) for s in active}
        context = sum(1 for s in joining if id(s) not in batch and s.handle.finish_reason is None)
        return {"waiting": waiting, "context": context, "scheduled": len(active) + context,
                "iterations": self.steps + self.prefills, "sequence_tokens": [len(s.seen) for s in active]}

    def generate(self, request: GenerationRequest) -> list[int]:
        """Submit and wait: the generated tokens."""
        return self.submit(request).tokens()

    def close(self) -> None:
        """Cancel everything still running or queued and stop the engine thread."""
        with self._cv:
            self._closed = True
            for s in list(self._pending) + list(self._active):
                s.handle.cancel()
            self._cv.notify()
        self._thread.join(timeout=60)

    # --- validation ---------------------------------------------------------------------------------------------
    def _validate(self, r: GenerationRequest) -> None:
        ids = list(r.input_ids)
        if not ids:
            raise ValueError("input_ids is empty: a request needs at least one prompt token")
        bad = [t for t in ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids holds token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if r.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {r.max_new_tokens}")
        if self.max_seq_len is not None and len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room under max_seq_len={self.max_seq_len}")
        if r.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {r.temperature}")
        if r.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {r.top_k}")
        if r.top_p > 1:
            raise ValueError(f"top_p must be <= 1, got {r.top_p}")
        if r.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {r.repetition_penalty}")
        if r.embedding_bias is not None and len(r.embedding_bias) not in (0, self.vocab_size):
            raise ValueError(f"embedding_bias has {len(r.embedding_bias)} values, the vocabulary {self.vocab_size}")
        for kind, words in (("stop", r.stop_words), ("bad", r.bad_words)):
            for w in words:
                if not len(w) or any(not 0 <= int(t) < self.vocab_size for t in w):
                    raise ValueError(f"{kind} word {list(w)} is empty or holds an id outside the vocabulary")

    # --- the engine thread ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._pending and not self._active:
                    self._cv.wait()
                if self._closed and not self._pending and not self._active:
                    return
                room = self.max_batch_size - len(self._active)
                joining = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
                self._joining = joining
            if joining:
                self._admit(joining)
                self._joining = []
            self._retire_cancelled()
            if self._active:
                try:
                    self._decode_step()
                except Exception as exc:  # a failed batched step: every sequence in it gets the error
                    for s in self._active:
                        s.handle._emit(Event(len(s.generated), finish_reason=FINISH_ERROR, error=exc))
                    self._set_batch([], None, None)

    def _admit(self, joining: list[_Seq]) -> None:
        """Prefill the joining sequences, together where they fit one forward pass, and add the ones that go on to
        the batch."""
        ready = []
        for seq in joining:
            if seq.handle.cancelled:
                seq.handle._emit(Event(0, finish_reason=FINISH_CANCELLED))
                continue
            seq.handle.admitted_ns = time.time_ns()
            if self._max_new(seq) == 0 and not seq.req.return_context_logits:
                seq.handle._emit(Event(0, finish_reason=FINISH_LENGTH))
                continue
            ready.append(seq)
        # Requests for every position's logits (log-likelihoods) share fixed-shape passes with each other only:
        # each prompt's pass shape is a function of its own length, so its logits never depend on the others.
        # An engine of one sequence at a time (a sliding-window model among them, whose cache keeps the last
        # positions of a pass, padding included) prefills each alone, unpadded: nothing shares its pass.
        by_shape: dict[tuple[int, int], list[_Seq]] = {}
        for seq in (s for s in ready if s.req.return_context_logits):
            if self.max_batch_size == 1:
                self._prefill([seq])
                continue
            by_shape.setdefault(self.context_shape(len(seq.seen)), []).append(seq)
        for shape, seqs in sorted(by_shape.items()):
            for k in range(0, len(seqs), shape[0]):
                self._prefill(seqs[k:k + shape[0]], shape)
        group: list[_Seq] = []
        for seq in sorted((s for s in ready if not s.req.return_context_logits), key=lambda s: len(s.seen)):
            width = max(len(seq.seen), *(len(s.seen) for s in group)) if group else len(seq.seen)
            if group and width * (len(group) + 1) > self.max_prefill_tokens:
                self._prefill(group)
                group = []
            group.append(seq)
        if group:
            self._prefill(group)

    def context_shape(self, length: int) -> tuple[int, int]:
        """The (rows, width) of the pass that prefills a ``length``-token prompt asking for every position's logits:
        the width is the length rounded up to a multiple of ``CONTEXT_WIDTH_STEP`` (within ``max_seq_len``), the
        rows as many as the engine batches (within ``max_prefill_tokens``). Every such pass has exactly this shape,
        padded with empty rows, and each prompt sits at the start of its row (right padding, causal attention,
        no mask): the kernels a prompt's tokens go through are the same whatever shares its pass, so its logits are
        those of the prompt in any pass (bf16 GEMMs and attention otherwise round by the shape of the whole batch).
        """
        step = CONTEXT_WIDTH_STEP
        width = -(-length // step) * step
        if self.max_seq_len is not None:
            width = max(length, min(width, self.max_seq_len))
        rows = max(1, min(self.max_batch_size, self.max_prefill_tokens // width))
        return rows, width

    def _prefill(self, group: list[_Seq], shape: tuple[int, int] | None = None) -> None:
        """One forward pass over the prompts of ``group``: left-padded to the longest, each at its own positions;
        or, with ``shape`` (:meth:`context_shape`), right-padded into a pass of exactly that shape. A failure is
        retried one sequence at a time, so that it fails only the request that causes it."""
        from transformers import DynamicCache

        if shape is None:
            ids, mask, positions = self._prefill_inputs(group)
            # one prompt runs as it would alone; a padded batch gets the mask and each row's own positions
            padded = {} if len(group) == 1 else {"attention_mask": mask, "position_ids": positions}
        else:
            ids = torch.zeros(shape, dtype=torch.long, device=self.device)
            for i, s in enumerate(group):
                ids[i, :len(s.seen)] = torch.tensor(s.seen, dtype=torch.long)
            padded = {}  # causal attention: a prompt's positions never see the padding after it
        width = ids.shape[1]
        context = any(s.req.return_context_logits for s in group)
        try:
            cache = DynamicCache(config=self.model.config)
            with torch.inference_mode():
                out = self.model(input_ids=ids, use_cache=True, logits_to_keep=0 if context else 1,
                                 **padded, **{self._cache_kw: cache})
            self.prefills += 1
            kv = _layers(cache)
        except Exception as exc:
            if len(group) > 1:
                for s in group:
                    self._prefill([s], shape)
                return
            group[0].handle._emit(Event(0, finish_reason=FINISH_ERROR, error=exc))
            return
        keep = []
        for i, s in enumerate(group):
            n = len(s.seen)
            try:
                if s.req.return_context_logits:  # every position's logits were kept
                    rows = slice(0, n) if shape is not None else slice(width - n, width)
                    s.handle.context_logits = out.logits[i, rows].to("cpu", torch.float32, copy=True)
                if self._max_new(s) == 0:
                    s.handle._emit(Event(0, finish_reason=FINISH_LENGTH))
                    continue
                token, event = self._choose(s, out.logits[i, n - 1 if shape is not None else -1])
            except Exception as exc:  # this request alone fails
                s.handle._emit(Event(len(s.generated), finish_reason=FINISH_ERROR, error=exc))
                continue
            self._emit_token(s, token, event)
            if event.finish_reason is None:
                keep.append(i)
        if not keep:
            return
        if shape is not None:  # the kept rows' KV, each cut to its prompt and left-padded as the batch keeps it
            lengths = [len(group[i].seen) - 1 for i in keep]  # the token just chosen is not in the cache yet
            span = max(lengths)
            idx = torch.tensor(keep, dtype=torch.long, device=self.device)
            kv = [(_right_to_left(k.index_select(0, idx), lengths, span),
                   _right_to_left(v.index_select(0, idx), lengths, span)) for k, v in kv]
            mask = torch.zeros(len(keep), span, dtype=torch.long, device=self.device)
            for r, n in enumerate(lengths):
                mask[r, span - n:] = 1
        elif len(keep) < len(group):
            idx = torch.tensor(keep, dtype=torch.long, device=self.device)
            mask = mask.index_select(0, idx)
            start = int(mask.any(0).nonzero()[0])
            kv = [(k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:]) for k, v in kv]
            mask = mask[:, start:]
        self._merge([group[i] for i in keep], kv, mask)

    def _prefill_inputs(self, group: list[_Seq]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prefill's prompts left-padded to the longest [B, T], the attention mask [B, T] (0 on the padding) and
        position ids [B, T] (each row counted from its first real token, as if it ran alone)."""
        width = max(len(s.seen) for s in group)
        ids = torch.zeros(len(group), width, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(group), width, dtype=torch.long, device=self.device)
        for i, s in enumerate(group):
            ids[i, width - len(s.seen):] = torch.tensor(s.seen, dtype=torch.long)
            mask[i, width - len(s.seen):] = 1
        return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)

    def _merge(self, seqs: list[_Seq], kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        """Append prefilled sequences (their left-padded KV and mask) to the left-padded batch cache."""
        if self._cache is None:
            self._set_batch(seqs, kv, mask)
            return
        width = max(self._mask.shape[1], mask.shape[1])
        merged = [(torch.cat([_pad_left(bk, width), _pad_left(k, width)], 0),
                   torch.cat([_pad_left(bv, width), _pad_left(v, width)], 0))
                  for (bk, bv), (k, v) in zip(_layers(self._cache), kv)]
        mask = torch.cat([_pad_left(self._mask, width, dim=1), _pad_left(mask, width, dim=1)], 0)
        self._set_batch(self._active + seqs, merged, mask)

    def _set_batch(self, active: list[_Seq], kv, mask) -> None:
        from transformers import DynamicCache

        self._active, self._mask, self._cache = active, mask, None
        if kv is not None:
            self._cache = DynamicCache(config=self.model.config)
            for i, (k, v) in enumerate(kv):
                self._cache.update(k, v, i)

    def _retire_cancelled(self) -> None:
        keep = [i for i, s in enumerate(self._active) if not s.handle.cancelled]
        for i, s in enumerate(self._active):
            if s.handle.cancelled:
                s.handle._emit(Event(len(s.generated), finish_reason=FINISH_CANCELLED))
        self._select(keep)

    def _select(self, keep: list[int]) -> None:
        """Keep these rows of the batch (in order) and drop padding columns no remaining row needs."""
        if len(keep) == len(self._active):
            return
        if not keep:
            self._set_batch([], None, None)
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self._mask.index_select(0, idx)
        start = int(mask.any(0).nonzero()[0])
        kv = [(k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:])
              for k, v in _layers(self._cache)]
        self._set_batch([self._active[i] for i in keep], kv, mask[:, start:])

    def _decode_step(self) -> None:
        active = self._active
        last, mask, positions = self._step_inputs()
        with torch.inference_mode():
            out = self.model(input_ids=last, attention_mask=mask, position_ids=positions, use_cache=True,
                             **{self._cache_kw: self._cache})
        self.steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(active))
        self._mask = mask
        logits = out.logits[:, -1]
        keep = []
        for i, s in enumerate(active):
            if s.handle.cancelled:
                s.handle._emit(Event(len(s.generated), finish_reason=FINISH_CANCELLED))
                continue
            try:
                token, event = self._choose(s, logits[i])
            except Exception as exc:  # e.g. a sampling distribution with nothing left: this request fails alone
                s.handle._emit(Event(len(s.generated), finish_reason=FINISH_ERROR, error=exc))
                continue
            self._emit_token(s, token, event)
            if event.finish_reason is None:
                keep.append(i)
        self._select(keep)

    def _step_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decode step's last tokens [B, 1], attention mask [B, T + 1] (0 on the left padding) and position ids
        [B, 1] (each sequence's own length so far, as if it ran alone)."""
        active = self._active
        last = torch.tensor([[s.seen[-1]] for s in active], dtype=torch.long, device=self.device)
        mask = torch.cat([self._mask, torch.ones(len(active), 1, dtype=torch.long, device=self.device)], 1)
        positions = torch.tensor([[len(s.seen) - 1] for s in active], dtype=torch.long, device=self.device)
        return last, mask, positions

    # --- per-request token choice ---------------------------------------------------------------------------------
    def _max_new(self, seq: _Seq) -> int:
        n = int(seq.req.max_new_tokens)
        if self.max_seq_len is not None:
            n = min(n, self.max_seq_len - len(seq.req.input_ids))
        return max(0, n)

    def _choose(self, seq: _Seq, row: torch.Tensor) -> tuple[int, Event]:
        r = seq.req
        raw = row.float()
        logits = raw.clone()
        if r.embedding_bias is not None and len(r.embedding_bias):
            logits += torch.as_tensor(r.embedding_bias, dtype=torch.float32, device=logits.device)
        if r.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.seen)), dtype=torch.long, device=logits.device)
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / r.repetition_penalty, vals * r.repetition_penalty)
        if (r.presence_penalty or r.frequency_penalty) and seq.generated:
            ids, counts = torch.tensor(seq.generated, device=logits.device).unique(return_counts=True)
            logits[ids] -= r.presence_penalty + r.frequency_penalty * counts.float()
        for word in r.bad_words:
            prefix = list(word[:-1])
            if not prefix or seq.seen[-len(prefix):] == prefix:
                logits[int(word[-1])] = float("-inf")
        if r.end_ids and len(seq.generated) < r.min_tokens:
            logits[list(r.end_ids)] = float("-inf")
        if r.grammar is not None:  # XGrammar's token bitmask: only what the grammar allows next
            r.grammar.constrain(logits)
        if r.temperature > 0:
            logits = logits / r.temperature
        if torch.isneginf(logits).all():
            raise ValueError("every token is masked (bad words / min tokens / the grammar): nothing can be generated")
        if r.temperature <= 0 or r.top_k == 1:  # top-k 1 is greedy, as TensorRT-LLM resolves it (no softmax, no draw)
            token = int(torch.argmax(logits))
        else:
            probs = torch.softmax(_truncate(logits, r.top_k, r.top_p), -1)
            token = int(torch.multinomial(probs, 1, generator=seq.generator))
        if r.grammar is not None and not r.grammar.accept(token):  # this request alone fails
            raise ValueError(f"the grammar refused token {token}, which its own mask allowed")
        log_prob = None
        if r.return_log_probs:
            log_prob = float(torch.log_softmax(logits, -1)[token])
        return token, Event(len(seq.generated), token, log_prob,
                            raw.to("cpu", copy=True) if r.return_generation_logits else None)

    def _emit_token(self, seq: _Seq, token: int, event: Event) -> None:
        r = seq.req
        seq.generated.append(token)
        seq.seen.append(token)
        if event.log_prob is not None:
            seq.cum_log_prob += event.log_prob
        if token in r.end_ids:
            event.finish_reason = FINISH_END
        elif any(len(w) <= len(seq.generated) and seq.generated[-len(w):] == list(w) for w in r.stop_words):
            event.finish_reason = FINISH_STOP
        elif len(seq.generated) >= self._max_new(seq):
            event.finish_reason = FINISH_LENGTH
        seq.handle._emit(event)


def _truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k, then nucleus (top-p) truncation: the tokens outside get -inf."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        probs = torch.softmax(logits, -1)
        sp, si = torch.sort(probs, descending=True)
        drop = sp.cumsum(-1) - sp > top_p       # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(0, si, torch.where(drop, torch.full_like(sp, float("-inf")), logits[si]))
    return logits


def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _right_to_left(t: torch.Tensor, lengths: list[int], width: int) -> torch.Tensor:
    """Rows of a right-padded cache tensor ``[B, heads, T, dim]`` (row r's first ``lengths[r]`` positions are real)
    as a left-padded one ``[B, heads, width, dim]``."""
    out = t.new_zeros(t.shape[0], t.shape[1], width, t.shape[3])
    for r, n in enumerate(lengths):
        out[r, :, width - n:] = t[r, :, :n]
    return out


def _pad_left(t: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """Zero-pad ``t`` on the left along ``dim`` up to ``width``."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim)


def _ensure_padding_mask_support(model: torch.nn.Module) -> None:
    """An attention implementation registered by name (the reference loader's KV-quantizing one) gets SDPA's mask
    builder, so that padded batches get a proper mask; built-in implementations already have theirs."""
    impl = getattr(model.config, "_attn_implementation", None)
    if not impl:
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if impl not in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(impl, sdpa_mask)
