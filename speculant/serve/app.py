"""The OpenAI-compatible HTTP app: routes, authentication, request parsing, streaming."""

from __future__ import annotations

import contextlib
import copy
import hmac
import json
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from speculant.core.errors import ContextTooLongError, EngineBusyError, GenerationError, SettingError
from speculant.core.types import Chunk
from speculant.serve.metrics import CONTENT_TYPE, ServerMetrics, speculative_stats
from speculant.serve.responses import Shape, finish_reason, sse, usage
from speculant.serve.schemas import CLIENT_LEFT, ApiError, ChatRequest, CompletionRequest, client_left, parse
from speculant.serve.worker import Done, Failed, Job, Worker

OPEN_PATHS = ("/health",)  # reachable without the API key


def create_app(engine: Any, *, model_name: str = "speculant", api_key: str | None = None, max_queue: int = 64,
               timeout: float = 600.0, max_body_bytes: int = 1 << 20) -> FastAPI:
    """An app serving ``engine`` (loaded once) under the model name ``model_name``."""
    metrics = ServerMetrics()
    server = _Server(engine, model_name, metrics, Worker(engine, max_queue, timeout, metrics.queue_depth.set),
                     max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.worker.close()

    app = FastAPI(title="speculant", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = server

    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None))

    @app.get("/health")
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


class BearerAuth:
    """Pure ASGI (no BaseHTTPMiddleware, which re-buffers every streamed chunk): every path but
    /health needs ``Authorization: Bearer <key>``."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                 "authentication_error", code="invalid_api_key")
                await _error(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


class _Server:
    def __init__(self, engine: Any, model_name: str, metrics: ServerMetrics, worker: Worker, max_body: int) -> None:
        self.engine, self.model_name, self.metrics, self.worker, self.max_body = engine, model_name, metrics, worker, max_body
        # The engine's thread decodes with its tokenizer while requests are tokenized here: a
        # copy of their own, since a fast tokenizer refuses concurrent use ("Already borrowed").
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.window = engine.target.info.max_position_embeddings

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
        ids = self._prompt_ids(req, chat)
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
        async for part in request.stream():
            data += part
            if len(data) > self.max_body:
                raise _too_large(self.max_body)
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None

    def _prompt_ids(self, req: Any, chat: bool) -> list[int]:
        if chat:
            ids = self.tokenizer.encode(self._render(req), add_special_tokens=False)
        elif isinstance(req.prompt, str):
            ids = self.tokenizer.encode(req.prompt)  # with special tokens, as engine.generate(prompt) does
        else:
            ids = list(req.prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt" if not chat else "messages")
        if self.window is not None and len(ids) >= self.window:
            raise ApiError(413, f"the prompt has {len(ids)} tokens but the model's context window is {self.window}",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        return ids

    def _render(self, req: ChatRequest) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions with a text prompt",
                           param="messages", code="no_chat_template")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001  a template's own refusal (e.g. no system role)
            raise ApiError(400, f"cannot render the messages with the chat template: {exc}", param="messages") from None

    def _finish(self, done: Done) -> tuple[str, dict, dict]:
        self.metrics.record(done.stats, self.engine.speculative)
        stats = done.stats
        extra = speculative_stats(stats)
        extra["engine"] = "speculative" if self.engine.speculative else "plain"
        return finish_reason(stats.stop_reason if stats else None), usage(
            stats.prompt_tokens if stats else 0, len(done.token_ids)), extra

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
                    self.metrics.record(event.stats, self.engine.speculative)
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
                    self.metrics.record(event.stats, self.engine.speculative)
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
        return ApiError(413, str(exc), param="prompt", code="context_length_exceeded")
    if isinstance(exc, EngineBusyError):
        return ApiError(503, str(exc), "server_error", code="engine_busy")
    if isinstance(exc, GenerationError):
        return ApiError(500, f"generation failed after {len(exc.token_ids)} tokens: {exc}", "server_error",
                        code=type(exc).__name__)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", code="internal_error")
