"""Streaming load generator over tritonclient gRPC: one stream (and client) per concurrent worker.

The entry point's tensor names and shapes come from the server's own model config (:func:`entry_point`):

- ``inflight_batcher_llm`` (``ensemble``, ``tensorrt_llm_bls``): ``text_input``, ``max_tokens``, ``stream``; each
  streamed response holds the text of the new tokens.
- ``llmapi`` (``tensorrt_llm``): ``text_input``, ``sampling_param_max_tokens``, ``streaming``; each streamed response
  holds the whole text so far (the LLM API's ``RequestOutput`` text, as TensorRT-LLM's
  ``triton_backend/all_models/llmapi/tensorrt_llm/1/model.py`` sends it).

A tensor gets a leading batch dimension of 1 when the model batches (``max_batch_size > 0``); a model that is not
decoupled answers once, with the whole text. Output tokens are counted from the returned text with the model's
tokenizer (:func:`count_output_tokens`), as genai-perf and aiperf do, so an empty or text-less response adds none.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from pipeline.triton import layouts

# layout -> (text input, max-tokens input, streaming flag input), and the optional input that leaves the prompt out of
# the returned text (sent as true when the model has it: upstream's llmapi model returns the prompt with the text by
# default, the ensemble does when not streaming); both from the layout registry
TENSORS = {name: lay.text_tensors for name, lay in layouts.LAYOUTS.items()}
EXCLUDE_INPUT = {name: lay.exclude_input for name, lay in layouts.LAYOUTS.items()}


@dataclass(frozen=True)
class EntryPoint:
    """How to drive one model of a served repository."""

    model: str
    layout: str  # inflight_batcher_llm | llmapi
    batched: bool = True  # max_batch_size > 0: tensors carry a leading batch dimension
    decoupled: bool = True  # streams its responses; otherwise one response per request
    exclude_input: bool = True  # the model takes the layout's EXCLUDE_INPUT

    @property
    def tensors(self) -> tuple[str, str, str]:
        return TENSORS[self.layout]

    @property
    def cumulative(self) -> bool:
        """Each streamed response repeats the text so far (llmapi) rather than adding to it."""
        return layouts.get(self.layout).cumulative


def entry_point(url: str, model: str, layout: str) -> EntryPoint:
    """The entry point as the server at ``url`` serves it. Raises ``ValueError`` naming what is missing when the
    model lacks a tensor the bench sends."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        cfg = client.get_model_config(model, as_json=True).get("config", {})
    finally:
        client.close()
    names = {t.get("name") for t in cfg.get("input", [])}
    missing = [n for n in TENSORS[layout] if n not in names]
    if missing:
        raise ValueError(f"model '{model}' on {url} has no input {', '.join(repr(m) for m in missing)} of the "
                         f"{layout} layout's entry point (it has: {', '.join(sorted(n for n in names if n))})")
    output = layouts.get(layout).output
    if output not in {t.get("name") for t in cfg.get("output", [])}:
        raise ValueError(f"model '{model}' on {url} has no output '{output}'")
    decoupled = bool((cfg.get("model_transaction_policy") or {}).get("decoupled", False))
    return EntryPoint(model, layout, batched=int(cfg.get("max_batch_size", 0) or 0) > 0, decoupled=decoupled,
                      exclude_input=EXCLUDE_INPUT[layout] in names)


@dataclass
class RequestRecord:
    prompt_index: int
    sent: float = 0.0  # perf_counter at send
    sent_ns: int = 0  # wall clock (time.time_ns) at send
    first: float | None = None  # first response that carried text
    done: float | None = None  # final response (or the error)
    chunk_times: list[float] = field(default_factory=list)  # each response that carried new text
    responses: int = 0  # every response received, empty ones included
    text: str = ""
    error: str | None = None
    output_tokens: int | None = None  # the returned text re-tokenized (count_output_tokens); None until counted
    worker: int = 0  # which concurrent worker sent it
    usage_tokens: int | None = None  # the OpenAI answer's usage.completion_tokens, where its stream carried usage

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def latency(self) -> float | None:
        return None if self.done is None else self.done - self.sent

    @property
    def itl(self) -> float | None:
        """(request latency - TTFT) / (output tokens - 1), genai-perf's and aiperf's inter-token latency; None with
        fewer than two output tokens or before the tokens are counted."""
        if self.output_tokens is None or self.output_tokens < 2 or self.latency is None or self.ttft is None:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def chunk_gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def as_dict(self) -> dict:
        """One request's measurements in milliseconds (None where not measured: no text, no final response)."""
        def ms(v: float | None) -> float | None:
            return None if v is None else round(1000.0 * v, 3)

        return {"prompt_index": self.prompt_index, "time_to_first_token_ms": ms(self.ttft),
                "inter_token_latency_ms": ms(self.itl), "inter_chunk_latencies_ms": [ms(g) for g in self.chunk_gaps],
                "request_latency_ms": ms(self.latency), "output_tokens": self.output_tokens,
                "responses": self.responses, "error": self.error}


