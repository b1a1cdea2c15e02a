"""GET /load and --enable-server-load-tracking (vLLM's): how many generation requests this API server is serving.

vLLM counts a request of its generation and pooling routes from the moment its handler starts until its response
(streamed or not) has been sent; pagedllm counts the same span with a pure ASGI middleware around the paths in
LOAD_TRACKED_PATHS, inside the guard (a request refused for its API key, the drain or a dead engine is not
counted). /load answers `{"server_load": N}` always; without the flag N stays 0, as vLLM's does. With several API
servers (--api-server-count) each counts its own.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse

LOAD_TRACKED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
                                "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
                                "/v2/rerank"})
"""vLLM's load-aware routes (those with @load_aware_call); the ones pagedllm does not serve answer 404 at once."""


class ServerLoad:
    """The count, shared by the middleware and the route."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.value = 0


class ServerLoadMiddleware:
    """Counts the requests to LOAD_TRACKED_PATHS from their arrival to the end of their response (or the
    client's disconnect)."""

    def __init__(self, app, load: ServerLoad):
        self.app = app
        self.load = load

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in LOAD_TRACKED_PATHS:
            return await self.app(scope, receive, send)
        self.load.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.value -= 1


def add_load_route(app: FastAPI, enabled: bool) -> None:
    """GET /load, and the middleware that counts when `enabled` (--enable-server-load-tracking)."""
    load = ServerLoad(enabled)
    if enabled:
        app.add_middleware(ServerLoadMiddleware, load=load)

    @app.get("/load", responses={200: {"description": '`{"server_load": N}`: generation requests being served '
                                                      "(0 without --enable-server-load-tracking)."}})
    async def server_load():
        return JSONResponse({"server_load": load.value})
