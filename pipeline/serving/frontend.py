"""The OpenAI front end for one served model: :class:`FrontEnd`, built from a ``serve.openai`` config by
:meth:`FrontEnd.from_config` (what ``pipeline serve``, ``python -m pipeline.serving``, the bench and the task
evaluation all use), with its settings, its driver to Triton, its two generation endpoints (``chat``,
``completions``), the checks every request goes through (the API key, the body's size and JSON, the model's
name), its metrics and its access log (``pipeline.serving.observe``). :meth:`FrontEnd.app` is its Starlette
application (``pipeline.serving.app``)."""
from __future__ import annotations

import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from pipeline.errors import UserError
from pipeline.serving import model as served_model, observe, protocol as P
from pipeline.serving.app import create_app
from pipeline.serving.chat import ChatEndpoint
from pipeline.serving.completions import CompletionsEndpoint
from pipeline.serving.driver import Driver
from pipeline.serving.guide import Guides
from pipeline.serving.model import ServedModel
from pipeline.triton import layouts


@dataclass
class Settings:
    api_key: str | None = None  # required as "Authorization: Bearer KEY" when set
    max_body_bytes: int = 8 << 20
    max_tokens: int = 4096  # the default max_tokens is the remaining context, capped here
    request_timeout_s: float = 600.0
    stream_status_wait_s: float = 0.005  # a stream's status waits this long for Triton's verdict (serving.endpoint)

    @classmethod
    def from_config(cls, openai_cfg) -> "Settings":
        """``serve.openai`` -> the settings; the API key is read from the environment variable it names."""
        key = None
        env = openai_cfg.api_key_env
        if env:
            key = os.environ.get(str(env), "")
            if not key:
                raise UserError(f"serve.openai.api_key_env={env}: that environment variable is unset or empty; "
                                f"export the key in it, or set serve.openai.api_key_env=null to serve without a key")
        lim = openai_cfg.limits
        return cls(api_key=key, max_body_bytes=int(lim.max_body_bytes), max_tokens=int(lim.max_tokens),
                   request_timeout_s=float(lim.request_timeout_s),
                   stream_status_wait_s=float(lim.stream_status_wait_ms) / 1000)


class FrontEnd:
    def __init__(self, served: ServedModel, driver: Driver, settings: Settings | None = None,
                 access_log: observe.AccessLog | None = None):
        self.served, self.driver, self.settings = served, driver, settings or Settings()
        self.guides = Guides(served)  # response_format and tools as guided decoding, compiled once per guide
        self.chat = ChatEndpoint(self)
        self.completions = CompletionsEndpoint(self)
        self.metrics = observe.Metrics(served.name, observe.ttft_budget(served.repo))
        self.access_log = access_log or observe.AccessLog()
        self.loop = None  # the server's event loop, once it runs (pipeline.serving.app's lifespan)

    @classmethod
    def from_config(cls, openai_cfg, repo: Path, grpc_url: str) -> "FrontEnd":
        """The front end ``serve.openai`` (``openai_cfg``) describes, for the repository ``repo`` (a bundle's
        ``triton_repo/`` included) served by Triton at ``grpc_url`` (set ``driver.url`` later where the server is
        not up yet). Everything it needs is checked here: the API key's variable, the repository and its tokenizer,
        ``entry_point`` against the layout's entry points. Raises :class:`UserError`."""
        settings = Settings.from_config(openai_cfg)
        served = served_model.load(repo, name=openai_cfg.model_name)
        entry = getattr(openai_cfg.entry_point, "value", openai_cfg.entry_point)
        if entry == "auto":
            entry = None
        else:
            layouts.get(served.layout).check_entry(entry)
        log = observe.AccessLog(openai_cfg.access_log.path, openai_cfg.access_log.stderr)
        return cls(served, Driver(grpc_url, served, entry=entry, timeout_s=settings.request_timeout_s), settings,
                   log)

    def app(self, drain=None):
        """The ASGI application (``pipeline.serving.app.create_app``), behind ``drain``'s gate where one is given
        (:class:`pipeline.serving.run.Drain`)."""
        return create_app(self, drain)

    # --- request checks ---------------------------------------------------------------------------------------
    def authorize(self, request) -> None:
        key = self.settings.api_key
        if not key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise P.APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                             code="invalid_api_key")

    async def body(self, request) -> dict:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise P.APIError(413, f"request body of {int(declared)} bytes is over the limit of {limit} bytes "
                                  f"(serve.openai.limits.max_body_bytes)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise P.APIError(413, f"request body is over the limit of {limit} bytes "
                                      f"(serve.openai.limits.max_body_bytes)")
            chunks.append(chunk)
        try:
            data = json.loads(b"".join(chunks) or b"null")
        except ValueError as exc:
            raise P.APIError(400, f"the body is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise P.APIError(400, "the body must be a JSON object")
        return data

    def check_model(self, name: str) -> None:
        if name != self.served.name:
            raise P.APIError(404, f"The model '{name}' does not exist; this server serves '{self.served.name}' "
                                  f"(GET /v1/models)", param="model", code="model_not_found")

    async def parse(self, request, cls):
        """The request's body as ``cls`` (a request model of ``protocol``), every check passed."""
        self.authorize(request)
        data = await self.body(request)
        try:
            req = cls.model_validate(data)
        except ValidationError as exc:
            raise P.from_validation(exc) from None
        P.unsupported(req)
        self.check_model(req.model)
        return req

    def model_card(self) -> P.ModelCard:
        served = self.served
        return P.ModelCard(id=served.name, object="model", created=served.created, owned_by="llm-pipeline",
                           root=served.name, max_model_len=served.max_seq_len,
                           metadata={k: v for k, v in served.metadata.items() if v is not None})
