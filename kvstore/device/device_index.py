"""The device pool's blocks as the radix index holds them: what lookups, stores and
caller-held blocks (kvstore/device/held.py) share under the cache's one lock.

Insert and relock a path, take and give back a hit's references, allocate with eviction
(tails go last), and what an eviction tells the tenants and the write-back tiers. The
attention kind (kvstore/attention/) decides which parts of a block each reference holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from hashing import BlockHash
from kvstore.attention import AttentionKind
from kvstore.device.pool import BlockPool, PoolExhausted
from kvstore.index import MatchResult, RadixIndex, TreeNode
from kvstore.layout import LayerKV
from kvstore.metrics import CacheMetrics
from kvstore.scopes import Scope, Scopes
from kvstore.tenants import TenantBlocks
from kvstore.tiers import Tiers


class DeviceIndex:
    """The index's blocks in the pool; every method but `first_key` expects the lock held."""

    def __init__(
        self,
        pool: BlockPool,
        index: RadixIndex,
        kind: AttentionKind,
        tenants: TenantBlocks,
        scopes: Scopes,
        tiers: Tiers | None,
        metrics: CacheMetrics,
        release_tails: Callable[[int], int],
    ):
        """`release_tails(n)` frees up to n kept tails (kvstore/device/tails.py), the last
        blocks an allocation takes back."""
        self.lock = threading.RLock()
        self.pool, self.index, self.kind = pool, index, kind
        self.tenants, self.scopes, self.tiers, self.metrics = tenants, scopes, tiers, metrics
        self.block_size = pool.block_size
        # a window cache drops whole tier chunks: write-back tiers get them whole
        self.punch_align = tiers.chunk_blocks if tiers is not None else 1
        self.release_tails = release_tails

    def insert(
        self,
        keys: list[BlockHash],
        tokens: np.ndarray,
        block_ids: Sequence[int],
        start: int,
        cache_salt: str,
        tenant: str,
    ) -> list[int]:
        """Insert blocks keys[start:] (block_ids[start:], held by the caller, who keeps its
        reference: the index takes one more). Returns the ids the index did not keep (the
        keys were cached already: the caller's copy stays private)."""
        new = list(block_ids[start:])
        self.kind.index_take(new)
        self.tenants.track(keys, cache_salt, self.index.root.children)
        new_set, filled = set(new), []
        inserted = self.index.insert(keys, tokens, block_ids, filled, owner=tenant)
        unkept = [b for b in inserted if b in new_set]
        self.kind.index_free(unkept)
        if unkept:
            self.kind.after_insert(keys, tokens, start, new)
        # a new run's blocks count for the inserting tenant; a hole filled, its run's owner
        fills = [(owner, b) for owner, b in filled if b not in new_set]
        self.pool.incref([b for _, b in fills])  # the index's reference; the caller keeps its own
        kept_new = len(new) - len(unkept) - sum(1 for _, b in filled if b in new_set)
        self.tenants.blocks[tenant] += kept_new
        for owner, _ in filled:
            self.tenants.blocks[owner] += 1
        return unkept

    def store(
        self,
        scope: Scope,
        keys: list[BlockHash],
        tokens: np.ndarray,
        layers: Sequence[LayerKV],
        cache_salt: str,
        tenant: str,
    ) -> int:
        """`PrefixCache.store` under the lock: refill the cached path's lost parts, write
        the blocks of `keys` past it into new blocks (as many as the pool and the tenant's
        quota allow), index them and queue them for write-through tiers; how many."""
        match = self.index.match_prefix(keys, tokens)
        self.index.lock(match.last_node)
        try:
            self.kind.refill(match.block_ids, layers)  # parts cached blocks lost
            want = min(len(keys) - match.num_blocks, self.tenants.quota_left(tenant))
            new_ids = self.allocate(max(want, 0))
            if new_ids:
                self._write_new(new_ids, layers, match.num_blocks)
                ids, n = match.block_ids + new_ids, match.num_blocks + len(new_ids)
                self.insert(keys[:n], tokens, ids, match.num_blocks, cache_salt, tenant)
                if self.tiers:  # write-through: an independent copy, taken while owned
                    self.tiers.on_store(scope, keys[:n], tokens, match.num_blocks, ids)
                self.pool.free(new_ids)  # the index holds them now
        finally:
            self.index.unlock(match.last_node)
        return len(new_ids)

    def _write_new(self, new_ids: list[int], layers: Sequence[LayerKV], start: int) -> None:
        """K/V of blocks start.. into new blocks, freed if the pool refuses them (a
        quantized pool's QuantError)."""
        try:
            self.pool.scatter(new_ids, layers, start_token=start * self.block_size)
        except BaseException:
            self.pool.free(new_ids)
            raise

    def take(self, block_ids: Sequence[int | None]) -> list[int]:
        """A hit takes a reference to each of its blocks (the lock keeps them in the index;
        a window cache's punch by another request could still free them); returns the
        blocks whose window parts it holds too."""
        return self.kind.hit_take(block_ids)

    def give_back(self, block_ids: Sequence[int | None], windows: Sequence[int] = ()) -> None:
        """Undo `take` (`windows`: the window parts the hit holds)."""
        self.pool.drop_window(windows)
        self.pool.free([b for b in block_ids if b is not None], window=False)

    def relock(
        self, keys: list[BlockHash], tokens: np.ndarray, node: TreeNode | None
    ) -> MatchResult:
        """Lock the indexed path of keys and unlock `node`; returns the path's match."""
        match = self.index.match_prefix(keys, tokens)
        self.index.lock(match.last_node)
        if node is not None:
            self.index.unlock(node)
        return match

    def allocate(self, n: int, window: bool = True) -> list[int]:
        """Up to n free blocks, evicting unlocked leaves as needed (with `window`, as many as
        the attention kind can give every part they need)."""
        if window:
            n = min(n, self.kind.room(n))
        short = n - self.pool.num_free_blocks
        if short > 0:
            short -= len(self.evict(short))
        if short > 0:  # tails go last: few, each where some conversation's next turn starts
            self.release_tails(short)
        try:
            return self.pool.allocate(n, window)
        except PoolExhausted:
            return self.pool.allocate(min(n, self.pool.num_free_blocks), window)

    def evict(self, n: int) -> list[int]:
        """Evict up to n unlocked blocks and free them."""
        if n <= 0:
            return []
        evicted = self.index.evict(n, self._on_evict)
        self.kind.index_free(evicted)
        self.metrics.inc("evicted_blocks_total", len(evicted))
        return evicted

    def _on_evict(self, node: TreeNode, start: int, block_ids: list[int]) -> None:
        """Eviction callback: the tenant's count, and the write-back tiers (a chunk may need
        blocks of ancestors: they are still cached, parents go last)."""
        cache_salt = self.tenants.salt(self.first_key(node))
        self.tenants.blocks[node.owner] -= len(block_ids)
        if self.tiers and self.tiers.writes_evicted:
            keys = self.index.path_keys(node)
            first = len(keys) - node.num_blocks + start
            self.write_back(node, first, len(keys), cache_salt)

    def write_back(self, node: TreeNode, lo: int, hi: int, cache_salt: str) -> None:
        """Write-back tiers get blocks [lo, hi) of `node`'s path, before they lose a part."""
        keys, ids = self.index.path_keys(node), self.index.path_block_ids(node)
        tokens = self.index.path_token_ids(node)
        self.tiers.on_evict(self.scopes.get(cache_salt), keys[:hi], tokens, lo, ids[:hi])  # type: ignore[union-attr]

    def first_key(self, node: TreeNode) -> BlockHash:
        """The key of the first block of `node`'s path (its tenant and salt's record)."""
        while node.parent is not self.index.root:
            node = node.parent
        return node.key(0)

    def stats(self, num_tails: int, num_reserved: int) -> dict[str, int]:
        """The pool's blocks by state (with `num_tails` kept tails and `num_reserved`
        blocks held back, e.g. an engine's scratch block), and the attention kind's counts.
        Under the cache's lock."""
        return {
            "blocks_total": self.pool.num_blocks,
            "blocks_free": self.pool.num_free_blocks,
            "blocks_cached": self.index.num_cached_blocks,
            "blocks_evictable": self.index.num_evictable_blocks,
            "blocks_tails": num_tails,
            "blocks_reserved": num_reserved,
        } | self.kind.stats()

    def check(
        self,
        tails: Sequence[int],
        reserved: Collection[int],
        held: Mapping[int, int] | None = None,
    ) -> None:
        """Index invariants plus pool accounting (AssertionError naming the first fault):
        free + cached + tails + reserved + held = total; tails and reserved blocks distinct,
        referenced, neither cached nor free; tenant counts those of the runs' owners. With
        `held` (block -> the references callers hold: running tables, lent blocks, hits), every
        block's reference count is exactly its owners'."""
        self.index.check_integrity()
        cached = self.index.all_block_ids()
        free = self.pool.free_block_ids()
        if set(cached) & set(free):
            raise AssertionError("a block is both cached and free")
        if len(set(free)) != len(free) or any(self.pool.ref_cnt[free] != 0):
            raise AssertionError("free list holds a duplicate or a referenced block")
        _check_apart(tails, reserved, cached, free, self.pool.ref_cnt)
        held_elsewhere = int(np.count_nonzero(self.pool.ref_cnt)) - len(cached)
        if len(free) + len(cached) + held_elsewhere != self.pool.num_blocks or held_elsewhere < 0:
            raise AssertionError("free + cached + held != total blocks")
        if held is not None:
            self._check_references(cached, tails, reserved, held)
        self.tenants.check(self.index.held_by_owner(), len(cached))
        self.kind.check(cached)

    def _check_references(
        self,
        cached: Sequence[int],
        tails: Sequence[int],
        reserved: Collection[int],
        held: Mapping[int, int],
    ) -> None:
        owners = np.zeros(self.pool.num_blocks, dtype=np.int64)
        for ids in (cached, tails, list(reserved)):
            np.add.at(owners, np.asarray(ids, dtype=np.int64), 1)
        for block, count in held.items():
            owners[block] += count
        wrong = np.nonzero(owners != self.pool.ref_cnt)[0]
        if len(wrong):
            b = int(wrong[0])
            raise AssertionError(
                f"block {b} has {int(self.pool.ref_cnt[b])} references, its owners "
                f"{int(owners[b])} ({len(wrong)} blocks differ)"
            )


def _check_apart(
    tails: Sequence[int],
    reserved: Collection[int],
    cached: Sequence[int],
    free: Sequence[int],
    ref_cnt: np.ndarray,
) -> None:
    """Tails and reserved blocks: distinct, referenced, neither cached nor free."""
    for name, ids in (("tail", list(tails)), ("reserved", list(reserved))):
        if len(set(ids)) != len(ids):
            raise AssertionError(f"a {name} block is listed twice: {sorted(ids)}")
        if set(ids) & (set(cached) | set(free)) or any(ref_cnt[ids] < 1):
            raise AssertionError(f"a {name} block is cached, free or unreferenced: {sorted(ids)}")
    if set(tails) & set(reserved):
        raise AssertionError("a block is both a tail and reserved")