def _inputs(entry: EntryPoint, text: str, max_tokens: int):
    import tritonclient.grpc as grpcclient

    shape = (1, 1) if entry.batched else (1,)

    def tensor(name, value, np_dtype, dtype):
        arr = np.array([value], dtype=np_dtype).reshape(shape)
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    text_name, max_name, stream_name = entry.tensors
    out = [tensor(text_name, text.encode("utf-8"), object, "BYTES"),
           tensor(max_name, max_tokens, np.int32, "INT32"),
           tensor(stream_name, entry.decoupled, bool, "BOOL")]
    if entry.exclude_input:
        out.append(tensor(EXCLUDE_INPUT[entry.layout], True, bool, "BOOL"))
    return out


def _text(result) -> str:
    out = result.as_numpy("text_output")
    if out is None or not out.size:
        return ""
    return "".join(x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in out.reshape(-1))


class StreamWorker:
    """A gRPC client with one open bidirectional stream; sends one request at a time and waits for its final."""

    def __init__(self, url: str, entry: EntryPoint, timeout_s: float):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.entry, self.timeout_s = entry, timeout_s
        self.q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.q.put((time.perf_counter(), result, error)))
        self._n = 0

    def request(self, index: int, text: str, max_tokens: int) -> RequestRecord:
        rec = RequestRecord(index)
        self._n += 1
        rid = f"r{self._n}"
        rec.sent_ns, rec.sent = time.time_ns(), time.perf_counter()
        self.client.async_stream_infer(self.entry.model, _inputs(self.entry, text, max_tokens), request_id=rid,
                                       enable_empty_final_response=self.entry.decoupled)
        deadline = rec.sent + self.timeout_s
        so_far = ""
        while True:
            try:
                t, result, error = self.q.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                rec.error = f"timed out after {self.timeout_s:.0f}s"
                break
            if error is not None:
                rec.error = str(error).splitlines()[0][:300]
                rec.done = t
                break
            rec.responses += 1
            piece = _text(result)
            if self.entry.cumulative:
                if not piece.startswith(so_far):
                    rec.error = (f"response {rec.responses} does not continue the text so far: an llmapi stream "
                                 f"repeats the whole text in every response")
                    rec.done = t
                    break
                new, so_far = piece[len(so_far):], piece
            else:
                new, so_far = piece, so_far + piece
            if new:
                if rec.first is None:
                    rec.first = t
                rec.chunk_times.append(t)
            final = result.get_response().parameters.get("triton_final_response")
            if not self.entry.decoupled or (final is not None and final.bool_param):
                rec.done = t
                break
        rec.text = so_far
        return rec

    def close(self) -> None:
        try:
            self.client.stop_stream(cancel_requests=True)  # a hung server must not hang the client
        finally:
            self.client.close()


