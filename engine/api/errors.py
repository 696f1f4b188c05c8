"""Errors answered as JSON: `ApiError` carries status, message and OpenAI's error fields, and
`add_error_handlers` makes every error of an app (ours, an unknown path, a wrong method) one.

The body is OpenAI's error shape; another API shape renders the same ApiError its own way.
"""

from __future__ import annotations

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


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def add_error_handlers(app: FastAPI, on_error: Callable[[ApiError], None] | None = None) -> None:
    """Every ApiError, and starlette's own errors (404 for an unknown path, 405 for a wrong
    method), answered in OpenAI's error shape; `on_error` sees each ApiError first (the
    server counts refusals)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        if on_error is not None:
            on_error(error)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {error.detail}"
        return await api_error(request, ApiError(error.status_code, message, type=kind))
