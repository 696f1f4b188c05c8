"""Where an Anthropic request's `cache_control` breakpoints fall in its prompt's tokens.

A breakpoint's position is the length of the longest common token prefix of the whole
prompt and the prompt rendered from the conversation cut right after the breakpoint's
block. Whatever a chat template writes around a message (its end-of-turn tokens, the next
turn's header), that is where the prompt of any request that goes on from this block
differs from this one at the earliest: the prefix such requests share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from engine.api.anthropic import Breakpoint, MessagesRequest
from engine.api.errors import ApiError
from engine.api.prompts import chat_ids


class Retention(NamedTuple):
    """Retain the prompt's first `num_tokens` tokens for `ttl_s` seconds (the engine's
    `Retain`, which this layer cannot import: it stays torch-free)."""

    num_tokens: int
    ttl_s: float


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(differ[0]) if len(differ) else n


def position(tokenizer: Any, req: MessagesRequest, ids: Sequence[int], point: Breakpoint) -> int:
    """The breakpoint's token position in `ids` (the whole prompt). 0 when the template
    refuses the cut conversation (a template that needs a user turn last): nothing is
    retained for it then."""
    try:
        cut = chat_ids(tokenizer, req.chat_messages(req.cut(point)))
    except ApiError:
        return 0
    return common_prefix(ids, cut)


def retention(tokenizer: Any, req: MessagesRequest, ids: Sequence[int]) -> list[Retention]:
    """Each breakpoint's retention, in the prompt's order (none at position 0; one per
    position, the longest TTL)."""
    ttl: dict[int, float] = {}
    for point in req.breakpoints():
        at = position(tokenizer, req, ids, point)
        if at > 0:
            ttl[at] = max(ttl.get(at, 0.0), point.ttl_s)
    return [Retention(at, ttl[at]) for at in sorted(ttl)]
