"""The OpenAPI document's parts that FastAPI does not write as this server answers: the error responses of each
route, the SSE content of the generation routes, and no 422 (validation errors are 400 here)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pagedllm.entrypoints.openai.protocol import ErrorResponse


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": HTTPStatus(status).phrase} for status in statuses}


SSE_CONTENT = {"text/event-stream": {"schema": {"type": "string", "description": "Server-sent events (stream=true)."}}}


def openapi_document(app: FastAPI) -> dict[str, Any]:
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
