"""Offline figures for a block trace at a given capacity (in blocks), and the block-exact LRU
reference.

The first two use the future (Belady's MIN), so no online policy can use them; they frame the
hit rates of the real policies:

- `upper_bound_hits`: Belady/MIN with bypass over the flat sequence of block references (every
  request's blocks, in order). A reference hits iff the block is resident; on a miss the block
  may be stored (evicting the resident block used farthest in the future) or skipped, and it is
  skipped when its own next use is the farthest. For blocks of one size this maximizes hits
  over every cache of that capacity that loads blocks on demand. A prefix cache of the same
  capacity is such a cache (plus constraints: it stores whole prefixes, evicts leaves only,
  keeps the request's path, and counts only the leading run of resident blocks), so its block
  hits can never exceed this bound, whatever its eviction or admission policy.
- `offline_leaf_hits`: an achievable offline reference: a prefix cache (the tree of blocks,
  every block of every request inserted, the request's hit path locked while it inserts) that
  evicts the unlocked leaf block whose next use is farthest in the future. It is a real prefix
  cache with an oracle eviction policy, so its hit rate is achievable in principle; it is not
  optimal among prefix caches, so a policy may exceed it.

`block_lru_hits` needs no future: the same prefix cache as `offline_leaf_hits` evicting the
least recently used block (a block is used when its request hits or inserts it; among blocks
of one request, the deepest leaf goes first). It is what the index's LRU policy must equal: the
index ranks runs of blocks, not blocks, and refreshes only the blocks a hit used.

Times are positions in the flat reference sequence; a block never used again has next use
`NEVER` (ties between such blocks go to the larger block id).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from bench.traces import BlockTrace

__all__ = [
    "NEVER",
    "OfflineResult",
    "block_lru_hits",
    "infinite_hits",
    "next_use",
    "offline_leaf_hits",
    "upper_bound_hits",
]

NEVER = np.iinfo(np.int64).max

Progress = Callable[[int], None]


class OfflineResult(NamedTuple):
    block_hits: int
    token_hits: int


def next_use(blocks: np.ndarray) -> np.ndarray:
    """int64 [n]: for each reference, the position of the next reference to the same block,
    or NEVER."""
    n = len(blocks)
    order = np.lexsort((np.arange(n), blocks))  # by block, then by position
    out = np.full(n, NEVER, dtype=np.int64)
    same = blocks[order[1:]] == blocks[order[:-1]]
    out[order[:-1][same]] = order[1:][same]
    return out


def infinite_hits(trace: BlockTrace) -> int:
    """Block hits with unbounded capacity: every reference but a block's first one."""
    return trace.num_refs - trace.num_unique


