"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with OpenAI's status.

Handlers raise `APIError` (or a subclass); the server's exception handler turns it into a JSON response.
`to_api_error` maps every other exception raised while serving (engine errors, invalid requests) to one.
A bad request is never a 5xx: the official SDK retries 5xx.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi.responses import JSONResponse

from pagedllm.core.scheduler import QueueFullError
from pagedllm.engine.async_llm import RequestAbortedError, RequestFailedError
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.input_processor import InvalidRequestError
from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, random_uuid
from pagedllm.log_escape import escape_control
from pagedllm.messages import SLO_UNATTAINABLE

logger = logging.getLogger(__name__)


class APIError(Exception):
    """A request that gets an error response instead of a result."""

    def __init__(self, status: int, message: str, type: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def to_info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)

    def to_response(self) -> JSONResponse:
        body = ErrorResponse(error=self.to_info()).model_dump()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, "invalid_request_error", param, code)


def unauthorized() -> APIError:
    return APIError(HTTPStatus.UNAUTHORIZED, "Incorrect API key provided.", "invalid_request_error",
                    code="invalid_api_key")


def model_not_found(model: str) -> APIError:
    return APIError(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", "invalid_request_error",
                    param="model", code="model_not_found")


def not_found(path: str) -> APIError:
    return APIError(HTTPStatus.NOT_FOUND, f"Not found: {path}", "invalid_request_error", code="not_found")


def unavailable(message: str, code: str, retry_after_s: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE, message, "service_unavailable_error", code=code,
                    headers=headers)


def internal(message: str) -> APIError:
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, message, "internal_error", code="internal_error")


def too_large() -> APIError:
    return APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "The request body is too large.",
                    "invalid_request_error", code="request_too_large")


def too_deep() -> APIError:
    """The error for a JSON body nested past what the parsers recurse into (~1,000 levels)."""
    return bad_request("The request body is nested too deeply to parse.", code="json_too_deep")


def to_api_error(e: BaseException, value_error_is_bad_request: bool = True) -> APIError:
    """The HTTP error for an exception raised while serving a request.

    An unexpected exception becomes a 500 that says nothing of the server's internals (no message,
    traceback, path or address); the details go to the log under an error id the response carries.
    value_error_is_bad_request=False: a plain ValueError is one of those (it escaped the request handling,
    e.g. while rendering the response, so it is the server's fault, not the request's)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return bad_request(str(e), e.param, e.code)
    if isinstance(e, QueueFullError):
        return unavailable(str(e), "queue_full", retry_after_s=1)
    if isinstance(e, EngineDeadError):
        return unavailable(f"The engine is not available: {e}", "engine_dead")
    if isinstance(e, RequestAbortedError):
        return unavailable(str(e), "aborted", retry_after_s=1)
    if isinstance(e, RequestFailedError):
        if e.code == SLO_UNATTAINABLE:  # overload, not a fault: 503 like a full queue (the client may retry later)
            return unavailable(str(e), SLO_UNATTAINABLE)
        return internal(str(e))
    if isinstance(e, UnicodeError):
        return bad_request("The request contains text that is not valid Unicode (a lone surrogate?).")
    if isinstance(e, ValueError) and value_error_is_bad_request:
        return bad_request(str(e))
    error_id = random_uuid()[:16]
    logger.error("internal error %s: %s: %s", error_id, type(e).__name__, escape_control(e), exc_info=e)
    return internal(f"The server had an error while processing your request (error id {error_id}).")
