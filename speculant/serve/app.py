"""The OpenAI-compatible HTTP app: routes, authentication, request parsing, streaming."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import math
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from speculant.core.errors import ContextTooLongError, EngineBusyError, GenerationError, SettingError
from speculant.core.types import Chunk
from speculant.serve.metrics import CONTENT_TYPE, ServerMetrics, speculative_stats
from speculant.serve.responses import Shape, finish_reason, sse, usage
from speculant.serve.prompt import PromptReader
from speculant.serve.schemas import CLIENT_LEFT, ApiError, ChatRequest, CompletionRequest, client_left, parse, read_json
from speculant.serve import DEFAULT_MAX_BATCH
from speculant.serve.worker import Done, Failed, Job, Worker

OPEN_PATHS = ("/health",)  # reachable without the API key
BODY_TIMEOUT_S = 30.0  # a request's whole body must arrive within this


def create_app(engine: Any, *, model_name: str = "speculant", api_key: str | None = None, max_queue: int = 64,
               timeout: float = 600.0, max_body_bytes: int = 1 << 20, body_timeout: float = BODY_TIMEOUT_S,
               max_batch: int = DEFAULT_MAX_BATCH) -> FastAPI:
    """An app serving ``engine`` (loaded once) under the model name ``model_name``; up to
    ``max_batch`` requests are verified together."""
    check_max_batch(max_batch, "max_batch")
    if api_key is not None:
        check_api_key(api_key, "api_key")
    for name, seconds in (("timeout", timeout), ("body_timeout", body_timeout)):
        if isinstance(seconds, bool) or not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"{name} must be a finite number of seconds > 0, not {seconds!r}")
    metrics = ServerMetrics()
    worker = Worker(engine, max_queue, timeout, metrics.queue_depth.set,
                    on_finish=lambda stats: metrics.record(stats, engine.speculative), max_batch=max_batch,
                    on_cycle=metrics.cycle)
    server = _Server(engine, model_name, metrics, worker, max_body_bytes, body_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.worker.close()
        server.prompts.close()

    app = FastAPI(title="speculant", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = server

    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok", "queue_depth": server.worker.waiting}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "speculant"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await server.complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.complete(request, chat=False)

    return app


def check_api_key(key: str, source: str) -> str:
    """``key``, unless no client could send it or it would leave the server open: empty (a shell
    variable that was unset), spaces around it (a file read with its newline), not printable ASCII."""
    if not key:
        raise ValueError(f"{source} is empty, which would leave the server open: give a key, or give none "
                         "to serve without one")
    if key != key.strip():
        raise ValueError(f"{source} has spaces or a newline around it, which no client sends: strip them")
    if not (key.isascii() and key.isprintable()):
        raise ValueError(f"{source} must be printable ASCII (an HTTP header carries it)")
    return key


def check_max_batch(value: Any, source: str) -> int:
    """``value`` if it is a whole number of requests, at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source} {value!r}: give a whole number of requests, at least 1 (1: one at a time)")
    return value


