"""The blocks a caller holds apart from lookups: an engine's block tables
(kvstore/sequences.py) take a hit's blocks over, allocate their own, commit them to the
index in place, drop them, and (sliding-window and hybrid models) let go of what left the
window. A mixin of `PrefixCache`, which holds the state it works on."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from hashing import BlockHash
from kvstore.hits import CacheHit
from kvstore.index import TreeNode

if TYPE_CHECKING:
    from kvstore.hybrid import IndexWindows
    from kvstore.index import RadixIndex
    from kvstore.metrics import CacheMetrics
    from kvstore.pool import BlockPool
    from kvstore.scopes import Scopes
    from kvstore.tails import TailCache
    from kvstore.tenants import TenantBlocks
    from kvstore.tiers import Tiers


class Commit(NamedTuple):
    """Where a `PrefixCache.commit` left a caller's path."""

    node: TreeNode | None  # the locked last node of the committed path
    num_blocks: int  # leading blocks committed (the path's length)
    kept: int  # new blocks the index kept


class HeldBlocks:
    """`PrefixCache`'s API for blocks its caller holds. The state is the cache's, and so
    are `_insert`, `_relock`, `_allocate`, `_give_back` and `_first_key`."""

    _lock: threading.RLock
    pool: BlockPool
    index: RadixIndex
    windows: IndexWindows | None  # a hybrid model's window parts of cached blocks
    tiers: Tiers | None
    tenants: TenantBlocks
    scopes: Scopes
    metrics: CacheMetrics
    tails: TailCache
    window_blocks: int | None
    punch_align: int

    def hold(self, hit: CacheHit) -> None:
        """The caller takes over the hit's reference to each of its blocks and its lock
        (`hit.node`): the hit counts as released, the caller ends both with
        `drop(hit.node, its block ids)`."""
        with self._lock:
            if hit.released:
                raise ValueError("hold() of a released CacheHit")
            hit.released = True

    def allocate(self, n: int, all_or_none: bool = False, window: bool = True) -> list[int]:
        """Up to n fresh blocks owned by the caller (evicting unlocked cached blocks as
        needed); with `all_or_none`, n blocks or none. On a hybrid model's pool, `window`
        gives each its window part too; without, the caller adds them (`assign_windows`)."""
        with self._lock:
            if all_or_none and self.num_available() < n:
                return []
            ids = self._allocate(n, window)
            if all_or_none and len(ids) < n:
                self.pool.free(ids, window=window)
                return []
            return ids

    def window_room(self, n: int) -> int:
        """Window slots free for a caller, after freeing up to n that only the index holds
        (a hybrid model's pool)."""
        with self._lock:
            return 0 if self.windows is None else self.windows.room(n)

    def assign_windows(self, block_ids: Sequence[int]) -> bool:
        """Give the caller's blocks (allocated without) their window parts, all or none:
        free slots, then slots only the index holds (a hybrid model's pool)."""
        with self._lock:
            if self.windows is None or not block_ids:
                return True
            if self.windows.room(len(block_ids)) < len(block_ids):
                return False
            self.pool.assign_window(block_ids)
            return True

    def num_available(self) -> int:
        """Blocks a caller could get now: free, or cached and unlocked (evictable). (A hybrid
        model's window slots are asked for apart: `assign_windows`.)"""
        with self._lock:
            return self.pool.num_free_blocks + self.index.num_evictable_blocks + len(self.tails)

    def free(self, block_ids: Sequence[int], window: bool = True) -> None:
        """Drop the caller's reference to each block (on a hybrid model's pool, with its
        window part unless not `window`)."""
        with self._lock:
            self.pool.free(block_ids, window=window)

    def drop_window(self, block_ids: Sequence[int]) -> None:
        """The caller keeps each block but lets go of its window part (a hybrid model's
        request whose window slid past them)."""
        with self._lock:
            self.pool.drop_window(block_ids)

    def commit(
        self,
        keys: list[BlockHash],
        token_ids: np.ndarray,
        block_ids: Sequence[int],
        start: int,
        cache_salt: str,
        tenant: str,
        node: TreeNode | None,
    ) -> Commit:
        """Give the index the caller's blocks keys[start:] (written, full; block_ids[i] holds
        keys[i], the leading `start` are the caller's committed path, locked at `node`).
        The caller keeps its references; the lock moves to the new path's last node. Fewer
        blocks are committed when `tenant` is at its quota."""
        with self._lock:
            n = min(len(keys), start + max(self.tenants.quota_left(tenant), 0))
            if n <= start:
                return Commit(node, start, 0)
            unkept = self._insert(keys[:n], token_ids, block_ids[:n], start, cache_salt, tenant)
            match = self._relock(keys[:n], token_ids, node)
            if self.tiers:  # write-through: an independent copy of whole chunks, taken now
                scope = self.scopes.get(cache_salt)
                self.tiers.on_store(scope, keys[:n], token_ids, start, block_ids[:n])
        kept = n - start - len(unkept)
        self.metrics.inc("stored_blocks_total", kept)
        return Commit(match.last_node, n, kept)

    def drop(
        self, node: TreeNode | None, block_ids: Sequence[int], windows: Sequence[int] | None = None
    ) -> None:
        """Unlock `node` (if any) and drop the caller's reference to each block; a hybrid
        model's caller holds the window parts of `windows` only (None: of every block)."""
        with self._lock:
            if node is not None:
                self.index.unlock(node)
            self._give_back(block_ids, block_ids if windows is None else windows)

    def punch(self, node: TreeNode, lo: int, hi: int) -> int:
        """A window cache's running request at `node` slid past blocks [lo, hi) of its path:
        drop the index's copies (`RadixIndex.punch`; write-back tiers get them first).
        Returns the number of blocks freed."""
        if self.window_blocks is None:
            raise ValueError("punch() needs a cache built with a window")
        if self.windows is not None:
            return self._punch_windows(node, lo, hi)
        with self._lock:
            if self.tiers and self.tiers.writes_evicted:
                self._write_back_path(node, lo, hi)
            freed = self.index.punch(node, lo, hi, self.window_blocks, self.punch_align)
            if freed:
                _, tenant = self.tenants.path(self._first_key(node))
                self.tenants.blocks[tenant] -= len(freed)
                self.pool.free(freed)
        self.metrics.inc("windowed_out_blocks_total", len(freed))
        return len(freed)

    def _punch_windows(self, node: TreeNode, lo: int, hi: int) -> int:
        """`punch` for a hybrid model: the index lets go of the window parts only (their
        full parts stay cached; every tier wrote them whole when they were committed)."""
        with self._lock:
            ids = self.index.punchable(node, lo, hi, self.window_blocks, self.punch_align)
            n = len(self.windows.punch(ids))
        self.metrics.inc("windowed_out_blocks_total", n)
        return n

    def _write_back_path(self, node: TreeNode, lo: int, hi: int) -> None:
        """Write-back tiers get blocks [lo, hi) of `node`'s path, before they lose a part."""
        keys, ids = self.index.path_keys(node), self.index.path_block_ids(node)
        tokens = self.index.path_token_ids(node)
        cache_salt, _ = self.tenants.path(self._first_key(node))
        self.tiers.on_evict(self.scopes.get(cache_salt), keys[:hi], tokens, lo, ids[:hi])
