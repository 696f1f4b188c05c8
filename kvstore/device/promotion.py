"""Promotion: the blocks of a hit the device pool missed, brought from the spill tiers into
fresh pool blocks. Whole (`promote`: verified, copied and indexed before the lookup returns)
or layer by layer (`start_layered`: promised now, copied by the loader while the caller's
forward runs, indexed when the caller settles them, kvstore/tiers/layered.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvstore.attention.base import FullAttention
from kvstore.device.device_index import DeviceIndex
from kvstore.device.held import Commit
from kvstore.hits import CacheHit, PendingLoad
from kvstore.index import TreeNode
from kvstore.metrics import DEVICE_TIER
from kvstore.scopes import Scope
from kvstore.tiers import Allocate, Segment, Tiers
from kvstore.tiers.layered import LayerLoad, LayerLoader


class Promoter:
    """Brings a hit's missing blocks from the tiers, under the cache's lock."""

    def __init__(self, device: DeviceIndex, tiers: Tiers):
        """`device`: the cache's device index (its pool, attention kind, tenants, metrics and
        lock); `tiers`: the spill tiers it promotes from."""
        self.device, self.tiers, self._lock = device, tiers, device.lock
        self.pool, self.kind, self.tenants = device.pool, device.kind, device.tenants
        self.metrics = device.metrics
        # only full attention: a window kind cuts hits by what its window holds, which
        # blocks still loading cannot say yet
        layered = tiers.config.layer_loads and type(self.kind) is FullAttention
        self.loader = LayerLoader(self.pool.layout, self.pool.device) if layered else None

    def can_layer(self, scope: Scope) -> bool:
        """Whether a lookup under `scope` may load layer by layer."""
        return self.loader is not None and scope.expected is not None

    def promote(
        self,
        scope: Scope,
        hit: CacheHit,
        tokens: np.ndarray,
        tenant: str,
        start: int,
        windows: list[int],
    ) -> list[int]:
        """Copy verified tier blocks from block `start` on into fresh pool blocks, index them,
        move the hit's lock (and its `windows`: returns those it holds now)."""
        new_ids: list[int] = []
        num_device = len(hit.block_ids)
        try:
            segments = self._fetch(scope, hit.keys, tokens, tenant, start, new_ids)
            got = sum(segment.num_blocks for segment in segments)
        except BaseException:
            with self._lock:
                self.pool.free(new_ids)
            raise
        with self._lock:
            self.pool.free(new_ids[got:])  # allocated for blocks that did not verify
            ids = hit.block_ids[:start] + new_ids[:got]
            device = self.device
            device.insert(hit.keys[: start + got], tokens, ids, start, scope.cache_salt, tenant)
            self.pool.free(new_ids[:got])  # the index holds them now
            match = device.relock(hit.keys[: max(start + got, num_device)], tokens, hit.node)
            taken = device.take(match.block_ids)
            device.give_back(hit.block_ids, windows)
        hit.node, hit.block_ids = match.last_node, match.block_ids
        hit.num_cached_tokens = match.num_blocks * self.pool.block_size
        promoted = {seg.tier: seg.num_blocks * self.pool.block_size for seg in segments}
        _count(hit, promoted)
        readable = self.kind.readable(hit.block_ids, taken)
        self.tiers.on_promote(scope, segments, hit.keys, tokens, start, readable)
        self.metrics.inc("promoted_blocks_total", got)
        return taken

    def _fetch(
        self,
        scope: Scope,
        keys: list[bytes],
        tokens: np.ndarray,
        tenant: str,
        start: int,
        new_ids: list[int],
    ) -> list[Segment]:
        """Verified tier blocks from block `start` on, in fresh pool blocks (`new_ids`, in
        the order they were read), each tier's moved into the pool as soon as it is read."""
        with self.pool.staged_reads(len(keys) - start) as stage:
            allocate = self._allocator(tenant, new_ids, stage.destinations)
            moved = 0

            def upload(segment: Segment) -> None:
                nonlocal moved  # rows [moved, moved + n) are the segment's blocks
                stage.upload(new_ids[moved : moved + segment.num_blocks], moved)
                moved += segment.num_blocks

            return self.tiers.reader.fetch_into(scope, keys, tokens, start, allocate, upload)

    def start_layered(
        self, scope: Scope, hit: CacheHit, tokens: np.ndarray, tenant: str, start: int
    ) -> None:
        """Promise the tier blocks from block `start` on (fresh pool blocks the hit holds,
        not indexed) and start their layer-by-layer load (`hit.pending`)."""
        new_ids: list[int] = []
        allocate = self._allocator(tenant, new_ids, self.pool.destinations)  # the pool's own
        assert self.loader is not None
        try:
            load = self.tiers.reader.start_layered(
                scope, hit.keys, tokens, start, allocate, self.loader
            )
        except BaseException:
            with self._lock:
                self.pool.free(new_ids)
            raise
        if not load.num_blocks:  # nothing promised: the loader has nothing to do
            self._record(load)
            load.close()
            return
        hit.block_ids = [*hit.block_ids, *new_ids]  # the allocation's references: the hit's
        hit.pending = PendingLoad(load, start, scope.cache_salt, tenant, tokens)
        hit.num_cached_tokens = len(hit.block_ids) * self.pool.block_size
        bs = self.pool.block_size
        promised: dict[str, int] = {}
        for part in load.parts:
            promised[part.store.name] = promised.get(part.store.name, 0) + len(part.dst) * bs
        _count(hit, promised)

    def settle(
        self,
        pending: PendingLoad,
        keys: Sequence[bytes],
        block_ids: Sequence[int | None],
        node: TreeNode | None,
        commit: Callable[..., Commit],
    ) -> tuple[Commit, int]:
        """Wait for a layer-by-layer load to end; give the index its blocks that verified
        (`commit`: `HeldBlocks.commit`, with their tiers) and record the entries that failed.
        `block_ids` (the holder's) and `node` (its locked path) cover blocks [0, start) and
        the promised ones. Returns the commit and how many promised blocks verified."""
        load = pending.load
        got = load.result()
        load.close()  # on the thread that opened its reads
        self._record(load)
        self.metrics.inc("layer_load_seconds_total", load.load_s)
        self.metrics.inc("layer_wait_seconds_total", load.wait_s)
        if got < load.num_blocks:
            self.metrics.inc("layer_load_retries_total")
        if not got:
            return Commit(node, pending.start, 0), 0
        end, bs = pending.start + got, self.pool.block_size
        done = commit(
            keys=list(keys[:end]),
            token_ids=pending.tokens[: end * bs],
            block_ids=block_ids[:end],
            start=pending.start,
            cache_salt=pending.cache_salt,
            tenant=pending.tenant,
            node=node,
            promoted=load.segments(),
        )
        return done, got

    def _record(self, load: LayerLoad) -> None:
        """The entries the load found failing: deleted if damaged, counted (`Rejections`);
        the reads the loader made, told to the read gate."""
        for store, key, error in load.failures:
            self.tiers.reader.rejections.record(store, [(key, error)])
        for part in load.parts:
            blocks = self.tiers.reader.chunk_blocks * len(part.values or ())
            self.tiers.gate.observe_read(part.store.name, blocks, part.read_s)

    def _allocator(
        self,
        tenant: str,
        new_ids: list[int],
        destinations: Callable[[Sequence[int]], list[torch.Tensor | memoryview]],
    ) -> Allocate:
        """`allocate(n)` for the reader: up to n fresh blocks of the tenant's quota (their
        ids appended to `new_ids`), and where their reads land (`destinations(ids)`)."""

        def allocate(n: int) -> list[torch.Tensor | memoryview]:
            with self._lock:
                n = min(n, self.tenants.quota_left(tenant) - len(new_ids))
                ids = self.device.allocate(n) if n > 0 else []
            if not ids:
                return []
            new_ids.extend(ids)
            return destinations(ids)

        return allocate

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()


def _count(hit: CacheHit, promoted: dict[str, int]) -> None:
    """The hit's tokens by tier: the device's, then those `promoted` from each tier."""
    device = hit.num_cached_tokens - sum(promoted.values())
    hit.tier_tokens = ({DEVICE_TIER: device} if device > 0 else {}) | promoted