class BearerAuth:
    """Pure ASGI (no BaseHTTPMiddleware, which re-buffers every streamed chunk): every path but
    /health needs exactly one ``Authorization: Bearer <key>`` header."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = [value for name, value in scope["headers"] if name.lower() == b"authorization"]
            # two headers, one wrong: a proxy and a client disagree on who this is; refuse
            if len(given) != 1 or not hmac.compare_digest(given[0], self.expected):
                error = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                 "authentication_error", code="invalid_api_key")
                await _error(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


class _Server:
    def __init__(self, engine: Any, model_name: str, metrics: ServerMetrics, worker: Worker, max_body: int,
                 body_timeout: float) -> None:
        self.engine, self.model_name, self.metrics, self.worker = engine, model_name, metrics, worker
        self.max_body, self.body_timeout = max_body, body_timeout
        self.prompts = PromptReader(engine.tokenizer, engine.target.info.max_position_embeddings)

    async def complete(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            response = await self._complete(request, chat)
        except ApiError as exc:
            self.metrics.requests.labels(endpoint, str(exc.status)).inc()
            raise
        if not isinstance(response, StreamingResponse):  # a stream counts its outcome when it ends
            self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    async def _complete(self, request: Request, chat: bool) -> Response:
        body = await self._read_json(request)
        req = parse(ChatRequest if chat else CompletionRequest, body)
        if req.model != self.model_name:
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        if req.logprobs:
            raise ApiError(400, "logprobs are not supported by speculant serve", param="logprobs",
                           code="unsupported_parameter")
        ids = await self.prompts.ids(req, chat)
        job = await self.worker.submit(ids, req.new_tokens(), req.sampling(), gone=request.is_disconnected)
        try:
            first = await job.events.get()
            if isinstance(first, Failed):
                raise _as_api_error(first.error)
        except BaseException:
            job.cancel.set()
            raise
        shape = Shape(chat, self.model_name, bool(req.stream_options and req.stream_options.include_usage))
        if req.stream:
            return StreamingResponse(self._stream(job, shape, "chat" if chat else "completions"),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._whole(request, job, shape)

    async def _read_json(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body:
            raise _too_large(self.max_body)
        data = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout):  # a client that stalls mid-body holds a socket
                async for part in request.stream():
                    data += part
                    if len(data) > self.max_body:
                        raise _too_large(self.max_body)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.body_timeout:g} s", code="timeout",
                           headers={"Connection": "close"}) from None
        except ClientDisconnect:
            raise client_left("while sending the request body") from None
        return read_json(bytes(data))

    def _finish(self, done: Done) -> tuple[str, dict, dict]:
        stats = done.stats  # the worker counted its tokens already, whoever reads this
        extra = speculative_stats(stats)
        extra["engine"] = "speculative" if self.engine.speculative else "plain"
        return finish_reason(stats.stop_reason if stats else None), usage(
            stats.prompt_tokens if stats else 0, len(done.token_ids), stats.cached_tokens if stats else 0), extra

    async def _whole(self, request: Request, job: Job, shape: Shape) -> Response:
        parts: list[str] = []
        left = False
        try:
            async for event in job.stream():
                if isinstance(event, Chunk):
                    parts.append(event.text)
                    if not left and await request.is_disconnected():
                        left = True
                        job.cancel.set()
                elif isinstance(event, Failed):
                    raise _as_api_error(event.error)
                elif isinstance(event, Done):
                    if event.timed_out:
                        continue
                    finish, use, extra = self._finish(event)
                    if left:
                        raise client_left("during generation")
                    return JSONResponse(shape.full("".join(parts), finish, use, extra))
        finally:
            job.cancel.set()
        raise self._timeout()

    def _timeout(self) -> ApiError:
        return ApiError(504, f"the request ran past the {self.worker.timeout:g} s timeout", "server_error",
                        code="timeout")

    async def _stream(self, job: Job, shape: Shape, endpoint: str) -> AsyncIterator[bytes]:
        """The events as server-sent events; the request's outcome is counted once it is known
        (the 200 header went out before the first chunk): 200, the error's status, or 499."""
        status = CLIENT_LEFT
        try:
            if shape.chat:
                yield sse(shape.chunk("", first=True))
            async for event in job.stream():
                if isinstance(event, Chunk):
                    if event.text:  # a send to a client that left ends this generator: see finally
                        yield sse(shape.chunk(event.text))
                elif isinstance(event, Failed):
                    error = _as_api_error(event.error)
                    status = error.status
                    yield sse(error.body())
                elif isinstance(event, Done):
                    if event.timed_out:
                        status = 504
                        yield sse(self._timeout().body())
                        break
                    status = 200
                    finish, use, extra = self._finish(event)
                    yield sse(shape.last(finish, extra))
                    if shape.include_usage:
                        yield sse(shape.usage_chunk(use))
            yield sse("[DONE]")
        finally:
            job.cancel.set()  # a client that went away: the worker stops after this cycle
            self.metrics.requests.labels(endpoint, str(status)).inc()


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def _as_api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, SettingError):
        return ApiError(400, str(exc), param=(exc.field or "").split(".")[-1] or None, code="invalid_value")
    if isinstance(exc, ContextTooLongError):
        return ApiError(400, str(exc), param="prompt", code="context_length_exceeded")
    if isinstance(exc, EngineBusyError):
        return ApiError(503, str(exc), "server_error", code="engine_busy")
    if isinstance(exc, GenerationError):
        return ApiError(500, f"generation failed after {len(exc.token_ids)} tokens: {exc}", "server_error",
                        code=type(exc).__name__)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", code="internal_error")
