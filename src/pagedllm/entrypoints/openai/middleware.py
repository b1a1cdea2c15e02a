"""What runs before a route's handler: CORS and `XRequestIdMiddleware` outermost (add_outer_middleware), then
`GuardMiddleware` (API key, drain, engine death, the body cap) around the whole app, and `prechecked_route_class`
(the request caps on the raw body) around the generation and token routes.

The head's size limit is enforced a level below, in the HTTP protocol (connection_limits.py)."""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette._utils import get_route_path
from starlette.datastructures import MutableHeaders
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from pagedllm.config import ServerConfig
from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.request_caps import precheck_caps
from pagedllm.entrypoints.openai.server_state import ServerState

UNGUARDED_PATHS = {"/health", "/ping", "/metrics", "/", "/dashboard"}
"""Need no API key: the probes, /metrics (unless --protect-metrics), and the live page's HTML, which holds no data
(its /dashboard/data needs the key)."""
OBSERVING_PATHS = {"/metrics", "/", "/dashboard", "/dashboard/data"}
"""Answered during a drain and with the engine dead (the key still checked): what shows the operator why."""

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
                await errors.too_large().to_response()(scope, receive, send)

        await self.app(scope, counting_receive, guarded_send)

    def _check(self, scope) -> errors.APIError | None:
        path = get_route_path(scope)  # behind --root-path: the route's path, with or without the prefix
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
        if path in OBSERVING_PATHS:
            return None
        if self.state.draining:
            return errors.unavailable("The server is shutting down.", "shutting_down", retry_after_s=5)
        if self.state.engine.is_dead:
            return errors.unavailable(f"The engine is not available: {self.state.engine.dead_reason}",
                                      "engine_dead")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > config.max_request_bytes:
            return errors.too_large()
        return None


def add_outer_middleware(app: FastAPI, config: ServerConfig) -> None:
    """CORS (vLLM's Starlette CORSMiddleware with --allowed-origins/-methods/-headers and --allow-credentials) and,
    with --enable-request-id-headers, X-Request-Id, both outside GuardMiddleware: a browser's preflight (an OPTIONS
    request, which carries no Authorization header) is answered without the API key, and the guard's own answers
    (401, 503, 413) carry the CORS and X-Request-Id headers too. Call after adding GuardMiddleware."""
    app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=config.allowed_methods,
                       allow_headers=config.allowed_headers, allow_credentials=config.allow_credentials)
    if config.enable_request_id_headers:
        app.add_middleware(XRequestIdMiddleware)


class XRequestIdMiddleware:
    """vLLM's --enable-request-id-headers: every response carries `X-Request-Id`, the request's own header if it
    sent one, else a random uuid4 (hex)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                request_id = value.decode("latin-1")
                break
        if request_id is None:
            request_id = uuid.uuid4().hex

        async def send_with_request_id(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                MutableHeaders(raw=headers).append("X-Request-Id", request_id)
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_request_id)


def prechecked_route_class(caps: ServerConfig,
                           precheck: Callable[[bytes, ServerConfig], Any] = precheck_caps) -> type[APIRoute]:
    """A route whose JSON body is checked against the request caps (`precheck`, by default precheck_caps) before
    FastAPI parses and validates it: a list of 100,000 prompts is rejected in milliseconds, not after building
    100,000 objects. `precheck` raises the APIError of a cap broken, and returns the parsed body when it had to
    parse it (else None)."""

    class PrecheckedRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def checked_handler(request: Request) -> Response:
                try:
                    body = await request.body()
                except BodyTooLarge:
                    return errors.too_large().to_response()  # GuardMiddleware sends its 413 in this one's place
                except ClientDisconnect:  # gone while its body was being read: nothing to answer, nothing to log
                    return Response(status_code=499)
                try:
                    if body:
                        parsed = precheck(body, caps)
                        if parsed is not None:
                            request._json = parsed  # Starlette's cache of request.json(): FastAPI parses it once
                    return await handler(request)
                except RecursionError:  # FastAPI's parse or validation of a body at the edge of precheck's depth
                    return errors.too_deep().to_response()

            return checked_handler

    return PrecheckedRoute
