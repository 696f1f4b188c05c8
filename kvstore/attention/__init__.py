"""Attention kinds: how full, sliding-window and hybrid attention cache (`AttentionKind`)."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.attention.base import AttentionKind, FullAttention
from kvstore.attention.hybrid import HybridAttention, IndexWindows
from kvstore.attention.sliding import SlidingWindow, window_prefix
from kvstore.device.pool import BlockPool
from kvstore.index import RadixIndex

__all__ = [
    "AttentionKind",
    "FullAttention",
    "HybridAttention",
    "IndexWindows",
    "SlidingWindow",
    "check_window",
    "make_attention",
    "window_prefix",
]


def check_window(window: int | None, window_layers: Sequence[int] | None) -> None:
    """`TypeError`/`ValueError` for a window that is not a positive int, or window layers
    without one."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise TypeError(f"window must be an int or None, got {window!r}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 token, got {window}")
    if window_layers and window is None:
        raise ValueError("window_layers needs the window they attend through")


def make_attention(pool: BlockPool, index: RadixIndex, window: int | None) -> AttentionKind:
    """The kind of a pool's model: full, sliding window (every layer), or hybrid (the pool
    has a window plane for its window layers)."""
    if window is None:
        return FullAttention(pool, index)
    if pool.window is None:
        return SlidingWindow(pool, index, window)
    return HybridAttention(pool, index, window)
