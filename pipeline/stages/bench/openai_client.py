"""Streaming load generator over the OpenAI API (aiohttp), measuring what an application sees: the same
:class:`pipeline.stages.bench.triton_client.RequestRecord` per request as the gRPC generator, so both summarize alike.

Each request is a streamed ``POST /v1/chat/completions`` (or ``/v1/completions``) with ``temperature: 0`` (greedy,
as the gRPC entry point decodes by default) and ``max_tokens``; TTFT is the first server-sent chunk that carries
text, inter-chunk gaps are the gaps between such chunks, the request ends at ``data: [DONE]``. Output tokens are
counted from the returned text with the model's tokenizer afterwards (``count_output_tokens``), exactly as for the
gRPC rows. ``concurrency`` workers share one connection pool in one event loop on a thread of its own: uvloop's
where it is installed (as aiperf runs its aiohttp workers), else asyncio's. The pool's ``concurrency`` connections
are opened before the clock starts (a ``GET /v1/models`` on each), as the gRPC generator opens its streams before
its first request and as an application keeps its connections: the time to first token of a level's first
requests is then not a TCP connect and a new HTTP connection. The workers start one after another, each once the
one before has handed its first request to the event loop: before Python 3.12, aiohttp writes a request's body in a
task of its own, which started workers would queue behind each other's sends, so the level's first request would
leave only after the last one was sent (3.12 and later write it at once, and the order is the same).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

from pipeline.stages.bench.triton_client import RequestRecord


async def _open(session, base_url: str, n: int) -> None:
    """Open ``n`` pooled connections: ``n`` concurrent ``GET /v1/models`` (whatever their status; a server that does
    not answer is reported by the timed requests)."""
    import aiohttp

    async def one() -> None:
        try:
            async with session.get(f"{base_url}/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
                await r.read()
        except Exception:
            pass

    await asyncio.gather(*(one() for _ in range(n)))


async def _one(session, url: str, body: dict, rec: RequestRecord, chat: bool, timeout_s: float) -> None:
    import aiohttp

    rec.sent_ns, rec.sent = time.time_ns(), time.perf_counter()
    parts: list[str] = []
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                try:
                    msg = (await r.json()).get("error", {}).get("message", "")
                except Exception:
                    msg = (await r.text())[:200]
                rec.error = f"HTTP {r.status}: {msg}"[:300]
                rec.done = time.perf_counter()
                return
            buf = b""
            async for chunk in r.content.iter_any():
                t = time.perf_counter()
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            rec.done = t
                            continue
                        doc = json.loads(data)
                        rec.responses += 1
                        if "error" in doc:
                            rec.error = str(doc["error"].get("message"))[:300]
                            continue
                        if doc.get("usage"):  # stream_options.include_usage: the engine's own count
                            rec.usage_tokens = doc["usage"].get("completion_tokens")
                        for ch in doc.get("choices") or []:
                            piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                            if piece:
                                parts.append(piece)
                                if rec.first is None:
                                    rec.first = t
                                rec.chunk_times.append(t)
            if rec.done is None and rec.error is None:
                rec.error = "the stream ended without data: [DONE]"
                rec.done = time.perf_counter()
    except asyncio.TimeoutError:
        rec.error = f"timed out after {timeout_s:.0f}s"
    except Exception as exc:  # a broken connection is this request's error
        rec.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        rec.done = time.perf_counter()
    rec.text = "".join(parts)


def run_level(base_url: str, model: str, prompts: list[str], order: list[int], concurrency: int, max_tokens: int,
              timeout_s: float, chat: bool = True, extra: dict | None = None,
              on_done: Callable[[], None] | None = None, preconnect: bool = True, stagger: bool = True,
              trace_configs: list | None = None, api_key: str | None = None) -> tuple[list[RequestRecord], float]:
    """Send ``order`` (indices into ``prompts``) with ``concurrency`` workers to the OpenAI endpoint at
    ``base_url`` (``http://HOST:PORT/v1``), on connections opened first (``preconnect``), each worker started once
    the one before has sent (``stagger``; see the module docstring); ``trace_configs``: aiohttp's request tracing;
    ``api_key``: sent as ``Authorization: Bearer KEY``. Returns the records and the wall time."""
    import aiohttp

    url = f"{base_url}/chat/completions" if chat else f"{base_url}/completions"

    def body(i: int) -> dict:
        b = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0, **(extra or {})}
        if chat:
            b["messages"] = [{"role": "user", "content": prompts[i]}]
        else:
            b["prompt"] = prompts[i]
        return b

    async def main() -> tuple[list[RequestRecord], float]:
        todo: asyncio.Queue = asyncio.Queue()
        for i in order:
            todo.put_nowait(i)
        records: list[RequestRecord] = []
        conn = aiohttp.TCPConnector(limit=max(1, concurrency), force_close=False)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        async with aiohttp.ClientSession(connector=conn, trace_configs=trace_configs, headers=headers) as session:
            if preconnect:
                await _open(session, base_url, max(1, concurrency))

            async def worker(k: int) -> None:
                while not todo.empty():
                    i = todo.get_nowait()
                    rec = RequestRecord(i, worker=k)
                    await _one(session, url, body(i), rec, chat, timeout_s)
                    records.append(rec)
                    if on_done:
                        on_done()

            t0 = time.perf_counter()
            tasks = []
            for k in range(concurrency):
                tasks.append(asyncio.ensure_future(worker(k)))
                if stagger:
                    await asyncio.sleep(0)  # the worker runs up to its request's send; its body task runs next
            await asyncio.gather(*tasks)
            return records, time.perf_counter() - t0

    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())