def upper_bound_hits(trace: BlockTrace, capacity: int, progress: Progress | None = None) -> int:
    """Belady/MIN with bypass over the flat reference sequence (see the module docstring)."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    nxt = next_use(trace.blocks).tolist()
    # a resident block is named by its next use (a position, unique): `resident` holds those
    resident: set[int] = set()
    farthest: list[int] = []  # max-heap (negated) of resident next uses; hits leave stale items
    hits = 0
    for i, nu in enumerate(nxt):
        if i in resident:
            resident.remove(i)
            hits += 1
        if nu == NEVER:
            continue
        if len(resident) >= capacity:
            while -farthest[0] not in resident:
                heapq.heappop(farthest)
            if -farthest[0] <= nu:
                continue  # bypass: this block's next use is the farthest
            resident.remove(-heapq.heappop(farthest))
        resident.add(nu)
        heapq.heappush(farthest, -nu)
        if len(farthest) > 4 * capacity + 1024:  # drop stale items
            farthest = [-x for x in resident]
            heapq.heapify(farthest)
        if progress is not None and i & 0xFFFF == 0:
            progress(i)
    return hits


class _LeafCache:
    """State of a prefix cache of single blocks: a tree of resident blocks and a lazy min-heap
    of its unlocked leaves keyed by rank (the smallest rank is evicted first)."""

    def __init__(self, trace: BlockTrace, capacity: int):
        self.capacity = capacity
        self.parent = trace.parents().tolist()
        u = trace.num_unique
        self.resident = [False] * u
        self.children = [0] * u  # resident children
        self.rank = [0] * u  # eviction rank of each block since its latest reference
        self.locked_by = [-1] * u  # request index holding the block
        self.heap: list[tuple[int, int]] = []  # (rank, -block) of leaves
        self.size = 0

    def push_if_leaf(self, b: int) -> None:
        if self.resident[b] and self.children[b] == 0:
            heapq.heappush(self.heap, (self.rank[b], -b))

    def evict(self, num_blocks: int, request: int) -> int:
        """Evict up to num_blocks unlocked leaves, smallest rank first; returns how many."""
        done = 0
        while done < num_blocks and self.heap:
            rank, b = heapq.heappop(self.heap)
            b = -b
            stale = not self.resident[b] or self.children[b] or self.rank[b] != rank
            if stale or self.locked_by[b] == request:
                continue  # a locked block is re-pushed when its request ends
            self.resident[b] = False
            self.size -= 1
            done += 1
            p = self.parent[b]
            if p >= 0:
                self.children[p] -= 1
                if self.locked_by[p] != request:
                    self.push_if_leaf(p)
        return done

    def insert(self, blocks: list[int], start: int) -> None:
        for j in range(start, len(blocks)):
            b = blocks[j]
            self.resident[b] = True
            self.size += 1
            p = self.parent[b]
            if p >= 0:
                self.children[p] += 1


Rank = Callable[[int, int], int]  # (request, position in the flat sequence) -> rank


def _leaf_replay(
    trace: BlockTrace,
    capacity: int,
    rank: Rank,
    progress: Progress | None,
    lookup: Sequence[int] | None = None,
) -> OfflineResult:
    """Every request on a `_LeafCache`: count the leading resident blocks (of the first
    `lookup[r]`, default all), lock the request's blocks and rank them, evict as many as the
    rest need, insert what fits, unlock."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    state = _LeafCache(trace, capacity)
    offsets, all_blocks = trace.offsets.tolist(), trace.blocks.tolist()
    block_hits = 0
    for r in range(trace.num_requests):
        lo, hi = offsets[r], offsets[r + 1]
        blocks = all_blocks[lo:hi]
        hit, m = 0, len(blocks) if lookup is None else lookup[r]
        while hit < m and state.resident[blocks[hit]]:
            hit += 1
        for j, b in enumerate(blocks):
            state.locked_by[b] = r
            state.rank[b] = rank(r, lo + j)
        need = len(blocks) - hit - (capacity - state.size)
        if need > 0:
            state.evict(need, r)
        state.insert(blocks[: hit + min(len(blocks) - hit, capacity - state.size)], hit)
        for b in blocks:  # the path's only possible leaf is its deepest resident block
            state.push_if_leaf(b)
        block_hits += hit
        if progress is not None and r & 0x3FF == 0:
            progress(lo)
    return OfflineResult(block_hits, block_hits * trace.block_tokens)


def offline_leaf_hits(
    trace: BlockTrace, capacity: int, progress: Progress | None = None
) -> OfflineResult:
    """Belady on the leaves of a prefix cache, every block inserted (module docstring)."""
    nxt = next_use(trace.blocks).tolist()
    return _leaf_replay(trace, capacity, lambda r, i: -nxt[i], progress)


def block_lru_hits(
    trace: BlockTrace,
    capacity: int,
    progress: Progress | None = None,
    lookup: Sequence[int] | None = None,
) -> OfflineResult:
    """Block-exact LRU on the leaves of a prefix cache (module docstring); `lookup[r]`
    (default: all) is how many leading blocks request r may hit (it inserts all)."""
    return _leaf_replay(trace, capacity, lambda r, i: r, progress, lookup)
