"""The API server's FastAPI app: its routes over AsyncLLM and its error handlers.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses and GET /v1/responses/{id} (or, on a
pooling server, POST /v1/embeddings instead of those, as vLLM registers one kind),
GET /v1/models, GET (and HEAD) /health, GET /version, GET /load (server_load.py), POST /tokenize, POST /detokenize,
GET /metrics, the live page (GET / and GET /dashboard, its figures at GET /dashboard/data: live_page.py),
GET /openapi.json, GET /docs and GET /redoc (the OpenAPI document and its Swagger and ReDoc pages, as
vLLM serves them, unless --disable-fastapi-docs), GET /debug/kv_cache with --enable-debug-routes, and vLLM's
development routes (/reset_prefix_cache, /sleep, /wake_up, /is_sleeping: dev_routes.py) with --enable-debug-routes
or VLLM_SERVER_DEV_MODE=1. CORS and X-Request-Id headers: middleware.py. With --api-key every route but /health,
the live page's HTML (not its data) and /metrics (unless --protect-metrics) needs the key, the OpenAPI document
included (middleware.py). run.py serves the app; draining.py handles SIGTERM.
"""

from __future__ import annotations

import logging
import os
from http import HTTPStatus

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.chat_protocol import ChatCompletionRequest, ChatCompletionResponse
from pagedllm.entrypoints.openai.dev_routes import add_dev_routes, dev_mode
from pagedllm.entrypoints.openai.embedding_protocol import EmbeddingRequest, EmbeddingResponse
from pagedllm.entrypoints.openai.live_page import add_live_page_routes
from pagedllm.entrypoints.openai.lora_routes import add_lora_routes
from pagedllm.entrypoints.openai.middleware import (
    API_KEY_SCOPE_KEY,
    GuardMiddleware,
    add_outer_middleware,
    prechecked_route_class,
)
from pagedllm.entrypoints.openai.openapi import SSE_CONTENT, error_responses, openapi_document
from pagedllm.entrypoints.openai.protocol import CompletionRequest, CompletionResponse, ModelList
from pagedllm.entrypoints.openai.responses import guard, respond, run_until_disconnect
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest, ResponsesResponse
from pagedllm.entrypoints.openai.server_load import add_load_route
from pagedllm.entrypoints.openai.server_state import ServerState
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.serving_models import runtime_lora_updating
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.entrypoints.openai.tenant_salt import tenant_cache_salt
from pagedllm.entrypoints.openai.tokenize_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.tokenizer_threads import TokenizerThreads
from pagedllm.log_escape import escape_control
from pagedllm.metrics.tracing import TRACE_HEADERS, RequestTrace, current_request_trace

logger = logging.getLogger(__name__)


def build_app(state: ServerState) -> FastAPI:
    docs = not state.config.disable_fastapi_docs
    app = FastAPI(title="pagedllm", version=pagedllm.__version__, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None,
                  description="An OpenAI-compatible LLM server (vLLM's API: OpenAI's fields plus vLLM's sampling "
                              "extras). Errors are `{\"error\": {message, type, param, code}}`.")
    if state.config.root_path:
        app.root_path = state.config.root_path  # as vLLM sets it (FastAPI puts it in each request's scope)
    app.openapi = lambda: openapi_document(app)
    add_load_route(app, state.config.enable_server_load_tracking)  # its counter inside the guard: added first
    app.add_middleware(GuardMiddleware, state=state)
    add_outer_middleware(app, state.config)
    _add_error_handlers(app)
    # one set of tokenizer threads for every route: a big text in any of them delays no small one in another
    serving = (state.engine, state.served_model_names, state.config, TokenizerThreads(), state.models)
    limits = getattr(getattr(state.engine, "ready", None), "limits", None)
    if getattr(limits, "runner_type", "generate") == "pooling":  # as vLLM: one kind of routes, the other is a 404
        _add_embedding_routes(app, state, OpenAIServingEmbedding(*serving))
        tokenization = OpenAIServingTokenization(*serving)
    else:
        completions = OpenAIServingCompletion(*serving)
        chat = OpenAIServingChat(*serving)
        tokenization = OpenAIServingTokenization(*serving, chat_prompts=chat.chat_prompts)
        responses = OpenAIServingResponses(*serving, chat_prompts=chat.chat_prompts)
        _add_generation_routes(app, state, completions, chat, responses)
    _add_info_routes(app, state)
    _add_token_routes(app, state, tokenization)
    add_live_page_routes(app, state)
    if runtime_lora_updating():
        add_lora_routes(app, state.models)
    if state.config.enable_debug_routes:
        _add_debug_routes(app, state)
    if dev_mode(state.config.enable_debug_routes):
        add_dev_routes(app, state)
    return app


