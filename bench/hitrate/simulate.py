"""Replaying a block trace on the real `RadixIndex` with a real policy, one block a unit
(see `bench.hitrate`): per request match, lock the hit path, make room, insert, unlock."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from bench.hitrate.tiers import KEY_BYTES, key_blob
from bench.traces import BlockTrace
from kvstore.index import RadixIndex
from kvstore.index.policies import make_policy
from kvstore.index.policies.base import Policy

__all__ = ["OnRequest", "Progress", "ReplayResult", "replay"]

Progress = Callable[[int], None]
OnRequest = Callable[[int, int, RadixIndex], None]


class ReplayResult(NamedTuple):
    block_hits: int
    token_hits: int


def replay(
    trace: BlockTrace,
    policy: str | Policy,
    capacity: int,
    progress: Progress | None = None,
    on_request: OnRequest | None = None,
    lookup: Sequence[int] | None = None,
) -> ReplayResult:
    """Replay `trace` on a RadixIndex of `capacity` blocks evicting by `policy` (a name, or a
    fresh instance that only this replay uses).

    `on_request(r, hit_blocks, index)` runs after request r (tests check the index there).
    `lookup[r]` (default: all) is how many leading blocks request r may hit; it inserts all
    (the blocks past `lookup[r]` must be its own, as `bench.hitrate.live.with_answers` makes
    them: the room it makes counts every block past the hit as new).
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    if trace.num_unique >= 2**32:
        raise ValueError("more than 2^32 unique blocks do not fit the uint32 token ids")
    if not isinstance(policy, str) and policy.entries():
        raise ValueError("replay needs a fresh policy instance; this one already has entries")
    index = RadixIndex(1, make_policy(policy, capacity) if isinstance(policy, str) else policy)
    blob = key_blob(trace.num_unique)
    tokens = trace.blocks.astype(np.uint32)
    blocks, offsets = trace.blocks.tolist(), trace.offsets.tolist()
    block_hits = 0
    for r in range(trace.num_requests):
        lo, hi = offsets[r], offsets[r + 1]
        ids = blocks[lo:hi]
        keys = [blob[b * KEY_BYTES : (b + 1) * KEY_BYTES] for b in ids]
        m = hi - lo if lookup is None else lookup[r]
        hit = _serve(index, capacity, keys, tokens[lo:hi], ids, m)
        block_hits += hit
        if on_request is not None:
            on_request(r, hit, index)
        if progress is not None and r & 0x3FF == 0:
            progress(lo)
    return ReplayResult(block_hits, block_hits * trace.block_tokens)


def _serve(
    index: RadixIndex,
    capacity: int,
    keys: list[bytes],
    tokens: np.ndarray,
    ids: list[int],
    lookup: int,
) -> int:
    """One request: match its first `lookup` blocks, lock the hit path, make room, insert
    what fits, unlock."""
    n = len(ids)
    if n == 0:
        return 0
    match = index.match_prefix(keys[:lookup], tokens[:lookup])
    hit, node = match.num_blocks, match.last_node
    locked = node is not index.root
    if locked:
        index.lock(node)
    need = n - hit - (capacity - index.num_cached_blocks)
    if need > 0:
        index.evict(need)
    fit = hit + min(n - hit, capacity - index.num_cached_blocks)
    if fit > hit:
        index.insert(keys[:fit], tokens[:fit], ids[:fit])
    if locked:
        index.unlock(node)
    return hit
