"""The API routes an app serves, wired to whatever answers them: the replica server's
`Service.handle` or the router's `Router.handle`. OpenAI's (`/v1/completions`,
`/v1/chat/completions`) and Anthropic's (`/v1/messages`, and `/v1/messages/count_tokens`,
which the server and the router answer alike: the prompt as the replicas render it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.api import openai as p
from engine.api.anthropic import CountTokensRequest, parse_messages
from engine.api.body import read_json
from engine.api.errors import ANTHROPIC_PATH, ApiError, add_error_handlers
from engine.api.prompts import prompt_ids

Handle = Callable[[Request, str], Awaitable[Response]]  # (request, kind: an API_PATHS key)
OPENAI_PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
API_PATHS = {**OPENAI_PATHS, "messages": ANTHROPIC_PATH}
COUNT_TOKENS_PATH = ANTHROPIC_PATH + "/count_tokens"


async def read_request(request: Request, kind: str, limit: int) -> tuple[object, Any]:
    """The JSON body (at most `limit` bytes) and its validated request of `kind`."""
    if kind != "messages":
        return await p.read_request(request, kind, limit)
    data = await read_json(request, limit)
    return data, parse_messages(data)


def add_api_routes(
    app: FastAPI, handle: Handle, on_error: Callable[[ApiError], None] | None = None
) -> None:
    """POST each of API_PATHS through `handle(request, kind)`, and every error in the shape
    of its path's API (`add_error_handlers`)."""
    add_error_handlers(app, on_error)
    for kind, path in API_PATHS.items():
        app.add_api_route(path, _route(handle, kind), methods=["POST"], name=kind)


def _route(handle: Handle, kind: str) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        return await handle(request, kind)

    return route


def add_count_tokens_route(
    app: FastAPI,
    authenticate: Callable[[Request], object],
    check_model: Callable[[str | None], None],
    tokenizer: Any,
    limit: int,
) -> None:
    """POST /v1/messages/count_tokens: the prompt's tokens through the chat template, as a
    message with the same body would count them (its usage's input, cache creation and
    cache read tokens added up)."""

    async def count_tokens(request: Request) -> Response:
        authenticate(request)
        data = await read_json(request, limit)
        req = parse_messages(data, CountTokensRequest)
        check_model(req.model)
        ids = await run_in_threadpool(prompt_ids, tokenizer, req)
        return JSONResponse({"input_tokens": len(ids)})

    app.add_api_route(COUNT_TOKENS_PATH, count_tokens, methods=["POST"], name="count_tokens")
