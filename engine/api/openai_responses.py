"""OpenAI's response objects: a completion or chat completion, its usage, and the chunks of
its stream (completions stream text, chat streams deltas)."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from engine.api.logprobs import LogprobFormat, Position
from engine.api.sse import sse

if TYPE_CHECKING:
    from engine.loop.request import GenerateResult


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(result: GenerateResult) -> dict:
    completion = len(result.output_token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def completion_choice(text: str, finish_reason: str | None, token_ids: list[int] | None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return choice if token_ids is None else {**choice, "token_ids": token_ids}


def chat_choice(text: str, finish_reason: str, token_ids: list[int] | None) -> dict:
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
    return choice if token_ids is None else {**choice, "token_ids": token_ids}


def chat_delta(delta: dict, finish_reason: str | None, token_ids: list[int] | None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return choice if token_ids is None else {**choice, "token_ids": token_ids}


def envelope(kind: str, rid: str, created: int, model: str, choices: list[dict]) -> dict:
    """A response or stream chunk; kind is the OpenAI `object` name."""
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}


class StreamChunks:
    """Stream events of one response: completions send text, chat sends deltas."""

    def __init__(
        self, kind: str, model: str, include_usage: bool, logprobs: LogprobFormat | None = None
    ):
        """`logprobs`: the shape of the logprobs each text event carries (None: none)."""
        self.kind, self.model = kind, model
        self.object = "text_completion" if kind == "completion" else "chat.completion.chunk"
        self.id = new_id("cmpl" if kind == "completion" else "chatcmpl")
        self.created = now()
        self.extra = {"usage": None} if include_usage else {}
        self.started = False
        self.logprobs = logprobs
        self.pending: list[Position] = []  # tokens whose logprobs no event carried yet
        self.prefix = ""  # text the next text event starts with (a completion's echo)

    def _event(self, choices: list[dict]) -> str:
        body = envelope(self.object, self.id, self.created, self.model, choices)
        return sse({**body, **self.extra})

    def _text(self, choice: dict) -> dict:
        """A choice that sends text: the pending logprobs (and echo) go with it."""
        if self.logprobs is not None and self.pending:
            choice["logprobs"], self.pending = self.logprobs(self.pending), []
        if self.prefix:
            choice["text"], self.prefix = self.prefix + choice["text"], ""
        return choice

    def delta(self, text: str) -> list[str]:
        """Events for new text; the first token always yields one (clients time TTFT by it)."""
        first, self.started = not self.started, True
        if self.kind == "completion":
            choice = completion_choice(text, None, None)
            return [self._event([self._text(choice)])] if text or first else []
        out = [self._event([chat_delta({"role": "assistant", "content": ""}, None, None)])]
        out = out if first else []
        if text:
            out.append(self._event([self._text(chat_delta({"content": text}, None, None))]))
        return out

    def final(self, text: str, finish_reason: str, token_ids: list[int] | None) -> str:
        if self.kind == "completion":
            return self._event([self._text(completion_choice(text, finish_reason, token_ids))])
        delta = {"content": text} if text else {}
        return self._event([self._text(chat_delta(delta, finish_reason, token_ids))])

    def usage(self, result: GenerateResult) -> str:
        body = envelope(self.object, self.id, self.created, self.model, [])
        return sse({**body, "usage": usage(result)})


def response_body(kind: str, model: str, result: GenerateResult, return_token_ids: bool) -> dict:
    """The whole answer of a request that did not stream, with its usage."""
    ids = result.output_token_ids if return_token_ids else None
    if kind == "completion":
        choice = completion_choice(result.text, result.finish_reason, ids)
        body = envelope("text_completion", new_id("cmpl"), now(), model, [choice])
    else:
        choice = chat_choice(result.text, result.finish_reason, ids)
        body = envelope("chat.completion", new_id("chatcmpl"), now(), model, [choice])
    return {**body, "usage": usage(result)}
