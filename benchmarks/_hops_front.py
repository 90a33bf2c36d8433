"""The OpenAI front end (``python -m pipeline.serving``) with a monotonic timestamp at each hop of a request, for
``benchmarks/openai_hops.py``. It wraps a few functions of uvicorn's httptools protocol and of the front end; this
is a diagnostic that follows those internals (uvicorn 0.54), not part of the served path. Marks go to the JSON file
named by ``HOPS_OUT`` when the process ends (SIGTERM).

    python -m benchmarks._hops_front REPO GRPC_URL [serve.openai.*=...]
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

MARKS: list[tuple[str, int]] = []


def mark(name: str) -> None:
    MARKS.append((name, time.monotonic_ns()))


def dump(*_: object) -> None:
    with open(os.environ["HOPS_OUT"], "w") as f:
        json.dump(MARKS, f)


def wrap(owner, name: str, before: str | None = None, after: str | None = None) -> None:
    import inspect

    fn = getattr(owner, name)
    if inspect.iscoroutinefunction(fn):
        async def wrapped(*a, **kw):
            if before:
                mark(before)
            out = await fn(*a, **kw)
            if after:
                mark(after)
            return out
    else:
        def wrapped(*a, **kw):
            if before:
                mark(before)
            out = fn(*a, **kw)
            if after:
                mark(after)
            return out
    setattr(owner, name, wrapped)


def main() -> int:
    from uvicorn.protocols.http import httptools_impl as H

    from pipeline.serving import completions as C
    from pipeline.serving import transport as T

    wrap(H.HttpToolsProtocol, "on_message_begin", before="recv")  # the request's first bytes parsed
    wrap(C.CompletionsEndpoint, "jobs", before="parsed", after="jobs")  # routed, read, validated; jobs made
    wrap(T.Mux, "submit", before="submit")  # handed to the shared gRPC stream
    wrap(T.Inbox, "put", before="resp")  # a response from Triton routed to its request
    send = H.RequestResponseCycle.send

    async def traced_send(self, message):
        if message["type"] == "http.response.start":
            mark("headers")
        elif message.get("body"):
            mark("chunk")
        return await send(self, message)

    H.RequestResponseCycle.send = traced_send
    signal.signal(signal.SIGTERM, lambda *_: (dump(), os._exit(0)))
    from pipeline.serving.__main__ import main as serve

    return serve(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