def _add_error_handlers(app: FastAPI) -> None:
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
        return errors.to_api_error(e, value_error_is_bad_request=False).to_response()


def _add_generation_routes(app: FastAPI, state: ServerState, completions: OpenAIServingCompletion,
                           chat: OpenAIServingChat, responses: OpenAIServingResponses) -> None:
    """POST /v1/completions, /v1/chat/completions and /v1/responses, their raw bodies prechecked against the
    request caps; GET /v1/responses/{id} (a stored response)."""
    generation = APIRouter(route_class=prechecked_route_class(state.config))

    def apply_request_context(body, request: Request) -> None:
        """The X-Request-Id header and (--cache-salt-from-api-key) the caller's key's cache salt into `body`."""
        header_id = request.headers.get("x-request-id")
        if header_id is not None:  # vLLM's: the X-Request-Id header names the request, before its request_id field
            body.request_id = header_id
        if state.config.otlp_traces_endpoint is not None:  # this request's spans: its trace headers
            current_request_trace.set(RequestTrace({h: request.headers[h] for h in TRACE_HEADERS
                                                    if h in request.headers}))
        if state.config.cache_salt_from_api_key:
            body.cache_salt = tenant_cache_salt(state.salt_secret, request.scope[API_KEY_SCOPE_KEY], body.cache_salt)

    generation_errors = error_responses(400, 401, 404, 413, 503)

    @generation.post("/v1/completions", responses={200: {"model": CompletionResponse, "content": SSE_CONTENT},
                                                   **generation_errors})
    async def create_completion(body: CompletionRequest, request: Request):
        apply_request_context(body, request)
        return respond(await run_until_disconnect(request, guard(completions.create_completion(body))))

    @generation.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse,
                                                              "content": SSE_CONTENT}, **generation_errors})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        apply_request_context(body, request)
        return respond(await run_until_disconnect(request, guard(chat.create_chat_completion(body))))

    @generation.post("/v1/responses", responses={200: {"model": ResponsesResponse, "content": SSE_CONTENT},
                                                 **generation_errors})
    async def create_response(body: ResponsesRequest, request: Request):
        apply_request_context(body, request)
        return respond(await run_until_disconnect(request, guard(responses.create_response(body))))

    @generation.get("/v1/responses/{response_id}", responses={200: {"model": ResponsesResponse},
                                                              **error_responses(401, 404)})
    async def retrieve_response(response_id: str):
        return respond(responses.retrieve(response_id))

    app.include_router(generation)


