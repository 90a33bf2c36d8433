"""The OpenAI endpoint the evaluation talks to: the project's front end (``pipeline.serving``) before a Triton
server, on a free loopback port, for as long as the evaluation runs."""
from __future__ import annotations

import contextlib
import json
import os
import urllib.request
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def openai(serve, server, repo: Path, work: Path) -> Iterator[str]:
    """The front end for ``repo`` served by ``server`` (a ``pipeline.triton.server.Server``: local, docker or
    external), with ``serve.openai``'s settings but on a free port of its host; yields its base URL
    (``http://HOST:PORT/v1``)."""
    from pipeline.serving import run as frontend

    with frontend.running(repo, server.grpc_url, serve.openai, host=str(serve.openai.host), port=0) as url:
        yield url


def api_key(serve) -> str | None:
    """The key the front end requires (``serve.openai.api_key_env`` names the variable holding it), or None."""
    name = serve.openai.get("api_key_env") if "openai" in serve else None
    return os.environ.get(str(name)) if name else None


def model_name(url: str, key: str | None = None, timeout_s: float = 30.0) -> str:
    """The model the endpoint serves (``GET /v1/models``: its first entry)."""
    req = urllib.request.Request(f"{url.rstrip('/')}/models",
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        doc: dict[str, Any] = json.loads(r.read())
    data = doc.get("data") or []
    if not data:
        raise RuntimeError(f"{url}/models lists no model")
    return str(data[0]["id"])
