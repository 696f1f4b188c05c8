"""Server-sent events: one event's text, the headers every stream carries, and a streaming
response that closes its body however it ends (a client that went away included), so the
job or upstream request behind it is cancelled."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_MEDIA_TYPE = "text/event-stream"


def sse(data: Any) -> str:
    """One server-sent event carrying JSON (or the literal [DONE])."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


class ClosingStream(StreamingResponse):
    """An event stream (SSE_HEADERS added to `headers`) that calls `on_end` once it ends,
    even if its body never started (a client gone before the first event), then closes
    its body."""

    def __init__(
        self,
        events: AsyncIterator[str | bytes],
        *,
        on_end: Callable[[], None] | None = None,
        media_type: str = SSE_MEDIA_TYPE,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(events, media_type=media_type, headers=SSE_HEADERS | (headers or {}))
        self.events, self.on_end = events, on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_end is not None:
                self.on_end()
            with anyio.CancelScope(shield=True):
                await self.events.aclose()
