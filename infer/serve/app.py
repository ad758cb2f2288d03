"""The FastAPI app: wiring only. The routes are `infer.serve.handlers.router`'s (one handler per
endpoint); every error (the server's own `APIError`, a request that does not fit
its pydantic model, an unknown path or method) is answered in OpenAI's error schema; shutting
down cancels the requests still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from infer.serve import handlers
from infer.serve.protocol import APIError, validation_error

def create_app(model, api_key: str | None = None) -> FastAPI:
    """The app serving `model` (a `ServedModel`, or anything with its attributes); with
    `api_key`, /v1 requests need `Authorization: Bearer KEY`."""
    # Clients that send JSON without a Content-Type are served, as OpenAI's server does.
    app = FastAPI(title="dflash-jax", docs_url=None, redoc_url=None, lifespan=_lifespan, strict_content_type=False)
    app.add_middleware(_BodyIsJson)
    app.state.model, app.state.api_key, app.state.created = model, api_key, int(time.time())
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
    app.include_router(handlers.router)
    return app


class _BodyIsJson:
    """A POST body is read as JSON whatever its Content-Type says (curl's `-d` sends
    application/x-www-form-urlencoded): the body's own parse decides, as before the pydantic
    models, and a body that is not JSON is answered "not valid JSON"."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        await self.app(scope, receive, send)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    yield
    # Shutting down (SIGTERM): uvicorn has stopped taking connections and let the requests in
    # flight run on (up to --shutdown-timeout); whatever still runs is cancelled.
    engine = app.state.model.engine
    if engine is not None:
        await asyncio.to_thread(engine.close, cancel_running=True, timeout=30)


async def _api_error(_request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _validation_error(_request, e: RequestValidationError) -> JSONResponse:
    return await _api_error(_request, validation_error(list(e.errors())))


async def _http_error(_request, e: HTTPException) -> JSONResponse:
    """Starlette's own errors (404 for an unknown path, 405 for a wrong method, ...)."""
    err = APIError(e.status_code, str(e.detail), type="invalid_request_error" if e.status_code < 500 else "server_error")
    return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))


async def _server_error(_request, e: Exception) -> JSONResponse:
    """Anything else a handler raised: a 500 in OpenAI's schema, never a plain-text body (the
    exception then goes on to uvicorn, which logs its traceback once)."""
    err = APIError(500, "the server failed on this request; its log has the details", type="server_error")
    return JSONResponse(err.body(), status_code=500)
