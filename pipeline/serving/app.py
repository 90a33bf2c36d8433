"""The OpenAI-compatible HTTP front end's routes (Starlette): ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream`` true or false; the endpoints are
``pipeline.serving.completions`` and ``pipeline.serving.chat``), ``GET /health``. Every error is answered in
OpenAI's schema; a client that goes away cancels its generation on the Triton server."""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from pipeline.serving import protocol as P

log = logging.getLogger("pipeline.serving")
HEALTH_TIMEOUT_S = 2.0  # GET /health answers within this, ready or not


def _error_response(exc: P.APIError):
    from starlette.responses import Response

    # what the client is told, logged here too: a server fault as an error, a refused request at info level
    log.log(logging.ERROR if exc.status >= 500 else logging.INFO, "%d %s", exc.status, exc.message)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return Response(P.dumps(exc.body()), status_code=exc.status, media_type="application/json", headers=headers)


def create_app(fe):
    """The ASGI application of a :class:`~pipeline.serving.frontend.FrontEnd`: plain Starlette routes (request in,
    response out, no dependency injection on the request path), OpenAI's error schema for every error."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    driver = fe.driver

    @asynccontextmanager
    async def lifespan(app):
        app.state.loop = asyncio.get_running_loop()
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

    async def models(request):
        fe.authorize(request)
        return Response(P.dump(P.ModelList(object="list", data=[fe.model_card()])), media_type="application/json")

    async def model(request):
        fe.authorize(request)
        fe.check_model(request.path_params["name"])
        return Response(P.dump(fe.model_card()), media_type="application/json")

    routes = [Route("/health", health, methods=["GET"]), Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{name:path}", model, methods=["GET"]),
              Route("/v1/completions", fe.completions.handle, methods=["POST"]),
              Route("/v1/chat/completions", fe.chat.handle, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        P.APIError: _api_error, StarletteHTTPException: _http_error, Exception: _internal})
    app.state.front_end = fe
    return app
