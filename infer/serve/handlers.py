"""One handler per endpoint, each declared with its route on `router` (which `infer.serve.app`
includes): an endpoint is added here, in one place. Each reads the served model from the app's
state (`app.state.model`, a `ServedModel`); the warming-up check runs before them, as a FastAPI
dependency (`require_ready`). The API key is checked before the app reads a request
(`infer.serve.app`'s middleware). Tokenizing a prompt runs on a worker thread, so that a long
one holds neither /health nor the streams.
"""

from __future__ import annotations

import asyncio
import secrets

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.requests import Request as HTTPRequest

from dflash_jax.engine.streaming import Closed, QueueFull
from dflash_jax.engine.streaming import StreamRequest
from dflash_jax.errors import DFlashError
from infer.serve.metrics import metrics_text
from infer.serve.prepare import PreparedRequest, prepare_request
from infer.serve.protocol import (APIError, ChatCompletionRequest, Completion, CompletionRequest, ErrorResponse,
                                  ModelCard, ModelList, dump)
from infer.serve.streaming import StreamedText, collect, event_stream, response

# --------------------------------------------------------------------------- dependencies


def require_ready(http_request: HTTPRequest) -> None:
    """503 while the engine loads and compiles (or after it failed to)."""
    model = http_request.app.state.model
    state = getattr(model, "state", "ready")
    if state == "failed":
        raise APIError(503, "the server failed to start; see its log", type="server_error", code="unavailable")
    if state != "ready":
        raise APIError(503, f"the server is warming up ({model.detail}); retry when /health answers 200",
                       type="server_error", code="warming_up")


# --------------------------------------------------------------------------- endpoints

router = APIRouter()
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 408, 413, 429, 500, 503)}
_COMPLETION = {200: {"model": Completion, "content": {"text/event-stream": {}}}, **_ERRORS}
_V1 = dict(methods=["POST"], dependencies=[Depends(require_ready)], response_model=None,
           responses=_COMPLETION)


@router.get("/health")
async def health(http_request: HTTPRequest):
    """GET /health: 200 {"status": "ok"} once serving; 503 while warming up, after a failed
    start, or once the engine stopped."""
    model = http_request.app.state.model
    state = getattr(model, "state", "ready")
    if state != "ready":
        status = "failed" if state == "failed" else "warming up"
        return JSONResponse({"status": status, "detail": model.detail}, status_code=503)
    if not model.engine.alive:
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    return {"status": "ok"}


@router.get("/v1/models", responses={200: {"model": ModelList}, 401: _ERRORS[401]})
async def list_models(http_request: HTTPRequest):
    """GET /v1/models: the one model served."""
    state = http_request.app.state
    return dump(ModelList(data=[ModelCard(id=state.model.name, object="model", created=state.created,
                                          owned_by="dflash-jax", max_model_len=state.model.context)]))


@router.get("/metrics")
async def metrics(http_request: HTTPRequest):
    """GET /metrics: Prometheus text."""
    return PlainTextResponse(metrics_text(http_request.app.state.model.engine),
                             media_type="text/plain; version=0.0.4")


@router.api_route("/v1/completions", **_V1)
async def completions(body: CompletionRequest, http_request: HTTPRequest):
    """POST /v1/completions."""
    return await _complete(http_request, body, chat=False)


@router.api_route("/v1/chat/completions", **_V1)
async def chat_completions(body: ChatCompletionRequest, http_request: HTTPRequest):
    """POST /v1/chat/completions."""
    return await _complete(http_request, body, chat=True)


# --------------------------------------------------------------------------- the engine


def submit(model, request: PreparedRequest) -> tuple[list[StreamRequest], asyncio.Queue]:
    """Queue the request's rows (one per choice) on the engine; returns their engine requests and
    the asyncio queue their (choice, tokens, result) deliveries arrive on. A refusal cancels the
    rows already queued."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    queued: list[StreamRequest] = []
    try:
        for i, row_id in enumerate(request.choice_row_ids()):
            emit = lambda tokens, result, logprobs=None, i=i: loop.call_soon_threadsafe(
                events.put_nowait, (i, tokens, result, logprobs))
            engine_request = StreamRequest(request.prompt_ids, request.max_tokens, emit, request.sampling, row_id)
            model.engine.submit(engine_request)
            queued.append(engine_request)
    except (QueueFull, Closed, DFlashError) as e:
        for engine_request in queued:
            engine_request.cancelled = True
        if isinstance(e, QueueFull):
            raise APIError(429, f"the server is busy ({e}); retry later", type="rate_limit_error",
                           code="queue_full") from None
        if isinstance(e, Closed):
            raise APIError(503, str(e), type="server_error", code="unavailable") from None
        raise APIError(400, str(e)) from None
    return queued, events


async def _complete(http_request: HTTPRequest, body, chat: bool):
    model = http_request.app.state.model
    # Encoding (a chat template, a tokenizer) takes time in proportion to the prompt: off the event loop.
    request = await asyncio.to_thread(prepare_request, model, body, chat)
    engine_requests, events = submit(model, request)
    decoded = [StreamedText(model, request) for _ in engine_requests]
    ident = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    if request.stream:
        return StreamingResponse(event_stream(request, engine_requests, events, decoded, ident, model.name),
                                 media_type="text/event-stream")
    results = await collect(http_request, engine_requests, events, decoded)
    if results is None:
        return None  # the client went away
    return response(request, decoded, results, ident, model.name)
