"""The FastAPI app: wiring only. The routes are `infer.serve.handlers.router`'s (one handler per
endpoint); every error (the server's own `APIError`, a request that does not fit
its pydantic model, an unknown path or method) is answered in OpenAI's error schema; shutting
down cancels the requests still running.

Before any route sees a request, `_Guard` checks its API key and reads its body (size- and
time-bounded), so that no request can hold the event loop or the server's memory: see its doc.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from infer.serve import handlers
from infer.serve.protocol import APIError, validation_error

MAX_REQUEST_BYTES = 8 << 20  # --max-request-bytes' default: a request body's limit (8 MiB)
REQUEST_READ_TIMEOUT = 30.0  # --request-read-timeout's default: seconds a request body may take to arrive


def create_app(model, api_key: str | None = None, *, max_request_bytes: int | None = None,
               request_read_timeout: float | None = None) -> FastAPI:
    """The app serving `model` (a `ServedModel`, or anything with its attributes); with
    `api_key`, every path but /health needs `Authorization: Bearer KEY`. A request body is at
    most `max_request_bytes` (None: MAX_REQUEST_BYTES) and must arrive within
    `request_read_timeout` seconds (None: REQUEST_READ_TIMEOUT; see `_Guard`)."""
    # Clients that send JSON without a Content-Type are served, as OpenAI's server does.
    app = FastAPI(title="dflash-jax", docs_url=None, redoc_url=None, lifespan=_lifespan, strict_content_type=False)
    app.add_middleware(_BodyIsJson)
    # Added last, so outermost: nothing reads a request before it.
    app.add_middleware(_Guard, api_key=api_key, max_bytes=max_request_bytes or MAX_REQUEST_BYTES,
                       read_timeout=request_read_timeout or REQUEST_READ_TIMEOUT)
    app.state.model, app.state.created = model, int(time.time())
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
    app.include_router(handlers.router)
    return app


class _Guard:
    """What every request passes before the app reads it (an ASGI middleware, outermost):

    - the API key, when the server has one: every path but /health needs `Authorization: Bearer
      KEY` (the scheme in any case; the key compared in constant time), else 401, answered
      without reading the body (the connection closes): a client without the key costs the
      server no body;
    - the body, read whole here, then handed to the app from memory: one of more than
      `max_bytes` is answered 413 (at once from its Content-Length, or as its bytes arrive when it
      is chunked), one that has not arrived `read_timeout` seconds after the headers 408 (a client
      that stalls mid-body holds no handler); both close the connection."""

    OPEN = frozenset({"/health"})

    def __init__(self, app, api_key: str | None, max_bytes: int, read_timeout: float):
        self.app, self.max_bytes, self.read_timeout = app, max_bytes, read_timeout
        self.key = None if api_key is None else api_key.encode()

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        value = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        scheme, _, token = value.strip().partition(b" ")
        # compare_digest on every request, the scheme checked after: the time says nothing of the key.
        return hmac.compare_digest(token.strip(), self.key) & (scheme.lower() == b"bearer")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.key is not None and scope["path"] not in self.OPEN and not self.authorized(scope["headers"]):
            await _answer(scope, send, APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                                                type="authentication_error", code="invalid_api_key"),
                          {"WWW-Authenticate": "Bearer", "Connection": "close"})
            return
        length = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), None)
        if length is not None and (not length.strip().isdigit() or int(length) > self.max_bytes):
            await _answer(scope, send, self.too_large() if length.strip().isdigit() else
                          APIError(400, "the request's Content-Length is not a number"), {"Connection": "close"})
            return
        try:
            body = await asyncio.wait_for(self.read(receive), self.read_timeout)
        except asyncio.TimeoutError:
            await _answer(scope, send, APIError(408, f"the request body did not arrive within "
                                                     f"{self.read_timeout:g} s (--request-read-timeout)",
                                                code="request_timeout"), {"Connection": "close"})
            return
        if body is None:  # the client went away mid-body
            return
        if isinstance(body, APIError):
            await _answer(scope, send, body, {"Connection": "close"})
            return
        read = False

        async def replay():
            nonlocal read
            if not read:
                read = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect

        await self.app(scope, replay, send)

    async def read(self, receive) -> bytes | APIError | None:
        """The whole body; 413's error past max_bytes; None if the client went away."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return self.too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit ({self.max_bytes} bytes, its "
                             f"--max-request-bytes)", code="request_too_large")


async def _answer(scope, send, error: APIError, headers: dict[str, str]) -> None:
    """Answer `error` in OpenAI's schema, the request's body unread."""
    await JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, _no_receive, send)


async def _no_receive():
    raise RuntimeError("an answer sent before the request's body is read does not read it")


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
