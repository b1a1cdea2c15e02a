"""The API-server process: FastAPI routes over AsyncLLM, run by uvicorn next to an engine-core process.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET (and HEAD) /health, GET /version,
POST /tokenize, POST /detokenize, GET /metrics, GET /openapi.json and GET /docs (the OpenAPI document and its
Swagger page, as vLLM serves them), and GET /debug/kv_cache with --enable-debug-routes. With --api-key every
route but /health (and /metrics unless --protect-metrics) needs the key, the OpenAPI document included.

Lifetime: SIGTERM stops accepting (503 + Retry-After), waits up to --drain-timeout for open requests, then
exits; a second SIGTERM or SIGINT exits at once. When the engine core dies, open requests fail at once,
every route answers 503, and the server exits after --engine-death-exit-delay seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import h11
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

import pagedllm
from pagedllm.config import ServerConfig
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.input_processor import MAX_CACHE_SALT_LEN, is_valid_unicode
from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_base import (
    precheck_caps,
    to_api_error,
    too_deep,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, render_chat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.log_escape import escape_control

logger = logging.getLogger(__name__)

UNGUARDED_PATHS = {"/health", "/metrics"}


@dataclass
class ServerState:
    """What the routes share: the engine, the serve flags, the names clients may ask for, and the drain."""

    engine: AsyncLLM
    config: ServerConfig
    served_model_names: list[str]
    draining: bool = False
    started: float = field(default_factory=time.time)


API_KEY_SCOPE_KEY = "pagedllm.api_key"
"""Where the guard leaves the caller's (checked) API key in the ASGI scope, for --cache-salt-from-api-key."""


class BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    """Pure ASGI (streams and disconnects pass straight through): API key, drain, engine death, body cap."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        self.expected = [(f"Bearer {key}".encode(), key) for key in state.config.api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = self._check(scope)
        if error is not None:
            return await error.to_response()(scope, receive, send)
        return await self._call_with_body_cap(scope, receive, send)

    async def _call_with_body_cap(self, scope, receive, send):
        """Count the body as it arrives (a chunked body has no Content-Length): past the cap, the app's
        read fails and whatever it answers is replaced by a 413."""
        cap = self.state.config.max_request_bytes
        received = 0
        too_large = False

        async def counting_receive():
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:
                    too_large = True
                    raise BodyTooLarge()
            return message

        async def guarded_send(message):
            if not too_large:
                await send(message)
            elif message["type"] == "http.response.start":
                await _too_large().to_response()(scope, receive, send)

        await self.app(scope, counting_receive, guarded_send)

    def _check(self, scope) -> errors.APIError | None:
        path = scope["path"]
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:  # a repeated header counts once, first wins (as Starlette's and vLLM's)
            headers.setdefault(name, value)
        config = self.state.config
        if self.expected and (path not in UNGUARDED_PATHS or (path == "/metrics" and config.protect_metrics)):
            given = headers.get(b"authorization", b"")
            matched = None
            for expected, key in self.expected:  # compare with every key: the time does not tell which
                if hmac.compare_digest(given, expected):
                    matched = key
            if matched is None:
                return errors.unauthorized()
            scope[API_KEY_SCOPE_KEY] = matched
        if path == "/metrics":
            return None
        if self.state.draining:
            return errors.unavailable("The server is shutting down.", "shutting_down", retry_after_s=5)
        if self.state.engine.is_dead:
            return errors.unavailable(f"The engine is not available: {self.state.engine.client.dead_reason}",
                                      "engine_dead")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > config.max_request_bytes:
            return _too_large()
        return None


def _too_large() -> errors.APIError:
    return errors.APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "The request body is too large.",
                           "invalid_request_error", code="request_too_large")


class HeaderLimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, except that a request head over the limit (h11_max_incomplete_event_size)
    gets a JSON 431 instead of a plain-text 400."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._error_status = HTTPStatus.BAD_REQUEST
        next_event = self.conn.next_event

        def next_event_noting_status():
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self._error_status = e.error_status_hint
                raise

        self.conn.next_event = next_event_noting_status

    def send_400_response(self, msg: str) -> None:
        if self._error_status != HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE:
            return super().send_400_response(msg)
        body = json.dumps({"error": {"message": "The request headers are too large.", "type": "invalid_request_error",
                                     "param": None, "code": "headers_too_large"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        self.transport.write(self.conn.send(h11.Response(status_code=431, headers=headers,
                                                         reason=b"Request Header Fields Too Large")))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()


def tenant_cache_salt(secret: bytes, api_key: str, client_salt: str | None) -> str:
    """The cache_salt of a request under --cache-salt-from-api-key: HMAC-SHA256(secret, key, client salt).

    Two tenants (keys) never get the same salt, whatever salts their clients send; one tenant's requests
    share cache when their client salts are equal (or both absent)."""
    message = api_key.encode() + b"\0" + (b"" if client_salt is None else b"\1" + client_salt.encode())
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


async def _run_until_disconnect(request: Request, coro):
    """Await coro, cancelling it if the client disconnects first (cancellation aborts the request)."""
    task = asyncio.ensure_future(coro)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except BaseException:
            pass
        return None
    return task.result()


def _prechecked_route_class(caps: ServerConfig) -> type[APIRoute]:
    """A route whose JSON body is checked against the request caps (precheck_caps) before FastAPI parses and
    validates it: a list of 100,000 prompts is rejected in milliseconds, not after building 100,000 objects."""

    class PrecheckedRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def checked_handler(request: Request) -> Response:
                try:
                    body = await request.body()
                except BodyTooLarge:
                    return _too_large().to_response()  # GuardMiddleware sends its 413 in this one's place
                except ClientDisconnect:  # gone while its body was being read: nothing to answer, nothing to log
                    return Response(status_code=499)
                try:
                    if body:
                        parsed = precheck_caps(body, caps)
                        if parsed is not None:
                            request._json = parsed  # Starlette's cache of request.json(): FastAPI parses it once
                    return await handler(request)
                except RecursionError:  # FastAPI's parse or validation of a body at the edge of precheck's depth
                    return too_deep().to_response()

            return checked_handler

    return PrecheckedRoute


def _error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": HTTPStatus(status).phrase} for status in statuses}


_SSE = {"text/event-stream": {"schema": {"type": "string", "description": "Server-sent events (stream=true)."}}}


def _openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, less the 422 it adds to every route with a body (this server answers 400)."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path_item in document.get("paths", {}).values():
            for operation in path_item.values():
                operation.get("responses", {}).pop("422", None)
        schemas = document.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = document
    return app.openapi_schema


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator. When the client goes away while a write is
    blocked, Starlette cancels the response inside `send()` and leaves the SSE generator suspended at its
    `yield`, never closed: its `finally` (which aborts the request in the engine) would not run and the engine
    would generate to max_tokens for nobody."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def _respond(result) -> Response:
    if result is None:  # the client went away
        return Response(status_code=499)
    if hasattr(result, "__aiter__"):
        return ClosingStreamingResponse(result, media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    # pydantic writes the JSON: a non-finite float becomes null instead of failing the response
    return Response(result.model_dump_json(), media_type="application/json")


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="pagedllm", version=pagedllm.__version__, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json",
                  description="An OpenAI-compatible LLM server (vLLM's API: OpenAI's fields plus vLLM's sampling "
                              "extras). Errors are `{\"error\": {message, type, param, code}}`.")
    app.openapi = lambda: _openapi_document(app)
    generation = APIRouter(route_class=_prechecked_route_class(state.config))
    engine = state.engine
    config = state.config
    completions = OpenAIServingCompletion(engine, state.served_model_names, config)
    chat = OpenAIServingChat(engine, state.served_model_names, config)
    app.add_middleware(GuardMiddleware, state=state)

    @app.exception_handler(errors.APIError)
    async def api_error(request: Request, e: errors.APIError):
        return e.to_response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = "; ".join(f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body') or 'body'}: "
                            f"{err.get('msg', 'invalid')}" for err in e.errors()) or "Invalid request."
        return errors.bad_request(message, param=loc[0] if loc else None).to_response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == HTTPStatus.NOT_FOUND:
            return errors.not_found(request.url.path).to_response()
        return errors.APIError(e.status_code, str(e.detail), "invalid_request_error").to_response()

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, e: Exception):
        logger.exception("unexpected error serving %s", escape_control(request.url.path))
        return to_api_error(e, value_error_is_bad_request=False).to_response()

    salt_secret = os.urandom(32)

    def apply_tenant_salt(body, request: Request) -> None:
        if not config.cache_salt_from_api_key:
            return
        salt = body.cache_salt
        if salt is not None and not (0 < len(salt) <= MAX_CACHE_SALT_LEN and is_valid_unicode(salt)):
            raise errors.bad_request(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_LEN} "
                                     "characters of valid Unicode.", param="cache_salt")
        body.cache_salt = tenant_cache_salt(salt_secret, request.scope[API_KEY_SCOPE_KEY], salt)

    generation_errors = _error_responses(400, 401, 404, 413, 503)

    @generation.post("/v1/completions", responses={200: {"model": CompletionResponse, "content": _SSE},
                                                   **generation_errors})
    async def create_completion(body: CompletionRequest, request: Request):
        apply_tenant_salt(body, request)
        return _respond(await _run_until_disconnect(request, _guard(completions.create_completion(body))))

    @generation.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse, "content": _SSE},
                                                        **generation_errors})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        apply_tenant_salt(body, request)
        return _respond(await _run_until_disconnect(request, _guard(chat.create_chat_completion(body))))

    app.include_router(generation)

    @app.get("/v1/models", responses={200: {"model": ModelList}, **_error_responses(401, 503)})
    async def show_models():
        cards = [ModelCard(id=name, root=engine.client.ready.model_name, max_model_len=engine.max_model_len)
                 for name in state.served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/health", response_class=Response,
             responses={200: {"description": "The engine is healthy (an empty body)."}, **_error_responses(503)})
    async def health():
        try:
            await engine.check_health(config.health_check_timeout)
        except Exception as e:
            reason = str(e) or type(e).__name__
            return errors.unavailable(f"unhealthy: {reason}", "unhealthy").to_response()
        return Response(status_code=200)

    # HEAD answers as GET does (load balancers probe with it); one operation in the OpenAPI document
    app.add_api_route("/health", health, methods=["HEAD"], response_class=Response, include_in_schema=False)

    @app.get("/version")
    async def version():
        return JSONResponse({"version": pagedllm.__version__})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format (vLLM's metric names)."}})
    async def metrics():
        return Response(engine.prometheus.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", responses={200: {"model": TokenizeResponse}, **_error_responses(400, 401, 404, 503)})
    async def tokenize(body: TokenizeRequest):
        completions.check_model(body.model)
        tokenizer = engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise errors.bad_request("Give exactly one of prompt and messages.", param="prompt")
        if body.messages is not None:
            text = render_chat(tokenizer, body.messages, body.add_generation_prompt, body.continue_final_message,
                               None, None, None, config.chat_template_timeout, config.max_chat_template_chars)
            token_ids = await completions.encode(text, bool(body.add_special_tokens), check_length=False)
        else:
            if not is_valid_unicode(body.prompt):
                raise errors.bad_request("prompt must be valid Unicode (no lone surrogates).", param="prompt")
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            token_ids = await completions.encode(body.prompt, add_special, check_length=False)  # counts any length

        def response_json() -> str:  # ~1 s for a million tokens: in the tokenizer's thread too
            token_strs = tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
            return TokenizeResponse(count=len(token_ids), max_model_len=engine.max_model_len, tokens=token_ids,
                                    token_strs=token_strs).model_dump_json()

        return Response(await completions.in_tokenizer_thread(response_json), media_type="application/json")

    @app.post("/detokenize", responses={200: {"model": DetokenizeResponse},
                                         **_error_responses(400, 401, 404, 503)})
    async def detokenize(body: DetokenizeRequest):
        completions.check_model(body.model)
        vocab_size = engine.input_processor.limits.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise errors.bad_request(f"Token id {bad} is out of vocabulary (size {vocab_size}).", param="tokens")
        return JSONResponse(DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens)).model_dump())

    if config.enable_debug_routes:
        @app.get("/debug/kv_cache")
        async def debug_kv_cache():
            try:
                stats = await engine.debug_stats()
            except TimeoutError:  # a long step is under way: ask again later
                return JSONResponse({"error": "the engine core did not answer in time"}, status_code=503)
            return JSONResponse({} if stats is None else {
                "num_free_blocks": stats.num_free_blocks, "num_total_blocks": stats.num_total_blocks,
                "total_ref_cnt": stats.total_ref_cnt,
                "num_running_reqs": stats.num_running_reqs, "num_waiting_reqs": stats.num_waiting_reqs,
                "num_open_requests": engine.num_open_requests, "engine_pid": engine.client.ready.pid})

    return app


async def _guard(coro):
    """Turn an exception raised while serving into its APIError, so the handler never 500s a bad request."""
    try:
        return await coro
    except errors.APIError:
        raise
    except Exception as e:
        raise to_api_error(e) from e


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM drains instead of closing the listening socket."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float):
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGTERM and not self.state.draining:
            self.state.draining = True
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # exit through our own cleanup, not by re-raising the signal

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        engine = self.state.engine
        logger.info("SIGTERM: not accepting new requests; waiting up to %.0f s for %d open requests",
                    self.drain_timeout, engine.num_open_requests)
        deadline = time.monotonic() + self.drain_timeout
        while engine.num_open_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_open_requests:
            logger.warning("drain timeout: aborting %d open requests", engine.num_open_requests)
            for request_id in list(engine.queues):
                engine.finish_aborted(request_id)  # each ends with finish_reason "abort"
            deadline = time.monotonic() + 1.0  # let the handlers write their last chunks
            while engine.num_open_requests and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
        self.should_exit = True

    def exit_later(self, delay_s: float) -> None:
        asyncio.get_event_loop().call_later(delay_s, setattr, self, "should_exit", True)