def run_level(url: str, entry: EntryPoint | str, prompts: list[str], order: list[int], concurrency: int,
              max_tokens: int, timeout_s: float,
              on_done: Callable[[], None] | None = None) -> tuple[list[RequestRecord], float]:
    """Send ``order`` (indices into prompts) with ``concurrency`` workers (``entry``: an :class:`EntryPoint`, or the
    name of a model with the ``inflight_batcher_llm`` tensors, read from the server). The workers' streams are
    open before the clock starts, and the workers start together (a barrier): a level's opening requests are sent at
    once, not each as its thread gets going (a request sent later waits less from its own send; the overhead
    benchmark reports how far apart each path sent them). Returns the records and the wall time."""
    if isinstance(entry, str):
        entry = entry_point(url, entry, layouts.IFB)
    todo: queue.Queue = queue.Queue()
    for i in order:
        todo.put(i)
    records: list[RequestRecord] = []
    lock = threading.Lock()
    workers = [StreamWorker(url, entry, timeout_s) for _ in range(concurrency)]
    timeouts = [0]  # consecutive timed-out requests: a hung server ends the level instead of every request waiting

    start = threading.Barrier(len(workers))

    def loop(k: int, w: StreamWorker) -> None:
        start.wait()
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            if timeouts[0] >= max(3, concurrency):
                rec = RequestRecord(i, error="not sent: the server stopped answering (consecutive timeouts)")
            else:
                try:
                    rec = w.request(i, prompts[i], max_tokens)
                except Exception as exc:  # a broken stream (server gone) is an error of this request, not a crash
                    rec = RequestRecord(i, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            rec.worker = k
            with lock:
                records.append(rec)
                if rec.error is None:
                    timeouts[0] = 0
                elif rec.error.startswith("timed out"):
                    timeouts[0] += 1
            if on_done:
                on_done()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(k, w), daemon=True) for k, w in enumerate(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for w in workers:
        try:
            w.close()
        except Exception:
            pass  # the server may be gone; the records already say so
    return records, wall


def count_output_tokens(records: list[RequestRecord], tokenizer) -> None:
    """Set each record's ``output_tokens`` to the token count of its returned text (no special tokens added), in
    the calling thread, after the level: counting costs the load nothing."""
    for rec in records:
        rec.output_tokens = len(tokenizer.encode(rec.text, add_special_tokens=False)) if rec.text else 0


def stats(values: list[float], unit: str = "ms", scale: float = 1000.0) -> dict:
    """avg/min/max/std and the percentiles aiperf exports, of ``values`` times ``scale`` (None for no values)."""
    keys = ("avg", "p1", "p5", "p10", "p25", "p50", "p75", "p90", "p95", "p99", "min", "max", "std")
    if not values:
        return {"unit": unit, **{k: None for k in keys}}
    a = np.array(values, dtype=float) * scale
    out = {"unit": unit, "avg": float(a.mean())}
    for k in keys[1:10]:
        out[k] = float(np.percentile(a, int(k[1:])))
    return {**out, "min": float(a.min()), "max": float(a.max()), "std": float(a.std())}


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    """genai-perf/aiperf-style statistics (milliseconds) for one concurrency level. Output tokens come from the
    re-tokenized text (:func:`count_output_tokens` first)."""
    ok = [r for r in records if r.error is None]
    if any(r.output_tokens is None for r in ok):
        raise ValueError("summarize needs the output tokens counted first (count_output_tokens)")
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "time_to_first_token": stats([r.ttft for r in ok if r.ttft is not None]),
        "inter_token_latency": stats([r.itl for r in ok if r.itl is not None]),
        "request_latency": stats([r.latency for r in ok if r.latency is not None]),
        "output_token_throughput": {"unit": "tokens/sec", "avg": out_tokens / wall_s if wall_s else 0.0},
        "request_throughput": {"unit": "requests/sec", "avg": len(ok) / wall_s if wall_s else 0.0},
        "output_sequence_length": {**stats([r.output_tokens for r in ok], "tokens", 1.0),
                                   "avg": out_tokens / len(ok) if ok else 0.0},
        "output_token_count": {"unit": "tokens", "avg": float(out_tokens)},
        "request_count": len(records),
        "error_count": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_s": wall_s,
    }


def server_model_mismatches(url: str, packaged: dict[str, Any]) -> list[str]:
    """What the server at ``url`` serves differently from ``packaged`` ({model name: its config.pbtxt parsed into
    Triton's ``ModelConfig``}): a model that is absent or not ready, a backend or platform, or an input or output
    (name, data type, dims, optional) that differs. Empty when the server serves the packaged models."""
    import tritonclient.grpc as grpcclient
    from google.protobuf.json_format import MessageToDict
    from tritonclient.utils import InferenceServerException

    def tensors(cfg: dict, kind: str) -> dict[str, tuple]:
        return {t["name"]: (t.get("data_type", "TYPE_INVALID"), tuple(int(d) for d in t.get("dims", [])),
                            bool(t.get("optional", False))) for t in cfg.get(kind, [])}

    out: list[str] = []
    client = grpcclient.InferenceServerClient(url)
    try:
        for name, model_cfg in sorted(packaged.items()):
            want = MessageToDict(model_cfg, preserving_proto_field_name=True)
            try:
                ready = client.is_model_ready(name)
                have = client.get_model_config(name, as_json=True).get("config", {}) if ready else None
            except InferenceServerException as exc:
                ready, have = False, None
                if "unknown model" not in str(exc).lower() and "not found" not in str(exc).lower():
                    out.append(f"model '{name}': {str(exc).splitlines()[0]}")
                    continue
            if not ready or have is None:
                out.append(f"model '{name}' is not served (or not ready)")
                continue
            for key in ("backend", "platform"):
                if want.get(key) and want.get(key) != have.get(key):
                    out.append(f"model '{name}': {key} '{have.get(key)}', packaged '{want[key]}'")
            for kind in ("input", "output"):
                w, h = tensors(want, kind), tensors(have, kind)
                for t in sorted(set(w) - set(h)):
                    out.append(f"model '{name}': {kind} '{t}' is missing")
                for t in sorted(set(h) - set(w)):
                    out.append(f"model '{name}': {kind} '{t}' is not in the packaged config")
                for t in sorted(set(w) & set(h)):
                    if w[t] != h[t]:
                        out.append(f"model '{name}': {kind} '{t}' is {h[t][0]} dims {list(h[t][1])}"
                                   f"{' optional' if h[t][2] else ''}, packaged {w[t][0]} dims {list(w[t][1])}"
                                   f"{' optional' if w[t][2] else ''}")
    finally:
        client.close()
    return out
