"""Sliding-window attention: the longest prefix a window model can use, and its K/V.

A model whose every layer attends through a sliding window of W tokens needs, to go on from
a cached prefix of P blocks, only the blocks holding keys its next query sees: the last
ceil(W / block_size) blocks before P (`window_blocks`). A window cache's index may hold
holes (`RadixIndex.punch`), so a hit is the longest prefix whose window is all held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvstore.attention.base import AttentionKind, Forget, Held, Relock, Span
from kvstore.device.pool import BlockPool
from kvstore.device.seq_blocks import SeqBlocks
from kvstore.hits import CacheHit
from kvstore.index import RadixIndex, TreeNode
from kvstore.layout import LayerKV
from kvstore.units import cdiv


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


def slid_to(seq: SeqBlocks, num_computed: int, window: int, bs: int, limit: int, align: int) -> int:
    """The blocks of `bs` tokens no query from position `num_computed` on sees (keys
    before num_computed - window + 1), not past block `limit`, in whole `align`-block
    chunks."""
    upto = min(max(0, num_computed - window + 1) // bs, len(seq.block_table))
    return min(upto, limit) // align * align


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


class SlidingWindow(AttentionKind):
    """Every layer attends through a window of `window` tokens: a hit needs only the
    window's blocks before its point, and a running request drops the blocks that slid out
    of its window (the index its copies too: holes, `RadixIndex.punch`)."""

    slides = True

    def __init__(self, pool: BlockPool, index: RadixIndex, window: int):
        super().__init__(pool, index)
        self.window = window
        # a query at the point, or at the point's last token (a whole-prompt hit re-runs
        # it), sees keys back to point - window
        self.window_blocks = cdiv(window, pool.block_size)

    def usable_blocks(self, block_ids: Sequence[int | None]) -> int:
        return window_prefix(block_ids, self.window_blocks)

    def promote_from(self, block_ids: list[int | None], windows: list[int]) -> int:
        """Past the device match, or at the window before it when holes leave a shorter
        hit (tier blocks fill the holes)."""
        n = len(block_ids)
        return n if self.usable_blocks(block_ids) == n else max(0, n - self.window_blocks)

    def cut(self, hit: CacheHit, windows: list[int], tokens: np.ndarray, relock: Relock) -> None:
        bs = self.pool.block_size
        cut = cut_to_window(hit.block_ids, hit.tier_tokens, self.window_blocks, bs)
        hit.block_ids, hit.tier_tokens = cut.block_ids, cut.tier_tokens
        hit.num_cached_tokens = cut.num_tokens
        self.pool.free([b for b in cut.dropped if b is not None], window=False)

    def gather(self, hit: CacheHit) -> list[LayerKV]:
        if None in hit.block_ids:
            return gather_window(self.pool, hit.block_ids)
        return super().gather(hit)

    def copies_whole(self, hit: CacheHit) -> bool:
        return None not in hit.block_ids

    def punch(
        self, node: TreeNode, lo: int, hi: int, align: int, write_back: Span, forget: Forget
    ) -> int:
        """The index drops its copies (holes, `RadixIndex.punch`), keeping those before a
        branch point."""
        write_back(node, lo, hi)
        owners: list[str] = []
        freed = self.index.punch(node, lo, hi, self.window_blocks, align, owners)
        if freed:
            forget(owners, freed)
        return len(freed)

    def slide(
        self, seq: SeqBlocks, num_computed: int, limit: int, align: int, held: Held
    ) -> tuple[int, int]:
        """The request drops the blocks themselves: its table's leading entries become None."""
        bs = self.pool.block_size
        upto = slid_to(seq, num_computed, self.window, bs, limit, align)  # type: ignore[arg-type]
        lo = seq.num_dropped
        if upto <= lo:
            return lo, lo
        mine = seq.block_table[lo:upto]
        seq.block_table[lo:upto] = [None] * (upto - lo)
        seq.num_dropped = upto
        held.free([b for b in mine if b is not None])
        return lo, upto
