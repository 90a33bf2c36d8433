"""The OpenAI load generator (``pipeline.stages.bench.openai_client``) against a real HTTP server (aiohttp's): which connection
each request came on."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest


@pytest.fixture
def sse_server():
    """An HTTP server that answers ``GET /v1/models`` and streams a two-piece completion, logging (method, the
    client's port) per request: the port tells the connection apart."""
    from aiohttp import web

    log: list[tuple[str, int]] = []

    async def models(request):
        log.append(("GET", request.transport.get_extra_info("peername")[1]))
        return web.json_response({"object": "list", "data": []})

    async def completions(request):
        log.append(("POST", request.transport.get_extra_info("peername")[1]))
        r = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await r.prepare(request)
        for piece in ("a", "b"):
            await asyncio.sleep(0.005)
            await r.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": piece}]}).encode() + b"\n\n")
        await r.write(b"data: [DONE]\n\n")
        return r

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions)])
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}/v1", log
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.run_until_complete(runner.cleanup())
    loop.close()


def test_the_timed_requests_go_on_connections_opened_before_the_clock(sse_server):
    from pipeline.stages.bench import openai_client as client

    url, log = sse_server
    records, _ = client.run_level(url, "m", ["p"] * 12, list(range(12)), 4, 8, 30, chat=False)
    assert [r.error for r in records] == [None] * 12 and all(r.text == "ab" for r in records)
    opened = {port for method, port in log if method == "GET"}
    used = {port for method, port in log if method == "POST"}
    assert len(opened) == 4 and used <= opened, log  # every timed request on a connection already open
    first_post = next(i for i, (method, _) in enumerate(log) if method == "POST")
    assert [m for m, _ in log[:first_post]] == ["GET"] * 4

    # negative control: without opening them first, the level's first requests open their own connections
    log.clear()
    client.run_level(url, "m", ["p"] * 12, list(range(12)), 4, 8, 30, chat=False, preconnect=False)
    assert not any(method == "GET" for method, _ in log) and len({port for _, port in log}) == 4


def _send_order(url: str, stagger: bool) -> list[str]:
    """The order in which a level of 4 workers began its POSTs ("start") and wrote their bodies ("body"), from
    aiohttp's own request tracing."""
    import aiohttp

    from pipeline.stages.bench import openai_client as client

    events: list[str] = []

    async def start(session, ctx, params):
        if params.method == "POST":
            events.append("start")

    async def chunk(session, ctx, params):
        events.append("body")

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(start)
    trace.on_request_chunk_sent.append(chunk)
    records, _ = client.run_level(url, "m", ["p"] * 4, list(range(4)), 4, 8, 30, chat=False, stagger=stagger,
                                  trace_configs=[trace])
    assert [r.error for r in records] == [None] * 4
    return events


def test_each_opening_request_is_written_before_the_next_worker_sends(sse_server):
    import sys

    url, _ = sse_server
    assert _send_order(url, stagger=True) == ["start", "body"] * 4
    # negative control: workers started together queue their body writes (a task each, before Python 3.12)
    # behind every worker's send, so the first request leaves after the last one was sent
    together = _send_order(url, stagger=False)
    if sys.version_info < (3, 12):
        assert together == ["start"] * 4 + ["body"] * 4
    else:
        assert together == ["start", "body"] * 4  # aiohttp writes the body at once (an eager task) from 3.12
