"""The spill tiers below the device pool: verified fetches on lookup, and write policies.

Writes never run on the caller's thread: a queued write holds an independent copy of its
blocks (taken while they are still owned), so a block id reused after eviction can never be
written under another block's key. A background `TierWriter` encodes and writes; its queue is
bounded in blocks and a write that does not fit is dropped and counted.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict
from typing import NamedTuple

import numpy as np
import torch

from hashing import BlockHasher
from kvstore.codec import BlockEntry, EntryError, decode_entry, encode_entry
from kvstore.config import CacheConfig
from kvstore.metrics import CacheMetrics
from kvstore.stores import SpillStore


class PendingWrite(NamedTuple):
    """Consecutive blocks of one prefix, to be written to `targets` (indices into stores)."""

    keys: list[bytes]
    digests: list[bytes]
    parent: bytes  # lookup key of the block before keys[0]
    token_ids: np.ndarray  # [n * block_size] uint32
    kv: torch.Tensor  # [n, layers, 2, kv_heads, block_size, head_dim], an independent copy
    targets: tuple[int, ...]


class Segment(NamedTuple):
    """Verified blocks fetched from one tier, consecutive in the prompt."""

    tier: str
    blocks: list[torch.Tensor]  # each [layers, 2, kv_heads, block_size, head_dim]


class TierWriter:
    """One background thread that encodes queued writes and puts them to their stores."""

    def __init__(
        self,
        stores: Sequence[SpillStore],
        codec: str,
        namespace_root: bytes,
        max_blocks: int,
        metrics: CacheMetrics,
    ):
        self._stores, self._codec, self._root = stores, codec, namespace_root
        self._max_blocks, self._metrics = max_blocks, metrics
        self._queue: deque[PendingWrite] = deque()
        self._pending_blocks = 0  # queued + in flight
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-tier-writer", daemon=True)
        self._thread.start()

    def submit(self, write: PendingWrite) -> bool:
        n = len(write.keys)
        with self._cond:
            if self._closed or self._pending_blocks + n > self._max_blocks:
                self._metrics.inc("dropped_writes_blocks_total", n)
                return False
            self._queue.append(write)
            self._pending_blocks += n
            self._cond.notify_all()
        return True

    def flush(self, timeout: float) -> bool:
        """Wait until every queued write is done; False if `timeout` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending_blocks == 0, timeout)

    def close(self, timeout: float) -> bool:
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                write = self._queue.popleft()
            try:
                self._write(write)
            except Exception:  # a tier must never take the writer down
                self._metrics.inc("dropped_writes_blocks_total", len(write.keys))
            with self._cond:
                self._pending_blocks -= len(write.keys)
                self._cond.notify_all()

    def _write(self, write: PendingWrite) -> None:
        bs = write.token_ids.shape[0] // len(write.keys)
        items, parent = [], write.parent
        for i, (key, digest) in enumerate(zip(write.keys, write.digests, strict=True)):
            tokens = write.token_ids[i * bs : (i + 1) * bs]
            entry = BlockEntry(self._root, key, digest, parent, tokens, write.kv[i])
            items.append((key, encode_entry(entry, self._codec)))
            parent = key
        for target in write.targets:
            written = self._stores[target].put_many(items)
            self._metrics.inc("tier_writes_blocks_total", written, tier=self._stores[target].name)


