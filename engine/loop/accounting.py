"""The engine's side of the block accounting (`Engine.check_integrity`): the references its
running tables and lent blocks hold, and the blocks it reserved, held against the pool's
reference counts (`PrefixCache.check_integrity`)."""

from __future__ import annotations

from collections import Counter

from engine.loop.scheduler import Scheduler
from kvstore.cache import PrefixCache


def held_references(scheduler: Scheduler) -> Counter[int]:
    """Block -> the references the engine holds on it: one per running request's table
    entry, one per block a released group lends its branches."""
    held: Counter[int] = Counter()
    for request in scheduler.running:
        if request.state is not None:
            held.update(b for b in request.state.blocks.block_table if b is not None)
    for group in scheduler.released:
        if group.lent is not None:
            held[group.lent.block_id] += 1
    return held


def check_blocks(cache: PrefixCache, scheduler: Scheduler, reserved: set[int]) -> None:
    """Every block's references are its owners' and the reserved blocks are `reserved`
    (the engine's scratch block); AssertionError naming the first fault. Run it on the
    engine's loop thread, between steps."""
    if cache.held.reserved != reserved:
        raise AssertionError(f"reserved blocks {sorted(cache.held.reserved)}, the engine's "
                             f"{sorted(reserved)}")  # fmt: skip
    cache.check_integrity(held_references(scheduler))
