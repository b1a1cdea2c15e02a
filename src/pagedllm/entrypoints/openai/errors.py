"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with OpenAI's status.

Handlers raise `APIError` (or a subclass); the server's exception handler turns it into a JSON response.
A bad request is never a 5xx: the official SDK retries 5xx.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse


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