class Tiers:
    """Spill stores fastest first, with their write policies and one background writer."""

    def __init__(
        self,
        config: CacheConfig,
        hasher: BlockHasher,
        metrics: CacheMetrics,
        stores: Sequence[SpillStore],
    ):
        self.config, self.hasher, self.metrics = config, hasher, metrics
        ns = hasher.namespace
        self.stores = list(stores)
        self._root = ns.root()
        self._shape = (ns.num_layers, 2, ns.num_kv_heads, ns.block_size, ns.head_dim)
        self._dtype = {"float32": torch.float32, "float16": torch.float16}.get(
            ns.kv_dtype, torch.bfloat16
        )
        self._policy = [
            getattr(config, f"{s.name}_write_policy", "write-through") for s in self.stores
        ]
        self._hits: OrderedDict[bytes, int] = OrderedDict()  # selective write-through counts
        self.writer = TierWriter(
            self.stores, config.codec, self._root, config.write_queue_blocks, metrics
        )
        _flush_at_exit(self)

    def __bool__(self) -> bool:
        return bool(self.stores)

    def targets(self, policy: str) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(self._policy) if p == policy)

    # --- reads -----------------------------------------------------------------------------
    def fetch(self, keys: Sequence[bytes], token_ids: np.ndarray, start: int) -> list[Segment]:
        """Verified blocks keys[start:], tier by tier; a tier gets only what faster ones missed."""
        digests: list[bytes] | None = None
        segments, pos = [], start
        for store in self.stores:
            if pos >= len(keys):
                break
            values = store.get_prefix(keys[pos:])
            if not values:
                continue
            if digests is None:
                digests = self.hasher.digest_blocks(token_ids, num_blocks=len(keys))
            blocks = self._verify(store, values, keys, digests, token_ids, pos)
            if blocks:
                segments.append(Segment(store.name, blocks))
                pos += len(blocks)
        return segments

    def _verify(
        self,
        store: SpillStore,
        values: list[bytes],
        keys: Sequence[bytes],
        digests: list[bytes],
        token_ids: np.ndarray,
        pos: int,
    ) -> list[torch.Tensor]:
        bs, blocks = self.hasher.block_size, []
        for i, value in enumerate(values, start=pos):
            try:
                entry = decode_entry(
                    value,
                    namespace=self._root,
                    key=keys[i],
                    digest=digests[i],
                    dtype=self._dtype,
                    token_ids=token_ids[i * bs : (i + 1) * bs],
                    shape=self._shape,
                )
            except EntryError as e:
                store.reject([keys[i]])  # counted, deleted: a miss from here on
                self.metrics.inc("verify_failures_total", tier=store.name, reason=e.reason)
                break
            blocks.append(entry.kv)
        return blocks

    # --- writes ----------------------------------------------------------------------------
    def submit(
        self,
        targets: tuple[int, ...],
        keys: list[bytes],
        token_ids: np.ndarray,
        start: int,
        kv: torch.Tensor,
    ) -> None:
        """Queue blocks keys[start:] (their prefix token_ids covers keys) for `targets`."""
        if not targets or start >= len(keys):
            return
        bs = self.hasher.block_size
        digests = self.hasher.digest_blocks(token_ids, num_blocks=len(keys))
        parent = keys[start - 1] if start else self.hasher.root
        tokens = token_ids[start * bs : len(keys) * bs]
        self.writer.submit(PendingWrite(keys[start:], digests[start:], parent, tokens, kv, targets))

    def count_hits(self, keys: Sequence[bytes]) -> int:
        """Count a device hit on each key; returns how many leading keys just reached the
        selective write-through threshold (those are the ones to write)."""
        threshold, reached = self.config.selective_min_hits, 0
        for i, key in enumerate(keys):
            count = self._hits.pop(key, 0) + 1
            self._hits[key] = count
            if count == threshold:
                reached = i + 1
        while len(self._hits) > 1_000_000:
            self._hits.popitem(last=False)
        return reached

    def stats(self) -> dict[str, dict]:
        return {store.name: asdict(store.stats()) for store in self.stores}

    def close(self) -> None:
        self.writer.close(self.config.flush_timeout_s)
        for store in self.stores:
            store.close()


def _flush_at_exit(tiers: Tiers) -> None:
    ref = weakref.ref(tiers)

    def flush() -> None:
        live = ref()
        if live is not None:
            live.writer.flush(live.config.flush_timeout_s)

    atexit.register(flush)
