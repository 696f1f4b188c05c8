"""Tokens from the engine's worker thread to an SSE stream (`engine.api.sse`): a thread-safe
bridge into asyncio and an incremental detokenizer that never sends text a stop string will
cut away."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

DONE = object()  # the bridge's end marker
_INCOMPLETE = "\ufffd"  # what a partial UTF-8 sequence decodes to
_MAX_UTF8_TAIL = 3  # bytes of a UTF-8 sequence that may still be missing


class TokenBridge:
    """Token ids from the worker thread, in order, then DONE once the job's future is done."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue[object] = asyncio.Queue()

    def push(self, token_id: int) -> None:
        """Thread-safe; used as the job's on_token."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, token_id)

    def watch(self, future: Future) -> None:
        """DONE follows every pushed token: the worker pushes before it resolves the future."""
        future.add_done_callback(
            lambda _: self._loop.call_soon_threadsafe(self._queue.put_nowait, DONE)
        )

    async def get(self) -> object:
        return await self._queue.get()


class TextStreamer:
    """Text deltas of a growing token list. Holds back the last (longest stop - 1) characters
    and a trailing partial UTF-8 character, so everything sent is a prefix of the final text."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.sent = ""

    def push(self, token_id: int) -> str:
        """Add a token; returns the text that can be sent now (maybe empty)."""
        self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        end = len(text) - self.holdback
        cut = min((i for s in self.stop if (i := text.find(s)) >= 0), default=None)
        if cut is not None:
            end = min(end, cut)
        tail = len(text) - _MAX_UTF8_TAIL
        while end > max(len(self.sent), tail) and text[end - 1] == _INCOMPLETE:
            end -= 1
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent) : end]
        self.sent += delta
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the final text (the engine's, already cut at a stop string)."""
        if not final_text.startswith(self.sent):
            return ""  # cannot happen for prefix-stable tokenizers; never resend text
        rest = final_text[len(self.sent) :]
        self.sent = final_text
        return rest
