"""The OpenAI-compatible HTTP front end's routes (Starlette): ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream`` true or false; the endpoints are
``pipeline.serving.completions`` and ``pipeline.serving.chat``), ``GET /health`` and ``GET /metrics`` (Prometheus'
text format: the front end's metrics, then Triton's; ``pipeline.serving.observe``). Every error is answered in
OpenAI's schema, a 503 with ``Retry-After``; a client that goes away cancels its generation on the Triton server.
While Triton is down (it died, or ``pipeline serve`` restarts it) a generation request is answered 503 at once with
the reason."""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from pipeline.serving import protocol as P
from pipeline.serving.drain import RETRY_AFTER_S, DrainGate

log = logging.getLogger("pipeline.serving")
HEALTH_TIMEOUT_S = 2.0  # GET /health answers within this, ready or not


def _error_response(exc: P.APIError):
    from starlette.responses import Response

    # what the client is told, logged here too: a server fault as an error, a refused request at info level
    log.log(logging.ERROR if exc.status >= 500 else logging.INFO, "%d %s", exc.status, exc.message)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else \
        {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
    return Response(P.dumps(exc.body()), status_code=exc.status, media_type="application/json", headers=headers)


def create_app(fe, drain=None):
    """The ASGI application of a :class:`~pipeline.serving.frontend.FrontEnd`: plain Starlette routes (request in,
    response out, no dependency injection on the request path), OpenAI's error schema for every error; behind the
    drain gate of ``drain`` (a :class:`pipeline.serving.run.Drain`, ``pipeline serve``) where one is given, and the
    observer (request ids, metrics, the access log) in front of everything."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from pipeline.serving import observe

    driver = fe.driver

    @asynccontextmanager
    async def lifespan(app):
        app.state.loop = fe.loop = asyncio.get_running_loop()
        await driver.start()
        try:
            yield
        finally:
            await driver.close()

    async def _api_error(request, exc: P.APIError):
        return _error_response(exc)

    async def _http_error(request, exc):
        status = exc.status_code
        msg = f"no route {request.method} {request.url.path}" if status in (404, 405) else str(exc.detail)
        return _error_response(P.APIError(status, msg))

    async def _internal(request, exc):
        return _error_response(P.APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    async def health(request):
        if driver.down:
            return _error_response(P.APIError(503, f"Triton at {driver.url} is down: {driver.down}"))
        try:  # bounded: a stalled server (SIGSTOP, a hung process) holds the gRPC call open
            ready = await asyncio.wait_for(driver.ready(), HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            return _error_response(P.APIError(503, f"Triton at {driver.url} did not answer a readiness probe "
                                                   f"within {HEALTH_TIMEOUT_S:g} s"))
        if ready:
            return JSONResponse({"status": "ok"})
        return _error_response(P.APIError(503, f"Triton at {driver.url} is not ready"))

    async def metrics(request):
        fe.metrics.draining.set(1 if drain is not None and drain.started else 0)
        ready = False
        if not driver.down:
            try:
                ready = await asyncio.wait_for(driver.ready(), observe.READY_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass
        fe.metrics.ready.set(1 if ready else 0)
        text = await observe.triton_metrics(driver.metrics_url)
        return Response(fe.metrics.render(text), media_type=observe.CONTENT_TYPE)

    def needs_triton(handle):
        async def guarded(request):  # Triton is down (dead, or being restarted): no request to a server that is gone
            if driver.down:
                fe.authorize(request)  # the reason is for clients with the key
                raise P.APIError(503, f"Triton at {driver.url} is down: {driver.down}")
            return await handle(request)

        return guarded

    async def models(request):
        fe.authorize(request)
        return Response(P.dump(P.ModelList(object="list", data=[fe.model_card()])), media_type="application/json")

    async def model(request):
        fe.authorize(request)
        fe.check_model(request.path_params["name"])
        return Response(P.dump(fe.model_card()), media_type="application/json")

    routes = [Route("/health", health, methods=["GET"]), Route("/metrics", metrics, methods=["GET"]),
              Route("/v1/models", models, methods=["GET"]), Route("/v1/models/{name:path}", model, methods=["GET"]),
              Route("/v1/completions", needs_triton(fe.completions.handle), methods=["POST"]),
              Route("/v1/chat/completions", needs_triton(fe.chat.handle), methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        P.APIError: _api_error, StarletteHTTPException: _http_error, Exception: _internal})
    app.state.front_end = fe
    inner = app
    if drain is not None:
        inner = DrainGate(app, drain)
    outer = observe.Observer(inner, fe)
    outer.state = app.state
    return outer
