"""The blocks a caller holds apart from lookups: an engine's block tables
(kvstore/block_tables.py) take a hit's blocks over, allocate their own, commit them to the
index in place, drop them, and (sliding-window and hybrid models) let go of what left the
window. `PrefixCache.held` is one, over the cache's `DeviceIndex`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from hashing import BlockHash
from kvstore.device.device_index import DeviceIndex
from kvstore.hits import CacheHit
from kvstore.index import TreeNode
from kvstore.tiers.layered import Segment


class Commit(NamedTuple):
    """Where a `HeldBlocks.commit` left a caller's path."""

    node: TreeNode | None  # the locked last node of the committed path
    num_blocks: int  # leading blocks committed (the path's length)
    kept: int  # new blocks the index kept


class HeldBlocks:
    """The API for blocks a caller holds, over the cache's device index and its lock."""

    def __init__(self, device: DeviceIndex, num_tails: Callable[[], int]):
        self.device = device
        self._lock = device.lock
        self.pool, self.index, self.kind = device.pool, device.index, device.kind
        self._num_tails = num_tails
        self.reserved: set[int] = set()  # blocks held outside any table and the index

    @property
    def num_reserved(self) -> int:
        return len(self.reserved)

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
            ids = self.device.allocate(n, window)
            if all_or_none and len(ids) < n:
                self.pool.free(ids, window=window)
                return []
            return ids

    def reserve(self, n: int) -> list[int]:
        """Up to n fresh blocks the caller holds for good, outside any request (an engine's
        scratch block): they count as `reserved` in `PrefixCache.stats` until `unreserve`."""
        with self._lock:
            ids = self.allocate(n)
            self.reserved.update(ids)
            return ids

    def unreserve(self, block_ids: Sequence[int]) -> None:
        """Give back blocks taken with `reserve` (ValueError for any other block: its owner
        gives it back its own way)."""
        with self._lock:
            stray = set(block_ids) - self.reserved
            if stray:
                raise ValueError(f"blocks {sorted(stray)} were not reserved")
            self.reserved.difference_update(block_ids)
            self.pool.free(block_ids)

    def window_room(self, n: int) -> int:
        """Window slots free for a caller, after freeing up to n that only the index holds
        (a hybrid model's pool; 0 for another)."""
        with self._lock:
            return self.kind.window_room(n)

    def assign_windows(self, block_ids: Sequence[int]) -> bool:
        """Give the caller's blocks (allocated without) their window parts, all or none:
        free slots, then slots only the index holds (a hybrid model's pool)."""
        with self._lock:
            return self.kind.assign_windows(block_ids)

    def num_available(self) -> int:
        """Blocks a caller could get now: free, or cached and unlocked (evictable). (A hybrid
        model's window slots are asked for apart: `assign_windows`.)"""
        with self._lock:
            return self.pool.num_free_blocks + self.index.num_evictable_blocks + self._num_tails()

    def share(self, block_ids: Sequence[int]) -> None:
        """The caller takes one more reference to blocks it holds (it lends them; `free`
        gives it back)."""
        with self._lock:
            self.pool.incref(block_ids)

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
        promoted: Sequence[Segment] = (),
    ) -> Commit:
        """Give the index the caller's blocks keys[start:] (written, full; block_ids[i] holds
        keys[i], the leading `start` are the caller's committed path, locked at `node`).
        The caller keeps its references; the lock moves to the new path's last node. Fewer
        blocks are committed when `tenant` is at its quota. `promoted`: the blocks came from
        these tiers (a layer-by-layer load that verified), not from a forward."""
        with self._lock:
            n = min(len(keys), start + max(self.device.tenants.quota_left(tenant), 0))
            if n <= start:
                return Commit(node, start, 0)
            unkept = self.device.insert(
                keys[:n], token_ids, block_ids[:n], start, cache_salt, tenant
            )
            match = self.device.relock(keys[:n], token_ids, node)
            tiers = self.device.tiers
            if tiers:  # write-through: an independent copy of whole chunks, taken now
                scope, ids = self.device.scopes.get(cache_salt), block_ids[:n]
                if promoted:
                    segments = _clip(promoted, n - start)  # a tenant's quota may cut them
                    tiers.on_promote(scope, segments, keys[:n], token_ids, start, ids)
                else:
                    tiers.on_store(scope, keys[:n], token_ids, start, ids)
        kept = n - start - len(unkept)
        metric = "promoted_blocks_total" if promoted else "stored_blocks_total"
        self.device.metrics.inc(metric, n - start if promoted else kept)
        return Commit(match.last_node, n, kept)

    def drop(
        self, node: TreeNode | None, block_ids: Sequence[int], windows: Sequence[int] | None = None
    ) -> None:
        """Unlock `node` (if any) and drop the caller's reference to each block; a hybrid
        model's caller holds the window parts of `windows` only (None: of every block)."""
        with self._lock:
            if node is not None:
                self.index.unlock(node)
            self.device.give_back(block_ids, block_ids if windows is None else windows)

    def punch(self, node: TreeNode, lo: int, hi: int) -> int:
        """A window cache's running request at `node` slid past blocks [lo, hi) of its path:
        the index lets go of what no hit needs there (`AttentionKind.punch`; write-back tiers
        get whole blocks first). Returns the number of blocks (or window parts) let go of."""
        with self._lock:
            n = self.kind.punch(
                node, lo, hi, self.device.punch_align, self._write_back, self._forget
            )
        self.device.metrics.inc("windowed_out_blocks_total", n)
        return n

    def _write_back(self, node: TreeNode, lo: int, hi: int) -> None:
        """Write-back tiers get blocks [lo, hi) of `node`'s path, before the index drops them."""
        if self.device.tiers and self.device.tiers.writes_evicted:
            cache_salt = self.device.tenants.salt(self.device.first_key(node))
            self.device.write_back(node, lo, hi, cache_salt)

    def _forget(self, owners: list[str], block_ids: list[int]) -> None:
        """The index dropped blocks: each owner's count, and the index's references."""
        for owner in owners:
            self.device.tenants.blocks[owner] -= 1
        self.pool.free(block_ids)


def _clip(segments: Sequence[Segment], num_blocks: int) -> list[Segment]:
    """The leading `num_blocks` blocks of consecutive segments."""
    out = []
    for segment in segments:
        take = min(segment.num_blocks, num_blocks)
        if take > 0:
            out.append(segment._replace(num_blocks=take))
        num_blocks -= take
    return out
