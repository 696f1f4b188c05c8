"""Block arithmetic shared by the cache, the engine and the benchmarks."""

from __future__ import annotations

__all__ = ["cdiv"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative `a` by positive `b`: the blocks that `a` tokens span."""
    return -(-a // b)
