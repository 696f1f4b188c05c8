"""Sliding-window hits: the longest prefix a window model can use, and its K/V.

A model whose every layer attends through a sliding window of W tokens needs, to go on from
a cached prefix of P blocks, only the blocks holding keys its next query sees: the last
ceil(W / block_size) blocks before P (`window_blocks`). A window cache's index may hold
holes (`RadixIndex.punch`), so a hit is the longest prefix whose window is all held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvstore.layout import LayerKV
from kvstore.pool import BlockPool


def window_prefix(block_ids: Sequence[int | None], window_blocks: int) -> int:
    """The longest prefix (in blocks) whose last `window_blocks` blocks are all held (all of
    it when it is that short): the longest hit a window model can use (None: a hole)."""
    point = len(block_ids)
    for hole in reversed([i for i, b in enumerate(block_ids) if b is None]):
        if hole < point - window_blocks:
            break
        point = min(point, hole)
    return point


class WindowCut(NamedTuple):
    """A hit shortened to what a window model can use."""

    block_ids: list[int | None]  # the window's blocks before the point; None before them
    num_tokens: int  # the usable prefix, in tokens
    tier_tokens: dict[str, int]  # its tokens by source tier
    dropped: list[int | None]  # the ids the hit let go of


def cut_to_window(
    block_ids: list[int | None], tier_tokens: dict[str, int], window_blocks: int, block_size: int
) -> WindowCut:
    """A hit's blocks cut to its longest usable prefix, keeping only the blocks of the
    window before its point; `tier_tokens` (the device first, then tiers in order) cut to
    match."""
    point = window_prefix(block_ids, window_blocks)
    first = max(0, point - window_blocks)
    tiers = cut_tier_tokens(tier_tokens, point * block_size)
    kept = [None] * first + block_ids[first:point]
    return WindowCut(kept, point * block_size, tiers, block_ids[:first] + block_ids[point:])


def cut_tier_tokens(tier_tokens: dict[str, int], num_tokens: int) -> dict[str, int]:
    """A hit's tokens by source tier (the device first, then tiers in order) cut to its
    first `num_tokens`."""
    left, tiers = num_tokens, {}
    for tier, tokens in tier_tokens.items():
        if min(tokens, left):
            tiers[tier] = min(tokens, left)
        left -= min(tokens, left)
    return tiers


def gather_window(pool: BlockPool, block_ids: list[int | None]) -> list[LayerKV]:
    """`pool.gather` of a window hit: zeros where it holds no block (keys no query of the
    request sees: its window masks them)."""
    held = [i for i, b in enumerate(block_ids) if b is not None]
    kv = pool.gather([block_ids[i] for i in held])
    bs, n = pool.block_size, len(block_ids)
    slots = torch.cat([torch.arange(i * bs, (i + 1) * bs) for i in held])
    out = []
    for k, v in kv:
        full = [x.new_zeros((*x.shape[:2], n * bs, x.shape[3])) for x in (k, v)]
        for dst, src in zip(full, (k, v), strict=True):
            dst[:, :, slots] = src
        out.append((full[0], full[1]))
    return out
