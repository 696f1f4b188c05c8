"""The OpenAI routes an app serves, wired to whatever answers them: the replica server's
`Service.handle` or the router's `Router.handle`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from engine.api.errors import ApiError, add_error_handlers

Handle = Callable[[Request, str], Awaitable[Response]]  # (request, "completion" | "chat")
OPENAI_PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


def add_openai_routes(
    app: FastAPI, handle: Handle, on_error: Callable[[ApiError], None] | None = None
) -> None:
    """POST /v1/completions and /v1/chat/completions through `handle(request, kind)`, and
    every error in OpenAI's error shape (`add_error_handlers`)."""
    add_error_handlers(app, on_error)

    @app.post(OPENAI_PATHS["completion"])
    async def completions(request: Request) -> Response:
        return await handle(request, "completion")

    @app.post(OPENAI_PATHS["chat"])
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat")
