"""PrefixCache: the embeddable facade over the radix index, the device block pool and the tiers.

Protocol for a caller (an engine, or another serving stack):
    hit = cache.lookup(token_ids)      # locks the hit's blocks
    kv = cache.load(hit)               # per-layer K/V of kv.num_tokens cached tokens
    ... prefill token_ids[kv.num_tokens:], decode ...
    cache.store(token_ids, layers)     # new full blocks
    cache.release(hit)                 # unlock
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from hashing import BlockHash, Namespace, as_token_array
from kvstore.attention import check_window, make_attention
from kvstore.config import CacheConfig
from kvstore.device.device_index import DeviceIndex
from kvstore.device.held import HeldBlocks
from kvstore.device.hybrid_pool import make_pool
from kvstore.device.promotion import Promoter
from kvstore.device.tails import TailCache, tail_capacity
from kvstore.fleet.events import BlockStored, EventSink
from kvstore.hits import CacheHit, KVPrefix
from kvstore.index import RadixIndex
from kvstore.index.policies import make_policy
from kvstore.index.policies.retaining import RetainingPolicy
from kvstore.layout import LayerKV
from kvstore.metrics import DEVICE_TIER, CacheMetrics
from kvstore.retention import DeviceRetention, PrefixRetention, RetainResult
from kvstore.scopes import Scopes
from kvstore.stores import SpillStore, make_stores
from kvstore.tenants import TenantBlocks
from kvstore.tiers import Tiers
from kvstore.tiers.handover import HandOver, HandOvers
from kvstore.units import cdiv


class PrefixCache:
    """Prefix-caching KV store for one namespace (model, KV format, tenant)."""

    def __init__(
        self,
        config: CacheConfig,
        namespace: Namespace,
        stores: Sequence[SpillStore] | None = None,
        events: EventSink | None = None,
        window: int | None = None,
        window_layers: Sequence[int] | None = None,
        clock: Callable[[], float] | None = None,
    ):
        """`stores` overrides the spill tiers the config names (fastest first); `events` gets
        the device index's block events (kvstore/fleet/events.py) under the cache's lock, and
        the spill tiers' (each of its medium) from the threads that change them.

        `window`: the sliding window (in tokens) of every attention layer of the model, None
        when some layer attends to the whole prefix. A window cache lets a running request
        drop the blocks that slid out of its window (`punch`), and a hit needs only the
        window's blocks before the hit point (docs/ARCHITECTURES.md).

        `window_layers`: with `window`, the layers that attend through it when others attend
        to the whole prefix (a hybrid model). Their K/V go to a window plane of their own
        (`window_share` slots per block), and what slides out of a request's window lets go
        of that part only (kvstore/attention/hybrid.py).

        `clock`: seconds, for retention deadlines (default `time.monotonic`)."""
        check_window(window, window_layers)
        # a hybrid pool's window plane holds at least a request's window, the tier chunk it
        # fills, the block it writes and the engine's scratch and self-test blocks
        wb = None if window is None else cdiv(window, config.block_size)
        min_slots = None if wb is None else max(8, wb + config.chunk_blocks + 2)
        namespace = config.bind(namespace)
        self.config = config
        self.namespace = namespace
        self.block_size = config.block_size
        self.window = window
        self.pool = make_pool(config, namespace, window_layers or (), min_slots)
        policy = make_policy(config.eviction_policy, self.pool.num_blocks)
        policy = RetainingPolicy(policy, clock or time.monotonic)
        self.index = RadixIndex(config.block_size, policy, events)
        self.retention = DeviceRetention(config, self.index, self.pool.num_blocks)
        self.kind = make_attention(self.pool, self.index, window)  # kvstore/attention/
        self.metrics = CacheMetrics()
        if stores is None and config.has_tiers:
            stores = make_stores(config, namespace)
        at_commit, pool = self.kind.writes_back_at_commit, self.pool
        self.tiers = (
            Tiers(config, stores, pool, self.metrics, at_commit, events) if stores else None
        )
        self.scopes = Scopes(config, namespace, with_entries=self.tiers is not None)
        self.hasher = self.scopes.default.hasher
        self.tenants = TenantBlocks(config.tenant_quota_blocks, self.pool.num_blocks)
        self.device_index = DeviceIndex(
            pool=self.pool,
            index=self.index,
            kind=self.kind,
            tenants=self.tenants,
            scopes=self.scopes,
            tiers=self.tiers,
            metrics=self.metrics,
            release_tails=lambda n: self.tails.release(n),  # the tails are made below
        )
        self._lock = self.device_index.lock
        self.promoter = Promoter(self.device_index, self.tiers) if self.tiers else None
        self.handovers = HandOvers(self.tiers, self.index, self._lock)  # (tiers/handover.py)
        self.retaining = PrefixRetention(self.retention, self.tiers, self._lock)
        self.held = HeldBlocks(self.device_index, num_tails=lambda: len(self.tails))
        capacity = tail_capacity(config.tail_blocks, self.pool.num_blocks, self.kind.keeps_tails)
        self.tails = TailCache(  # partial last blocks (tails.py)
            capacity=capacity,
            lock=self._lock,
            rows=self.pool.rows,
            block_size=self.pool.block_size,
            allocate=self.held.allocate,
            free=self.held.free,
            metrics=self.metrics,
        )

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def block_keys(
        self,
        token_ids: Sequence[int] | np.ndarray,
        cache_salt: str = "",
        known: Sequence[BlockHash] = (),
    ) -> list[BlockHash]:
        """Lookup keys of the full blocks of token_ids under `cache_salt`, hashing only the
        blocks past `known` (keys of a shorter prefix). Hash a request once and pass its
        keys to `peek`, `lookup` and `store`."""
        return self.scopes.get(cache_salt).keys(as_token_array(token_ids), known)

    def lookup(
        self,
        token_ids: Sequence[int] | np.ndarray,
        cache_salt: str = "",
        tenant: str = "",
        whole_prompt: bool = False,
        keys: Sequence[BlockHash] = (),
        layered: bool = False,
    ) -> CacheHit:
        """Find and lock the longest cached whole-block prefix of token_ids[:-1] (of all of
        token_ids with `whole_prompt`: the caller then re-runs the last token for its logits).

        Blocks the device pool misses are asked of the spill tiers (fastest first), verified
        and promoted into the pool; `num_cached_tokens` counts only verified blocks. Only
        blocks stored with the same `cache_salt` can match. Blocks promoted from the tiers count
        against `tenant`'s quota (`tenant_quota_blocks`). `keys`: the prompt's keys when
        already hashed (`block_keys`); only blocks past them are hashed. With `layered`, the
        tier blocks may still be loading when it returns (`hit.pending`, full attention
        only): a forward may read them layer by layer (`hit.pending.load.wait(layer)`) but
        uses its output only after `settle(hit)` says they all verified.
        """
        tokens = as_token_array(token_ids)
        usable = len(tokens) if whole_prompt else max(len(tokens) - 1, 0)
        scope = self.scopes.get(cache_salt)
        keys = scope.keys(tokens[: usable // self.block_size * self.block_size], keys)
        with self._lock:
            match = self.index.match_prefix(keys, tokens)
            self.index.lock(match.last_node)
            windows = self.device_index.take(match.block_ids)
        num_device = match.num_blocks * self.block_size
        tier_tokens = {DEVICE_TIER: num_device} if num_device else {}
        hit = CacheHit(len(tokens), num_device, match.block_ids, tier_tokens, match.last_node, keys)
        if self.tiers:
            self.tiers.on_hit(scope, keys, tokens, self.kind.readable(hit.block_ids, windows))
            start = self.kind.promote_from(hit.block_ids, windows)
            if start < len(keys) and layered and self.promoter.can_layer(scope):
                self.promoter.start_layered(scope, hit, tokens, tenant, start)
            elif start < len(keys):
                windows = self.promoter.promote(scope, hit, tokens, tenant, start, windows)
        with self._lock:  # to what the attention kind can use
            self.kind.cut(hit, windows, tokens, self.device_index.relock)
        self.metrics.record_lookup(len(tokens), hit.tier_tokens)
        return hit

    def peek(
        self,
        token_ids: Sequence[int] | np.ndarray,
        cache_salt: str = "",
        keys: Sequence[BlockHash] = (),
    ) -> int:
        """Tokens of the longest whole-block prefix of token_ids in the device pool now. Records
        nothing: no hit, lock, tier lookup or metric (a scheduler's probe). `keys` as in
        `lookup`."""
        tokens = as_token_array(token_ids)
        keys = self.block_keys(tokens, cache_salt, keys)
        with self._lock:
            ids = self.index.peek_prefix(keys, tokens).block_ids
            return self.kind.usable_blocks(ids) * self.block_size

    def settle(self, hit: CacheHit) -> bool:
        """Wait for the hit's layer-by-layer load (`lookup(layered=True)`) and index the blocks
        that verified; the hit is cut to them. False if some did not: K/V computed on the
        hit must then be computed again."""
        pending, hit.pending = hit.pending, None
        if pending is None:
            return True
        done, got = self.promoter.settle(  # type: ignore[union-attr]
            pending, hit.keys, hit.block_ids, hit.node, self.held.commit
        )
        hit.node = done.node
        with self._lock:
            self.pool.free(hit.block_ids[pending.start + got :])  # did not verify
        hit.block_ids = hit.block_ids[: pending.start + got]
        hit.num_cached_tokens = len(hit.block_ids) * self.block_size
        return got == pending.load.num_blocks

    def load(self, hit: CacheHit) -> KVPrefix:
        """Per-layer K/V of the hit, gathered from the device pool into contiguous tensors."""
        if hit.released:
            raise ValueError("load() of a released CacheHit")
        self.settle(hit)
        if not hit.block_ids:
            return KVPrefix(0, [])
        return KVPrefix(hit.num_cached_tokens, self.kind.gather(hit))

    def release(self, hit: CacheHit) -> None:
        """Unlock the hit's blocks. Idempotent."""
        if not hit.released:
            self.settle(hit)
        with self._lock:
            if not hit.released:
                if hit.node is not None:
                    self.index.unlock(hit.node)
                self.device_index.give_back(hit.block_ids, hit.block_ids[hit.window_from :])
            hit.released = True

    def store(
        self,
        token_ids: Sequence[int] | np.ndarray,
        layers: Sequence[LayerKV],
        cache_salt: str = "",
        tenant: str = "",
        keys: Sequence[BlockHash] = (),
    ) -> int:
        """Cache the full blocks of token_ids[:T] not cached yet (T = tokens the K/V cover).

        `keys`: lookup keys of leading blocks already hashed (a lookup's `CacheHit.keys`);
        only the blocks past them are hashed. Returns the number of new blocks. When the
        pool is full of locked blocks, or `tenant` is at its quota, stores a shorter prefix
        (possibly nothing) rather than failing. QuantError (storing nothing) if a quantized
        pool's new blocks hold an inf or a NaN.
        """
        tokens = as_token_array(token_ids)
        num_tokens = min(len(tokens), int(layers[0][0].shape[2])) if layers else 0
        scope = self.scopes.get(cache_salt)
        keys = scope.keys(tokens[:num_tokens], keys)
        with self._lock:
            stored = self.device_index.store(scope, keys, tokens, layers, cache_salt, tenant)
        self.metrics.inc("stored_blocks_total", stored)
        return stored

    def retain(
        self,
        token_ids: Sequence[int] | np.ndarray,
        ttl_s: float,
        cache_salt: str = "",
        tenant: str = "",
        keys: Sequence[BlockHash] = (),
    ) -> RetainResult:
        """Keep the full blocks of token_ids for ttl_s seconds (kvstore/retention.py): those on
        the device within the retention caps, and every spill-tier entry of the prefix. A hit
        or a later retain refreshes it. `keys` as in `lookup`."""
        tokens = as_token_array(token_ids)
        scope = self.scopes.get(cache_salt)
        return self.retaining.retain(scope, scope.keys(tokens, keys), tokens, ttl_s, tenant)

    def release_retention(
        self,
        token_ids: Sequence[int] | np.ndarray,
        cache_salt: str = "",
        keys: Sequence[BlockHash] = (),
    ) -> int:
        """End the device retention of the cached full blocks of token_ids now (the spill
        tiers' entries keep their TTL); returns the blocks released."""
        tokens = as_token_array(token_ids)
        return self.retaining.release(self.scopes.get(cache_salt).keys(tokens, keys), tokens)

    def hand_over(
        self,
        token_ids: Sequence[int] | np.ndarray,
        cache_salt: str = "",
        keys: Sequence[BlockHash] = (),
        timeout_s: float | None = None,
    ) -> HandOver:
        """Make the whole blocks of token_ids readable from every shared tier before
        returning, for a decode replica to load (kvstore/tiers/handover.py); bounded by
        `timeout_s` (default `flush_timeout_s`). `keys` as in `lookup`."""
        tokens = as_token_array(token_ids)
        scope = self.scopes.get(cache_salt)
        timeout_s = self.config.flush_timeout_s if timeout_s is None else timeout_s
        return self.handovers.hand_over(scope, scope.keys(tokens, keys), tokens, timeout_s)

    def snapshot_events(self) -> list[BlockStored]:
        """The device index now, as stored events (for a consumer that starts late)."""
        with self._lock:
            return self.index.snapshot()

    def evict_device(self) -> int:
        """Evict every unlocked block from the device pool (write-back tiers get them), and
        drop the kept tails; returns the number of index blocks evicted."""
        with self._lock:
            self.tails.clear()
            return len(self.device_index.evict(self.index.num_evictable_blocks))

    def load_into(self, hit: CacheHit, dst: torch.Tensor, block_table: Sequence[int]) -> int:
        """Copy the hit's blocks into a caller's paged buffer, block i to dst[block_table[i]].

        `dst` has the pool's block layout [num_dst_blocks, layers, 2, kv_heads, block_size,
        head_dim] and dtype; returns the number of tokens copied.
        """
        if hit.released:
            raise ValueError("load_into() of a released CacheHit")
        if not self.kind.copies_whole(hit):
            raise ValueError("load_into() of a sliding-window hit: copy its blocks with load()")
        self.pool.copy_into(hit.block_ids, dst, block_table)
        return len(hit.block_ids) * self.block_size

    def check_integrity(self, held: Mapping[int, int] | None = None) -> None:
        """Index invariants plus pool accounting (`DeviceIndex.check`), and retention's
        counts; with `held` (block -> references its callers hold: an engine's running
        tables and lent blocks), every block's reference count exactly its owners'."""
        with self._lock:
            self.device_index.check(self.tails.block_ids(), self.held.reserved, held)

    def stats(self) -> dict:
        with self._lock:
            device = self.device_index.stats(len(self.tails), self.held.num_reserved)
            retention = self.retention.stats()
        tiers = self.tiers.stats() if self.tiers else {}
        return {
            "namespace": self.namespace.id,
            "device": device,
            "tiers": tiers,
            "read_gate": self.tiers.gate.snapshot() if self.tiers else None,
            "capacity": self.capacity(),
            "retention": retention,
            **self.metrics.snapshot(),
        }

    def capacity(self) -> dict[str, dict[str, float]]:
        """Per tier (the device pool first), bytes per block and blocks per GB (1e9 bytes);
        a spill tier's under the codec, entry header included. No I/O."""
        size = self.pool.layout.bytes_per_block
        device = {"device": {"bytes_per_block": size, "blocks_per_gb": 1e9 / size}}
        return device | (self.tiers.capacity() if self.tiers else {})

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """The engine computed `num_tokens` prompt tokens in one forward of `seconds`: what
        the read gate weighs a tier read against (kvstore/tiers/gate.py)."""
        if self.tiers:
            self.tiers.gate.observe_prefill(num_tokens, seconds)

    def tier_health(self) -> dict[str, dict]:
        """Each spill tier's errors and breaker state (`SpillStore.health`): no I/O."""
        return self.tiers.health() if self.tiers else {}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued tier writes; False if the timeout ran out first."""
        return self.tiers.flush(timeout) if self.tiers else True

    def close(self) -> None:
        """Flush pending tier writes (bounded by flush_timeout_s) and close the stores."""
        if self.promoter is not None:
            self.promoter.close()
        if self.tiers is not None:
            self.tiers.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
