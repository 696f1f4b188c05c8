"""PrefixCache: the embeddable facade over the radix index, the device block pool and the tiers.

Protocol for a caller (an engine, or another serving stack):
    hit = cache.lookup(token_ids)      # locks the hit's blocks
    kv = cache.load(hit)               # per-layer K/V of kv.num_tokens cached tokens
    ... prefill token_ids[kv.num_tokens:], decode ...
    cache.store(token_ids, layers)     # new full blocks
    cache.release(hit)                 # unlock
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from hashing import BlockHash, BlockHasher, Namespace, as_token_array, combine_salts
from kvstore.config import CacheConfig
from kvstore.index import RadixIndex, TreeNode
from kvstore.metrics import CacheMetrics
from kvstore.policy import make_policy
from kvstore.pool import BlockPool, LayerKV, PoolExhausted
from kvstore.stores import SpillStore, make_stores
from kvstore.tiers import Tiers
from kvstore.writer import Scope

MAX_SALTS = 4096  # request salts whose hashers are kept


class KVPrefix(NamedTuple):
    num_tokens: int
    layers: list[LayerKV]  # per layer (K, V): [1, kv_heads, num_tokens, head_dim]


@dataclass
class CacheHit:
    """A locked cached prefix of a prompt. Release it with `PrefixCache.release`."""

    num_prompt_tokens: int
    num_cached_tokens: int
    block_ids: list[int]
    tier_tokens: dict[str, int] = field(default_factory=dict)  # cached tokens by source tier
    node: TreeNode | None = None
    keys: list[BlockHash] = field(default_factory=list)  # lookup keys of the prompt's blocks
    released: bool = False


class PrefixCache:
    """Prefix-caching KV store for one namespace (model, KV format, tenant)."""

    def __init__(
        self,
        config: CacheConfig,
        namespace: Namespace,
        stores: Sequence[SpillStore] | None = None,
    ):
        """`stores` overrides the spill tiers the config names (fastest first)."""
        namespace = config.bind(namespace)
        self.config = config
        self.namespace = namespace
        self.block_size = config.block_size
        self.hasher = BlockHasher(namespace, config.secret_bytes, config.key_bytes)
        self.pool = BlockPool.from_config(config, namespace)
        self.index = RadixIndex(
            config.block_size, make_policy(config.eviction_policy, self.pool.num_blocks)
        )
        self.metrics = CacheMetrics()
        if stores is None and config.has_tiers:
            stores = make_stores(config, namespace)
        self.tiers = Tiers(config, self.hasher, self.metrics, stores) if stores else None
        self._hashers: OrderedDict[str, BlockHasher] = OrderedDict()  # by request salt
        # first block key -> (request salt, owner): a path's salt (write-back) and owner (quota)
        self._path_of: dict[BlockHash, tuple[str, str]] = {}
        self._owner_blocks: Counter[str] = Counter()  # device blocks per owner
        self._lock = threading.RLock()

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def hasher_for(self, salt: str = "") -> BlockHasher:
        """The hasher of requests with cache salt `salt` (narrowing the config's tenant salt)."""
        if not salt:
            return self.hasher
        with self._lock:
            hasher = self._hashers.pop(salt, None)
            if hasher is None:
                ns = self.namespace.with_salt(combine_salts(self.namespace.tenant_salt, salt))
                hasher = BlockHasher(ns, self.config.secret_bytes, self.config.key_bytes)
            self._hashers[salt] = hasher
            if len(self._hashers) > MAX_SALTS:
                self._hashers.popitem(last=False)
            return hasher

    def lookup(
        self,
        token_ids: Sequence[int] | np.ndarray,
        salt: str = "",
        owner: str = "",
        whole_prompt: bool = False,
    ) -> CacheHit:
        """Find and lock the longest cached whole-block prefix of token_ids[:-1] (of all of
        token_ids with `whole_prompt`: the caller then re-runs the last token for its logits).

        Blocks the device pool misses are asked of the spill tiers (fastest first), verified
        and promoted into the pool; `num_cached_tokens` counts only verified blocks. Only
        blocks stored with the same `salt` can match. Blocks promoted from the tiers count
        against `owner`'s quota (`tenant_quota_blocks`).
        """
        tokens = as_token_array(token_ids)
        usable = len(tokens) if whole_prompt else max(len(tokens) - 1, 0)
        max_blocks = usable // self.block_size
        hasher = self.hasher_for(salt)
        keys = hasher.hash_blocks(tokens[: max_blocks * self.block_size])
        with self._lock:
            match = self.index.match_prefix(keys, tokens)
            self.index.lock(match.last_node)
        num_device = match.num_blocks * self.block_size
        hit = CacheHit(
            len(tokens),
            num_device,
            match.block_ids,
            {"device": num_device} if num_device else {},
            match.last_node,
            keys,
        )
        if self.tiers:
            scope = self.tiers.scope(hasher)
            self._write_selective(scope, keys, tokens, hit)
            if match.num_blocks < len(keys):
                self._promote(scope, hit, keys, tokens, salt, owner)
        self.metrics.record_lookup(len(tokens), hit.tier_tokens)
        return hit

    def _promote(
        self,
        scope: Scope,
        hit: CacheHit,
        keys: list[BlockHash],
        tokens: np.ndarray,
        salt: str,
        owner: str,
    ) -> None:
        """Copy verified tier blocks into fresh pool blocks, index them, move the hit's lock."""
        new_ids: list[int] = []

        def allocate(n: int) -> list[torch.Tensor | memoryview]:
            with self._lock:
                n = min(n, self._quota_left(owner) - len(new_ids))
                ids = self._allocate(n) if n > 0 else []
            new_ids.extend(ids)
            return self.pool.destinations(ids)

        start = len(hit.block_ids)
        try:
            segments = self.tiers.fetch_into(scope, keys, tokens, start, allocate)
        except BaseException:
            with self._lock:
                self.pool.free(new_ids)
            raise
        got = sum(segment.num_blocks for segment in segments)
        with self._lock:
            self.pool.free(new_ids[got:])  # allocated for blocks that did not verify
            n = start + got
            self._track(keys, salt, owner)
            unkept = self.index.insert(keys[:n], tokens, hit.block_ids + new_ids[:got])
            self.pool.free(unkept)
            self._owner_blocks[owner] += got - len(unkept)
            match = self.index.match_prefix(keys[:n], tokens)
            self.index.lock(match.last_node)
            self.index.unlock(hit.node)
        hit.node, hit.block_ids = match.last_node, match.block_ids
        hit.num_cached_tokens = match.num_blocks * self.block_size
        for segment in segments:
            hit.tier_tokens[segment.tier] = segment.num_blocks * self.block_size
            stop = start + segment.num_blocks
            self._fill_faster(scope, segment.tier, keys[:stop], tokens, start, hit.block_ids)
            start = stop
        self.metrics.inc("promoted_blocks_total", got)

    def _fill_faster(
        self,
        scope: Scope,
        tier: str,
        keys: list[BlockHash],
        tokens: np.ndarray,
        start: int,
        block_ids: list[int],
    ) -> None:
        """Blocks that hit in `tier` are written to the faster write-through tiers that lacked
        them (an LMDB replica fills from Redis). The hit is locked: its ids are stable."""
        targets = self.tiers.faster_write_through(tier)
        if targets:
            self.tiers.submit_from_pool(scope, targets, keys, tokens, start, block_ids, self.pool)

    def _write_selective(
        self, scope: Scope, keys: list[BlockHash], tokens: np.ndarray, hit: CacheHit
    ) -> None:
        """Selective write-through: write device blocks once they have been hit N times."""
        targets = self.tiers.targets("selective")
        reached = self.tiers.count_hits(keys[: len(hit.block_ids)]) if targets else 0
        if reached:
            ids = hit.block_ids[:reached]  # hit is locked: ids are stable
            self.tiers.submit_from_pool(scope, targets, keys[:reached], tokens, 0, ids, self.pool)

    def load(self, hit: CacheHit) -> KVPrefix:
        """Per-layer K/V of the hit, gathered from the device pool into contiguous tensors."""
        if hit.released:
            raise ValueError("load() of a released CacheHit")
        if not hit.block_ids:
            return KVPrefix(0, [])
        return KVPrefix(hit.num_cached_tokens, self.pool.gather(hit.block_ids))

    def release(self, hit: CacheHit) -> None:
        """Unlock the hit's blocks. Idempotent."""
        with self._lock:
            if not hit.released and hit.node is not None:
                self.index.unlock(hit.node)
            hit.released = True

    def store(
        self,
        token_ids: Sequence[int] | np.ndarray,
        layers: Sequence[LayerKV],
        salt: str = "",
        owner: str = "",
    ) -> int:
        """Cache the full blocks of token_ids[:T] not cached yet (T = tokens the K/V cover).

        Returns the number of new blocks. When the pool is full of locked blocks, or `owner`
        is at its quota, stores a shorter prefix (possibly nothing) rather than failing.
        """
        tokens = as_token_array(token_ids)
        num_tokens = min(len(tokens), int(layers[0][0].shape[2])) if layers else 0
        hasher = self.hasher_for(salt)
        keys = hasher.hash_blocks(tokens[:num_tokens])
        with self._lock:
            self._track(keys, salt, owner)
            match = self.index.match_prefix(keys, tokens)
            self.index.lock(match.last_node)
            try:
                want = min(len(keys) - match.num_blocks, self._quota_left(owner))
                new_ids = self._allocate(max(want, 0))
                if new_ids:
                    self.pool.scatter(
                        new_ids, layers, start_token=match.num_blocks * self.block_size
                    )
                    n = match.num_blocks + len(new_ids)
                    redundant = self.index.insert(keys[:n], tokens, match.block_ids + new_ids)
                    self.pool.free(redundant)
                    self._owner_blocks[owner] += len(new_ids) - len(redundant)
                    if self.tiers:  # write-through: an independent copy, taken while owned
                        targets = self.tiers.targets("write-through")
                        ids = match.block_ids + new_ids
                        scope = self.tiers.scope(hasher)
                        self.tiers.submit_from_pool(
                            scope, targets, keys[:n], tokens, match.num_blocks, ids, self.pool
                        )
            finally:
                self.index.unlock(match.last_node)
        self.metrics.inc("stored_blocks_total", len(new_ids))
        return len(new_ids)

    def _allocate(self, n: int) -> list[int]:
        """Up to n free blocks, evicting unlocked leaves as needed (caller holds the lock)."""
        short = n - self.pool.num_free_blocks
        if short > 0:
            self._evict(short)
        try:
            return self.pool.allocate(n)
        except PoolExhausted:
            return self.pool.allocate(self.pool.num_free_blocks)

    def _evict(self, n: int) -> list[int]:
        """Evict up to n unlocked blocks and free them (caller holds the lock)."""
        if n > 0:
            evicted = self.index.evict(n, self._on_evict)
            self.pool.free(evicted)
            self.metrics.inc("evicted_blocks_total", len(evicted))
            return evicted
        return []

    def _on_evict(self, node: TreeNode, start: int, block_ids: list[int]) -> None:
        """Eviction callback: the owner's count, and the write-back tiers."""
        salt, owner = self._path_of.get(self._first_key(node), ("", ""))
        self._owner_blocks[owner] -= len(block_ids)
        if self.tiers and self.tiers.targets("write-back"):
            self._write_back(node, start, salt)

    def _first_key(self, node: TreeNode) -> BlockHash:
        while node.parent is not self.index.root:
            node = node.parent
        return node.key(0)

    def _quota_left(self, owner: str) -> int:
        quota = self.config.tenant_quota_blocks
        return self.pool.num_blocks if quota is None else quota - self._owner_blocks[owner]

    def _write_back(self, node: TreeNode, start: int, salt: str) -> None:
        """Queue blocks [start:] of `node` for the write-back tiers (a chunk may need blocks
        of ancestors: they are still cached, parents go last)."""
        keys = self.index.path_keys(node)
        tokens = self.index.path_token_ids(node)
        first = len(keys) - node.num_blocks + start
        ids = self.index.path_block_ids(node)
        scope = self.tiers.scope(self.hasher_for(salt))
        self.tiers.submit_from_pool(
            scope, self.tiers.targets("write-back"), keys, tokens, first, ids, self.pool
        )

    def _track(self, keys: list[BlockHash], salt: str, owner: str) -> None:
        """Remember a path's salt and owner by its first key (caller holds the lock)."""
        if not keys or not (salt or owner):
            return
        self._path_of[keys[0]] = (salt, owner)
        if len(self._path_of) > 2 * len(self.index.root.children) + 1024:
            live = self.index.root.children
            self._path_of = {k: v for k, v in self._path_of.items() if k in live}

    def evict_device(self) -> int:
        """Evict every unlocked block from the device pool (write-back tiers get them)."""
        with self._lock:
            return len(self._evict(self.index.num_evictable_blocks))

    def load_into(self, hit: CacheHit, dst: torch.Tensor, block_table: Sequence[int]) -> int:
        """Copy the hit's blocks into a caller's paged buffer, block i to dst[block_table[i]].

        `dst` has the pool's block layout [num_dst_blocks, layers, 2, kv_heads, block_size,
        head_dim] and dtype; returns the number of tokens copied.
        """
        if hit.released:
            raise ValueError("load_into() of a released CacheHit")
        n = len(hit.block_ids)
        if len(block_table) < n:
            raise ValueError(f"block_table has {len(block_table)} entries, the hit needs {n}")
        if dst.shape[1:] != self.pool.kv.shape[1:] or dst.dtype != self.pool.dtype:
            raise ValueError(
                f"dst must be [N, {', '.join(map(str, self.pool.kv.shape[1:]))}] {self.pool.dtype}"
            )
        table = torch.as_tensor(list(block_table[:n]), dtype=torch.long, device=dst.device)
        dst.index_copy_(0, table, self.pool.read_blocks(hit.block_ids).to(dst.device))
        return n * self.block_size

    def check_integrity(self) -> None:
        """Index invariants plus pool accounting: free + cached + held = total."""
        with self._lock:
            self.index.check_integrity()
            cached = self.index.all_block_ids()
            free = self.pool.free_block_ids()
            if set(cached) & set(free):
                raise AssertionError("a block is both cached and free")
            if len(set(free)) != len(free) or any(self.pool.ref_cnt[free] != 0):
                raise AssertionError("free list holds a duplicate or a referenced block")
            held = int(np.count_nonzero(self.pool.ref_cnt)) - len(cached)
            if len(free) + len(cached) + held != self.pool.num_blocks or held < 0:
                raise AssertionError("free + cached + held != total blocks")

    def stats(self) -> dict:
        with self._lock:
            device = {
                "blocks_total": self.pool.num_blocks,
                "blocks_free": self.pool.num_free_blocks,
                "blocks_cached": self.index.num_cached_blocks,
                "blocks_evictable": self.index.num_evictable_blocks,
            }
        tiers = self.tiers.stats() if self.tiers else {}
        return {
            "namespace": self.namespace.id,
            "device": device,
            "tiers": tiers,
            **self.metrics.snapshot(),
        }

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued tier writes; False if the timeout ran out first."""
        if not self.tiers:
            return True
        return self.tiers.writer.flush(self.config.flush_timeout_s if timeout is None else timeout)

    def close(self) -> None:
        """Flush pending tier writes (bounded by flush_timeout_s) and close the stores."""
        if self.tiers is not None:
            self.tiers.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def block_keys(cache: PrefixCache, token_ids: Sequence[int] | np.ndarray) -> list[BlockHash]:
    """Lookup keys of every full block of token_ids (for diagnostics and tests)."""
    return cache.hasher.hash_blocks(as_token_array(token_ids))
