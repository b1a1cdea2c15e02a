"""What runs before a route's handler: `GuardMiddleware` (API key, drain, engine death, the body cap) around the
whole app, and `prechecked_route_class` (the request caps on the raw body) around the generation and token routes.

The head's size limit is enforced a level below, in the HTTP protocol (connection_limits.py)."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from pagedllm.config import ServerConfig
from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.request_caps import precheck_caps
from pagedllm.entrypoints.openai.server_state import ServerState

UNGUARDED_PATHS = {"/health", "/ping", "/metrics"}

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
            return errors.unavailable(f"The engine is not available: {self.state.engine.dead_reason}",
                                      "engine_dead")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > config.max_request_bytes:
            return errors.too_large()
        return None


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
