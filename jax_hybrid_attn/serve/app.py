"""The HTTP app (FastAPI): OpenAI's routes on `OpenAIServing`, health, metrics, and OpenAI-style errors.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` for server-sent events, ``data:
[DONE]`` last), ``GET /v1/models``, ``GET /health`` (503 until the engine has compiled every step shape, and on
a GPU run each once, then 200; 503 again if it fails), ``GET /metrics`` (Prometheus text).

Bodies are parsed here (not by FastAPI's signature injection) so that every bad request, malformed JSON
included, gets OpenAI's error JSON with a 4xx. A client that disconnects stops its request: a whole-response
handler races the request against the connection's ``http.disconnect`` and is cancelled when it comes first; a
stream's generator is closed when its response ends, however it ends. Either way the choices still running are
aborted in the engine.
"""

import asyncio
import contextlib
import http
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import (
    INVALID_REQUEST,
    NOT_FOUND,
    SERVER_ERROR,
    UNAVAILABLE,
    APIError,
    error_body,
    validation_error,
)
from .metrics import CONTENT_TYPE, ServerMetrics
from .openai_serving import DONE, OpenAIServing, SubmittedStream
from .protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList

__all__ = ["build_app"]

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499
"""The status logged for a request whose client left before its response (nobody receives it)."""


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends (a client that disconnects
    included), so that the engine requests behind it are aborted at once. An `APIError` after the stream began
    (the engine failed) is sent as one last event, ``data: {"error": ...}``, before ``data: [DONE]``."""

    media_type = "text/event-stream"

    def __init__(self, events: SubmittedStream):
        super().__init__(_with_error_event(events))
        self._events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._events.aclose()  # also when the body never began: its requests are in the engine


def build_app(serving: OpenAIServing, *, metrics: ServerMetrics, manage_engine: bool = True) -> FastAPI:
    """The app. `manage_engine`: start the engine client when the app starts and stop it when it stops."""
    engine = serving.engine

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.to_thread(engine.stop)

    app = FastAPI(title="jax_hybrid_attn", description="An OpenAI-compatible server on the engine.",
                  lifespan=lifespan, docs_url=None, redoc_url=None)  # fmt: skip
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def api_error(_request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, error: StarletteHTTPException):
        kind = NOT_FOUND if error.status_code == http.HTTPStatus.NOT_FOUND else INVALID_REQUEST
        return JSONResponse(error_body(str(error.detail), type=kind), status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(_request, error: RequestValidationError):
        wrapped = validation_error(list(error.errors()))
        return JSONResponse(wrapped.body(), status_code=wrapped.status)

    @app.exception_handler(Exception)
    async def server_error(_request, error: Exception):
        logger.exception("request failed")
        body = error_body(f"internal server error: {type(error).__name__}: {error}", type=SERVER_ERROR)
        return JSONResponse(body, status_code=http.HTTPStatus.INTERNAL_SERVER_ERROR)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest)
        if body.stream:
            return EventStream(serving.completion_stream(body))
        return await _unless_disconnected(request, serving.completion(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatCompletionRequest)
        if body.stream:
            return EventStream(serving.chat_stream(body))
        return await _unless_disconnected(request, serving.chat(body))

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=serving.model_name, max_model_len=serving.max_model_len)])

    @app.get("/health")
    async def health():
        if engine.healthy:
            return {"status": "ok"}
        if engine.error is not None:
            message = f"the engine failed: {type(engine.error).__name__}: {engine.error}"
        elif engine.model_config is None:
            message = "the engine is loading the model"
        else:
            message = "the engine is compiling its step shapes" if not engine.ready.is_set() else "stopped"
        return JSONResponse(error_body(message, type=UNAVAILABLE), status_code=http.HTTPStatus.SERVICE_UNAVAILABLE)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _with_error_event(events):
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                yield event
        except APIError as error:
            yield f"data: {json.dumps(error.body())}\n\n"
            yield DONE


async def _parse[M: BaseModel](request: Request, model: type[M]) -> M:
    """The request's JSON body as `model`, or a 400 naming the field at fault (a 415 for a body that says it is
    not JSON: a ``Content-Type`` other than ``application/json`` or ``application/*+json``; none is taken as
    JSON)."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not _is_json(content_type):
        message = f"Content-Type: {content_type!r} is not application/json: the body must be a JSON object"
        raise APIError(message, status=http.HTTPStatus.UNSUPPORTED_MEDIA_TYPE, code="unsupported_media_type")
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        raise validation_error(error.errors()) from None


def _is_json(content_type: str) -> bool:
    media_type = content_type.partition(";")[0].strip().lower()
    kind, _, subtype = media_type.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


async def _unless_disconnected(request: Request, work):
    """Await `work` (a coroutine), cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        watch.cancel()
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body has been read: only ``http.disconnect`` is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
