"""Streaming load generator over tritonclient gRPC: one stream (and client) per concurrent worker."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass
class RequestRecord:
    prompt_index: int
    sent: float = 0.0
    first: float | None = None  # first token response
    done: float | None = None
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def latency(self) -> float | None:
        return None if self.done is None else self.done - self.sent

    @property
    def itl(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    def as_dict(self) -> dict:
        """One request's measurements in milliseconds (None where not measured: no token, no final response)."""
        def ms(v: float | None) -> float | None:
            return None if v is None else round(1000.0 * v, 3)

        gaps = [b - a for a, b in zip(self.token_times, self.token_times[1:])]
        return {"prompt_index": self.prompt_index, "time_to_first_token_ms": ms(self.ttft),
                "inter_token_latency_ms": ms(self.itl), "inter_token_latencies_ms": [ms(g) for g in gaps],
                "request_latency_ms": ms(self.latency), "output_tokens": self.output_tokens, "error": self.error}


def _inputs(text: str, max_tokens: int, stream: bool):
    import tritonclient.grpc as grpcclient

    def tensor(name, arr, dtype):
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    return [tensor("text_input", np.array([[text.encode("utf-8")]], dtype=object), "BYTES"),
            tensor("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
            tensor("stream", np.array([[stream]], dtype=bool), "BOOL")]


class StreamWorker:
    """A gRPC client with one open bidirectional stream; sends one request at a time and waits for its final."""

    def __init__(self, url: str, model: str, timeout_s: float):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.model, self.timeout_s = model, timeout_s
        self.q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.q.put((time.perf_counter(), result, error)))
        self._n = 0

    def request(self, index: int, text: str, max_tokens: int) -> RequestRecord:
        rec = RequestRecord(index)
        self._n += 1
        rid = f"r{self._n}"
        rec.sent = time.perf_counter()
        self.client.async_stream_infer(self.model, _inputs(text, max_tokens, True), request_id=rid,
                                       enable_empty_final_response=True)
        deadline = rec.sent + self.timeout_s
        pieces: list[str] = []
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
            resp = result.get_response()
            out = result.as_numpy("text_output")
            if out is not None and out.size:
                if rec.first is None:
                    rec.first = t
                rec.token_times.append(t)
                pieces.extend(x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in out.reshape(-1))
            final = resp.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                rec.done = t
                break
        rec.text = "".join(pieces)
        return rec

    def close(self) -> None:
        try:
            self.client.stop_stream(cancel_requests=True)  # a hung server must not hang the client
        finally:
            self.client.close()


def run_level(url: str, model: str, prompts: list[str], order: list[int], concurrency: int, max_tokens: int,
              timeout_s: float, on_done: Callable[[], None] | None = None) -> tuple[list[RequestRecord], float]:
    """Send ``order`` (indices into prompts) with ``concurrency`` workers. Returns the records and the wall time."""
    todo: queue.Queue = queue.Queue()
    for i in order:
        todo.put(i)
    records: list[RequestRecord] = []
    lock = threading.Lock()
    workers = [StreamWorker(url, model, timeout_s) for _ in range(concurrency)]
    timeouts = [0]  # consecutive timed-out requests: a hung server ends the level instead of every request waiting

    def loop(w: StreamWorker) -> None:
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
            with lock:
                records.append(rec)
                timeouts[0] = timeouts[0] + 1 if rec.error and rec.error.startswith("timed out") else 0 \
                    if rec.error is None else timeouts[0]
            if on_done:
                on_done()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(w,), daemon=True) for w in workers]
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


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    """genai-perf-style statistics (milliseconds) for one concurrency level."""
    ok = [r for r in records if r.error is None]

    def stats(values: list[float]) -> dict:
        if not values:
            return {"unit": "ms", "avg": None, "p50": None, "p95": None, "p99": None, "min": None, "max": None}
        a = np.array(values) * 1000.0
        return {"unit": "ms", "avg": float(a.mean()), "p50": float(np.percentile(a, 50)),
                "p95": float(np.percentile(a, 95)), "p99": float(np.percentile(a, 99)), "min": float(a.min()),
                "max": float(a.max())}

    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "time_to_first_token": stats([r.ttft for r in ok if r.ttft is not None]),
        "inter_token_latency": stats([r.itl for r in ok if r.itl is not None]),
        "request_latency": stats([r.latency for r in ok if r.latency is not None]),
        "output_token_throughput": {"unit": "tokens/sec", "avg": out_tokens / wall_s if wall_s else 0.0},
        "request_throughput": {"unit": "requests/sec", "avg": len(ok) / wall_s if wall_s else 0.0},
        "output_sequence_length": {"unit": "tokens", "avg": out_tokens / len(ok) if ok else 0.0},
        "request_count": len(records),
        "error_count": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "wall_s": wall_s,
    }
