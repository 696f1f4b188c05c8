"""Errors answered as JSON: `ApiError` carries status, message and OpenAI's error fields, and
`add_error_handlers` makes every error of an app (ours, an unknown path, a wrong method) one.

The body is OpenAI's error shape, except under ANTHROPIC_PATH (Anthropic's Messages API),
where the same ApiError is rendered in Anthropic's: `{"type": "error", "error": {"type",
"message"}}`, its type from the HTTP status and the field named in the message.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse


class ApiError(Exception):
    """An error answered as an OpenAI-style JSON error with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        error = {"message": self.message, "type": self.type, "param": self.param}
        return {"error": {**error, "code": self.code}}


ANTHROPIC_PATH = "/v1/messages"  # errors on it and under it are in Anthropic's shape
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error",
                   529: "overloaded_error"}  # fmt: skip


def anthropic_body(error: ApiError) -> dict:
    """The ApiError in Anthropic's error shape; a 400's message starts with its field."""
    default = "api_error" if error.status >= 500 else "invalid_request_error"
    kind = ANTHROPIC_TYPES.get(error.status, default)
    message = error.message
    if error.param is not None and not message.startswith(f"{error.param}:"):
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def error_body(error: ApiError, path: str) -> dict:
    """The error's body in the shape of the API `path` belongs to."""
    return anthropic_body(error) if is_anthropic(path) else error.body()


def stream_error(error: ApiError, path: str) -> str:
    """The event that ends a stream of `path` with `error` (OpenAI's: its body as data)."""
    body = json.dumps(error_body(error, path), separators=(",", ":"))
    return f"event: error\ndata: {body}\n\n" if is_anthropic(path) else f"data: {body}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def add_error_handlers(app: FastAPI, on_error: Callable[[ApiError], None] | None = None) -> None:
    """Every ApiError, and starlette's own errors (404 for an unknown path, 405 for a wrong
    method), answered in the error shape of the path's API (`error_body`); `on_error` sees
    each ApiError first (the server counts refusals)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        if on_error is not None:
            on_error(error)
        body = error_body(error, request.url.path)
        return JSONResponse(body, status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {error.detail}"
        return await api_error(request, ApiError(error.status_code, message, type=kind))
