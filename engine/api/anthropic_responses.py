"""Anthropic's Messages API answers: the message, its usage (cache reads and writes), and the
server-sent events of its stream (`event: NAME` then `data: JSON`).

Usage: `cache_read_input_tokens` are the prompt tokens whose K/V came from the cache;
`cache_creation_input_tokens` those this request wrote to the cache up to its furthest
breakpoint, counted in whole blocks (the cache holds whole blocks: a breakpoint inside a
block retains up to the block boundary before it); `input_tokens` the rest of the prompt.
The three add up to the prompt's tokens.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import NamedTuple

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}  # the engine's finish_reason ->


TTL_NAMES = {300.0: "5m", 3600.0: "1h"}  # cache_control ttl (seconds) -> its name


class Usage(NamedTuple):
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int
    creation_by_ttl: dict[str, int]  # the cache writes split by their breakpoint's TTL

    def body(self) -> dict:
        out = self._asdict()
        by_ttl = out.pop("creation_by_ttl")
        out["cache_creation"] = {f"ephemeral_{name}_input_tokens": by_ttl.get(name, 0)
                                 for name in ("5m", "1h")}  # fmt: skip
        return out


def usage(
    prompt_tokens: int,
    cached_tokens: int,
    output_tokens: int,
    breakpoints: Sequence[tuple[int, float]],
    block_size: int,
) -> Usage:
    """A request's usage; `breakpoints`: (token position, TTL seconds) of each, each
    rounded down to whole blocks and to the prompt's whole blocks. The tokens written up to
    a breakpoint past those before it count under its TTL (Anthropic's split of
    `cache_creation`)."""
    by_ttl: dict[str, int] = {}
    written = cached_tokens
    for end, ttl_s in sorted(breakpoints):
        whole = min(end, prompt_tokens) // block_size * block_size
        if whole > written:
            name = TTL_NAMES.get(ttl_s, "5m")
            by_ttl[name] = by_ttl.get(name, 0) + whole - written
            written = whole
    creation = written - cached_tokens
    rest = prompt_tokens - cached_tokens - creation
    return Usage(rest, creation, cached_tokens, output_tokens, by_ttl)


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


class Stop(NamedTuple):
    reason: str  # "end_turn", "max_tokens" or "stop_sequence"
    sequence: str | None  # the stop sequence that ended it


def stop_of(finish_reason: str, text: str, output_text: str, stops: Sequence[str]) -> Stop:
    """Why the answer ended: the stop sequence found where the engine cut the answer
    (`text`) in the decoded output (`output_text`), else the end of turn or max_tokens."""
    if finish_reason == "stop":
        for sequence in stops:
            if output_text.startswith(sequence, len(text)):
                return Stop("stop_sequence", sequence)
    return Stop(STOP_REASONS.get(finish_reason, "end_turn"), None)


def message_body(
    rid: str, model: str, text: str, stop: Stop | None, use: Usage
) -> dict:  # fmt: skip
    """A message: the whole answer, or (`stop` None, no text) what message_start carries."""
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}] if stop is not None else [],
        "model": model,
        "stop_reason": None if stop is None else stop.reason,
        "stop_sequence": None if stop is None else stop.sequence,
        "usage": use.body(),
    }


def event(name: str, data: dict) -> str:
    """One server-sent event: its name, and `data` (which carries the name as `type`)."""
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class MessageEvents:
    """The events of one streamed message with one text block."""

    def __init__(self, model: str):
        self.id, self.model = new_message_id(), model
        self.started = False

    def start(self, use: Usage) -> list[str]:
        """message_start (usage as known at the first token), the text block's start, a ping."""
        self.started = True
        message = message_body(self.id, self.model, "", None, use)
        block = {"type": "content_block_start", "index": 0,
                 "content_block": {"type": "text", "text": ""}}  # fmt: skip
        return [
            event("message_start", {"type": "message_start", "message": message}),
            event("content_block_start", block),
            event("ping", {"type": "ping"}),
        ]

    def delta(self, text: str) -> list[str]:
        if not text:
            return []
        delta = {"type": "text_delta", "text": text}
        data = {"type": "content_block_delta", "index": 0, "delta": delta}
        return [event("content_block_delta", data)]

    def stop(self, stop: Stop, use: Usage) -> list[str]:
        """The block's end, message_delta (the stop and the final usage), message_stop."""
        delta = {"stop_reason": stop.reason, "stop_sequence": stop.sequence}
        return [
            event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            event("message_delta", {"type": "message_delta", "delta": delta, "usage": use.body()}),
            event("message_stop", {"type": "message_stop"}),
        ]
