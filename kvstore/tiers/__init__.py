"""The spill tiers below the device pool: verified reads into the pool (`reader`, a
`TierReader`), and the write policy.

The cache calls one hook per event, with plain keys and block ids (`block_ids[i]` is the
pool block of `keys[i]`, owned or locked by the caller for the duration of the call):
`on_hit` (device hit: selective write-through), `on_promote` (blocks came from a tier: fill
the faster write-through ones), `on_store` (new blocks: write-through) and `on_evict`
(write-back). Which stores each event writes is the tiers' business (`WritePolicies`).

Writes never run on the caller's thread: a queued write holds an independent copy of whole
chunks of blocks (taken from the pool during the hook), so a block id reused after eviction
can never be written under another block's key. A background `TierWriter` encodes and
writes; its queue is bounded in blocks and a write that does not fit is dropped and counted.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np

from kvstore.config import CacheConfig
from kvstore.device.pool import BlockPool
from kvstore.entry import fixed_entry_bytes
from kvstore.fleet.events import TIER_MEDIUM, EventSink
from kvstore.layout import KVLayout
from kvstore.metrics import CacheMetrics
from kvstore.scopes import Scope
from kvstore.stores import SpillStore
from kvstore.tiers.events import TierEvents
from kvstore.tiers.fetch import Allocate, Segment, TierReader
from kvstore.tiers.gate import ReadGate
from kvstore.tiers.policy import WritePolicies
from kvstore.tiers.writer import PendingRetain, PendingWrite, TierWriter

__all__ = [
    "Allocate",
    "PendingRetain",
    "PendingWrite",
    "ReadGate",
    "Segment",
    "TierWriter",
    "Tiers",
    "WritePolicies",
]
log = logging.getLogger("kvstore.tiers")


class Tiers:
    """Spill stores fastest first over one device pool, with their write policies and one
    background writer."""

    def __init__(
        self,
        config: CacheConfig,
        stores: Sequence[SpillStore],
        pool: BlockPool,
        metrics: CacheMetrics,
        write_back_at_commit: bool = False,
        events: EventSink | None = None,
    ):
        """`write_back_at_commit`: write-back stores are written when blocks are committed
        (an attention kind whose blocks lose parts long before they are evicted); `events`
        gets each store's changes as block events of its medium (kvstore/tiers/events.py)."""
        self.config, self.pool, self.metrics = config, pool, metrics
        self.stores = list(stores)
        self.chunk_blocks = config.chunk_blocks
        self.policies = WritePolicies(config, self.stores, write_back_at_commit)
        self.gate = ReadGate(
            _entry_bytes_per_block(pool.layout, config.chunk_blocks, config.entry_codec),
            pool.block_size,
            metrics,
            config.tier_read_gate,
            config.tier_reprobe_s,
        )
        self.reader = TierReader(self.stores, pool.layout, config.chunk_blocks, metrics, self.gate)
        self.events = [_events(s, events, pool.block_size, self.chunk_blocks) for s in stores]
        self.writer = TierWriter(
            self.stores, config.entry_codec, config.write_queue_blocks, metrics, events=self.events
        )
        # stores other processes read (Redis, LMDB): what a hand-over writes (handover.py)
        self.shared = tuple(i for i, s in enumerate(self.stores) if s.identity() is not None)
        _flush_at_exit(self)
        warn_unreachable(self.stores)

    def __bool__(self) -> bool:
        return bool(self.stores)

    # --- write hooks -----------------------------------------------------------------------

    def on_hit(
        self, scope: Scope, keys: list[bytes], token_ids: np.ndarray, block_ids: Sequence[int]
    ) -> None:
        """The device pool hit blocks keys[:len(block_ids)]: selective write-through."""
        targets = self.policies.on_hit
        reached = self.policies.count_hits(keys[: len(block_ids)]) if targets else 0
        if reached:
            self._submit(scope, targets, keys[:reached], token_ids, 0, block_ids[:reached])

    def on_promote(
        self,
        scope: Scope,
        segments: Sequence[Segment],
        keys: list[bytes],
        token_ids: np.ndarray,
        start: int,
        block_ids: Sequence[int],
    ) -> None:
        """Blocks from keys[start] on came from `segments`' tiers: each fills the faster
        write-through tiers that lacked them (an LMDB replica fills from Redis)."""
        for segment in segments:
            stop = start + segment.num_blocks
            targets = self.policies.on_promote(segment.tier)
            self._submit(scope, targets, keys[:stop], token_ids, start, block_ids[:stop])
            start = stop

    def on_store(
        self,
        scope: Scope,
        keys: list[bytes],
        token_ids: np.ndarray,
        start: int,
        block_ids: Sequence[int],
    ) -> None:
        """Blocks keys[start:] were inserted: write-through."""
        self._submit(scope, self.policies.on_store, keys, token_ids, start, block_ids)

    @property
    def writes_evicted(self) -> bool:
        """Whether `on_evict` writes anything (the caller may skip building its arguments)."""
        return bool(self.policies.on_evict)

    def on_evict(
        self,
        scope: Scope,
        keys: list[bytes],
        token_ids: np.ndarray,
        start: int,
        block_ids: Sequence[int],
    ) -> None:
        """Blocks keys[start:] are being evicted (their ancestors are still cached, the
        parents go last): write-back."""
        self._submit(scope, self.policies.on_evict, keys, token_ids, start, block_ids)

    def retain(
        self,
        scope: Scope,
        keys: list[bytes],
        token_ids: np.ndarray,
        block_ids: Sequence[int | None],
        ttl_s: float,
    ) -> int:
        """Keep the entries of the whole chunks of keys at least ttl_s in every store. The
        write-back stores get the device's blocks block_ids (of keys[:len(block_ids)]) now,
        so a retained prefix is in every tier whatever the device keeps. Returns the entries
        asked of each store."""
        held = keys[: len(block_ids)]
        self._submit(scope, self.policies.on_evict, held, token_ids, 0, block_ids)
        n = self.chunk_blocks
        entries = [keys[i] for i in range(n - 1, len(keys), n)]
        if entries:
            self.writer.submit(PendingRetain(entries, ttl_s, time.monotonic()))
        return len(entries)

    def _submit(
        self,
        scope: Scope,
        targets: tuple[int, ...],
        keys: list[bytes],
        token_ids: np.ndarray,
        start: int,
        block_ids: Sequence[int | None],
    ) -> int:
        """Queue the whole chunks of keys that hold blocks keys[start:], for `targets`; the
        chunks are copied out of the pool now. Returns the blocks queued."""
        n = self.chunk_blocks
        first, end = start // n * n, len(keys) // n * n
        if not targets or end <= start:
            return 0
        ids = self.pool.whole(block_ids[first:end])  # None: a hole, or a hybrid model's
        # block without its window part; chunks with one were written before it went
        if None in ids:
            last_hole = first + len(ids) - 1 - ids[::-1].index(None)
            first = (last_hole // n + 1) * n
        if end <= first:
            return 0
        bs, hasher = self.pool.block_size, scope.hasher
        digests = hasher.digest_blocks(token_ids, num_blocks=end)
        last = range(first + n - 1, end, n)  # the last block of each chunk
        queued = self.writer.submit(
            PendingWrite(
                [keys[i] for i in last],
                [digests[i] for i in last],
                keys[first - 1] if first else hasher.root,
                token_ids[first * bs : end * bs],
                self.pool.read_blocks(block_ids[first:end]),
                targets,
                scope,
                keys[first:end] if any(self.events) else (),
            )
        )
        return end - first if queued else 0

    def write_shared(
        self,
        scope: Scope,
        keys: list[bytes],
        token_ids: np.ndarray,
        start: int,
        block_ids: Sequence[int],
    ) -> int:
        """Queue blocks keys[start:] (held as `block_ids`) for every shared store, whatever
        their write policies say (a hand-over); returns the blocks queued from `start` on
        without a gap (0 when a hole cut them: a reader that lacks the blocks before it
        cannot reach those past it)."""
        n = self.chunk_blocks
        whole = len(keys) // n * n - start // n * n
        queued = self._submit(scope, self.shared, keys, token_ids, start, block_ids)
        return queued if queued == whole else 0

    def shared_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading blocks of `keys` that every shared store holds (whole entries; one round
        trip each; a store that fails holds none)."""
        n = self.chunk_blocks
        entries = list(keys[n - 1 :: n])
        counts = [self.stores[i].count_prefix(entries) for i in self.shared]
        return min(counts, default=0) * n

    # --- state -----------------------------------------------------------------------------

    def stats(self) -> dict[str, dict]:
        return {store.name: asdict(store.stats()) for store in self.stores}

    def entry_bytes_per_block(self) -> float:
        """Bytes a block takes in a tier under the codec, its entry's header and checksum
        included: exact, or for lz4/zstd the mean of what was written so far."""
        codec = self.config.entry_codec
        written = self.writer.bytes_per_block() if codec in ("lz4", "zstd") else None
        return written or _entry_bytes_per_block(self.pool.layout, self.chunk_blocks, codec)

    def capacity(self) -> dict[str, dict[str, float]]:
        """Per store, bytes per block and blocks per GB (1e9 bytes); no I/O."""
        size = self.entry_bytes_per_block()
        return {s.name: {"bytes_per_block": size, "blocks_per_gb": 1e9 / size} for s in self.stores}

    def health(self) -> dict[str, dict]:
        """Each store's errors and breaker state, read without I/O."""
        return {store.name: store.health() for store in self.stores}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued writes; False if the timeout ran out first."""
        return self.writer.flush(self.config.flush_timeout_s if timeout is None else timeout)

    def close(self) -> None:
        self.writer.close(self.config.flush_timeout_s)
        for store in self.stores:
            store.close()


def _entry_bytes_per_block(layout: KVLayout, chunk_blocks: int, codec: str) -> float:
    """A block's share of an entry of `chunk_blocks` blocks in `codec`; for lz4/zstd, whose
    size depends on the values, the uncompressed size (a bound)."""
    shape = layout.entry_shape(chunk_blocks)
    exact = fixed_entry_bytes(shape, layout.dtype, codec)
    if exact is None:
        exact = fixed_entry_bytes(shape, layout.dtype, "none")
    return exact / chunk_blocks  # type: ignore[operator]


def _events(
    store: SpillStore, sink: EventSink | None, block_size: int, chunk_blocks: int
) -> TierEvents | None:
    """The store's event reporter, when there is a sink and the store has a medium."""
    if sink is None or store.name not in TIER_MEDIUM:
        return None
    return TierEvents(store, sink, block_size, chunk_blocks)


def warn_unreachable(stores: Sequence[SpillStore]) -> None:
    """A warning for each store that cannot be reached now: the cache still serves, but
    everything it would have read from that tier is recomputed."""
    for store in stores:
        reason = store.probe()
        if reason is not None:
            log.warning(
                "%s tier unreachable at start (%s): lookups miss it and writes to it are "
                "dropped until it answers",
                store.name,
                reason,
            )


def _flush_at_exit(tiers: Tiers) -> None:
    ref = weakref.ref(tiers)

    def flush() -> None:
        live = ref()
        if live is not None:
            live.flush()

    atexit.register(flush)