def _add_embedding_routes(app: FastAPI, state: ServerState, embeddings: OpenAIServingEmbedding) -> None:
    """POST /v1/embeddings (runner pooling), its raw body prechecked against the request caps."""
    router = APIRouter(route_class=prechecked_route_class(state.config))
    salt_secret = os.urandom(32)

    @router.post("/v1/embeddings", responses={200: {"model": EmbeddingResponse}, **error_responses(400, 401, 404,
                                                                                                    413, 503)})
    async def create_embedding(body: EmbeddingRequest, request: Request):
        if state.config.cache_salt_from_api_key:
            body.cache_salt = tenant_cache_salt(salt_secret, request.scope[API_KEY_SCOPE_KEY], body.cache_salt)
        return respond(await run_until_disconnect(request, guard(embeddings.create_embedding(body))))

    app.include_router(router)


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    """GET /v1/models, /health (and HEAD), /ping (GET and POST), /version and /metrics."""
    engine = state.engine

    @app.get("/v1/models", responses={200: {"model": ModelList}, **error_responses(401, 503)})
    async def show_models():
        return JSONResponse(ModelList(data=state.models.cards(engine.max_model_len)).model_dump())

    @app.get("/health", response_class=Response,
             responses={200: {"description": "The engine is healthy (an empty body)."}, **error_responses(503)})
    async def health():
        try:
            await engine.check_health(state.config.health_check_timeout)
        except Exception as e:
            reason = str(e) or type(e).__name__
            return errors.unavailable(f"unhealthy: {reason}", "unhealthy").to_response()
        return Response(status_code=200)

    # HEAD answers as GET does (load balancers probe with it); one operation in the OpenAPI document
    app.add_api_route("/health", health, methods=["HEAD"], response_class=Response, include_in_schema=False)
    # /ping, GET or POST: vLLM's alias of /health (SageMaker's probe)
    app.add_api_route("/ping", health, methods=["GET", "POST"], response_class=Response, include_in_schema=False)

    @app.get("/version")
    async def version():
        return JSONResponse({"version": pagedllm.__version__})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format (vLLM's metric names)."}})
    async def metrics():
        return Response(engine.prometheus.render(), media_type=CONTENT_TYPE_LATEST)


def _add_token_routes(app: FastAPI, state: ServerState, tokenization: OpenAIServingTokenization) -> None:
    """POST /tokenize and /detokenize, their raw bodies prechecked against max_model_len."""
    tokens = APIRouter(route_class=prechecked_route_class(state.config, tokenization.precheck))
    token_errors = error_responses(400, 401, 404, 413, 503)

    @tokens.post("/tokenize", responses={200: {"model": TokenizeResponse}, **token_errors})
    async def tokenize(body: TokenizeRequest):
        return Response(await tokenization.tokenize(body), media_type="application/json")

    @tokens.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **token_errors})
    async def detokenize(body: DetokenizeRequest):
        return JSONResponse((await tokenization.detokenize(body)).model_dump())

    app.include_router(tokens)


def _add_debug_routes(app: FastAPI, state: ServerState) -> None:
    """GET /debug/kv_cache (--enable-debug-routes): the pool's free and total blocks, for tests."""
    engine = state.engine

    @app.get("/debug/kv_cache")
    async def debug_kv_cache():
        try:
            replicas = await engine.debug_stats()
        except TimeoutError:  # a long step is under way: ask again later
            return JSONResponse({"error": "the engine core did not answer in time"}, status_code=503)
        alive = [(client, stats) for client, stats in zip(engine.clients, replicas, strict=True)
                 if stats is not None]
        if not alive:
            return JSONResponse({})
        body = {key: sum(getattr(stats, key) for _, stats in alive)
                for key in ("num_free_blocks", "num_total_blocks", "total_ref_cnt", "num_running_reqs",
                            "num_waiting_reqs")}
        body |= {"num_open_requests": engine.num_open_requests, "engine_pid": engine.client.ready.pid,
                 "api_server_pid": os.getpid()}  # which API server answered (--api-server-count)
        if len(engine.clients) > 1:  # data parallelism: the sums above, and each replica (null once dead)
            body["engines"] = [None if stats is None else {
                "engine_pid": client.ready.pid, "num_free_blocks": stats.num_free_blocks,
                "num_total_blocks": stats.num_total_blocks, "num_running_reqs": stats.num_running_reqs,
                "num_waiting_reqs": stats.num_waiting_reqs} for client, stats in zip(engine.clients, replicas,
                                                                                       strict=True)]
        return JSONResponse(body)
