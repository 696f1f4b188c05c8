"""TierWriter: the background thread that encodes queued writes and puts them to the stores.

A queued write (`PendingWrite`) holds an independent copy of its blocks, taken while they
were still owned, so a block id reused after eviction can never be written under another
block's key. The queue is bounded in blocks; a write that does not fit is dropped and
counted. Stores that copy what they get are fed from one reused encode buffer (the arena);
the others get new bytes per entry.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch

from kvstore.entry import BlockEntry, EntryError, encode_entry, max_entry_bytes, payload_bytes
from kvstore.layout import blocks_to_entries, token_bytes
from kvstore.metrics import CacheMetrics
from kvstore.scopes import Scope
from kvstore.stores import SpillStore

ARENA_BYTES = 32 * 2**20  # bound of the writer's reused encode buffer

Encoder = Callable[[int, "memoryview | None"], "bytes | memoryview"]


class PendingWrite(NamedTuple):
    """Consecutive entries of one prefix, to be written to `targets` (indices into stores).

    Entry i holds blocks [i*N, (i+1)*N) of `kv`, N = num_blocks / len(keys); keys[i] and
    digests[i] are those of its last block.
    """

    keys: list[bytes]
    digests: list[bytes]
    parent: bytes  # lookup key of the block before the first entry
    token_ids: np.ndarray  # [num_blocks * block_size] uint32
    kv: torch.Tensor  # [num_blocks, layers, 2, kv_heads, block_size, head_dim], independent copy
    targets: tuple[int, ...]
    scope: Scope  # the namespace the entries belong to
    block_keys: Sequence[bytes] = ()  # every block's lookup key (for the tiers' events)

    @property
    def num_blocks(self) -> int:
        return int(self.kv.shape[0])


class Watcher(Protocol):
    """A store's event reporter (kvstore/tiers/events.py), told which write is put."""

    def writing(self, write: PendingWrite | None) -> None: ...


class PendingRetain(NamedTuple):
    """Keep entries `keys` in every store at least `ttl_s` from `asked_at` (monotonic): queued
    behind the writes of the same entries, so a write-through entry exists when it runs."""

    keys: list[bytes]
    ttl_s: float
    asked_at: float
    num_blocks: int = 0  # takes no room in the queue's block bound


class PendingMark(NamedTuple):
    """Set `done` when the writer reaches it: every write queued before it has finished."""

    done: threading.Event
    num_blocks: int = 0  # takes no room in the queue's block bound


class TierWriter:
    """One background thread that encodes queued writes and puts them to their stores."""

    def __init__(
        self,
        stores: Sequence[SpillStore],
        codec: str,
        max_blocks: int,
        metrics: CacheMetrics,
        arena_bytes: int = ARENA_BYTES,
        events: Sequence[Watcher | None] = (),
    ):
        """`arena_bytes`: bound of the encode buffer it reuses for stores that copy values;
        `events`: per store, what reports its changes as events (told which write it puts)."""
        self._stores, self._codec, self._arena_bytes = stores, codec, arena_bytes
        self._events = list(events) or [None] * len(stores)
        self._max_blocks, self._metrics = max_blocks, metrics
        self._queue: deque[PendingWrite | PendingRetain | PendingMark] = deque()
        self._pending_blocks = 0  # queued + in flight
        self._pending_jobs = 0  # writes and retains, queued + in flight
        self._cond = threading.Condition()
        self._closed = False
        self._arena, self._arena_lock = bytearray(), threading.Lock()
        self._encoded = [0, 0]  # bytes and blocks of the entries encoded so far
        self._thread = threading.Thread(target=self._run, name="kvstore-tier-writer", daemon=True)
        self._thread.start()

    def submit(self, write: PendingWrite | PendingRetain | PendingMark) -> bool:
        n = write.num_blocks
        with self._cond:
            if self._closed or self._pending_blocks + n > self._max_blocks:
                self._metrics.inc("dropped_writes_blocks_total", n)
                return False
            self._queue.append(write)
            self._pending_blocks += n
            self._pending_jobs += 1
            self._cond.notify_all()
        return True

    def flush(self, timeout: float) -> bool:
        """Wait until every queued write is done; False if `timeout` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending_jobs == 0, timeout)

    def barrier(self, timeout: float) -> bool:
        """Wait until every write queued before this call has finished (later ones may still
        run: unlike `flush`, a busy writer cannot hold it up); False if `timeout` ran out
        first or the writer is closed."""
        mark = PendingMark(threading.Event())
        return self.submit(mark) and mark.done.wait(timeout)

    def close(self, timeout: float) -> bool:
        """Flush (bounded by `timeout`), then stop the thread; no thread outlives its cache."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if done:
            self._thread.join(timeout)
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                write = self._queue.popleft()
            try:
                if isinstance(write, PendingMark):
                    write.done.set()
                elif isinstance(write, PendingRetain):
                    self.retain(write)
                else:
                    self.write(write)
            except Exception:  # a tier must never take the writer down
                self._metrics.inc("dropped_writes_blocks_total", write.num_blocks)
            with self._cond:
                self._pending_blocks -= write.num_blocks
                self._pending_jobs -= 1
                self._cond.notify_all()

    def retain(self, job: PendingRetain) -> None:
        """Give every store's entries `job.keys` what is left of the job's TTL."""
        left = job.ttl_s - (time.monotonic() - job.asked_at)
        if left > 0:
            for store in self._stores:
                retained = store.retain(job.keys, left)
                self._metrics.inc("tier_retained_entries_total", retained, tier=store.name)

    def write(self, write: PendingWrite) -> None:
        """Encode `write` and put it to its targets now, on this thread (what the background
        thread does with each queued write)."""
        write = self._storable(write)
        if not write.keys:
            return
        if not all(self._stores[t].copies_values for t in write.targets):
            values = self._encode_all(write)  # the leading entries that encode
            self._put(write, list(zip(write.keys, values, strict=False)))
            return
        (encode, bound), n = self._encoder(write), len(write.keys)
        step = max(1, self._arena_bytes // bound)
        with self._arena_lock:  # these stores copy values: encode into a reused buffer
            for start in range(0, n, step):
                stop = min(n, start + step)
                if len(self._arena) < (stop - start) * bound:
                    self._arena = bytearray((stop - start) * bound)  # replaced, never resized
                arena, items, offset = memoryview(self._arena), [], 0
                for i in range(start, stop):
                    value = self._encode_one(write, encode, i, arena[offset:])
                    if value is None:
                        break
                    items.append((write.keys[i], value))
                    offset += len(value)
                self._put(write, items)
                if len(items) < stop - start:
                    return

    def _storable(self, write: PendingWrite) -> PendingWrite:
        """`write` up to its first block no entry can hold: a quantized pool's block whose K/V
        held an inf or a NaN (a scale no writer makes). The rest is dropped and counted."""
        expected = write.scope.expected
        if expected is None or expected.codec == "none":
            return write
        n = len(write.keys)  # a quantized pool's entries are its blocks (chunk_blocks 1)
        kv = blocks_to_entries(write.kv, 1)  # on the host, once
        ok = expected.leading_payloads_ok(payload_bytes(kv), n)
        if ok < n:
            self._metrics.inc("dropped_writes_blocks_total", n - ok)
        bs = len(write.token_ids) // n
        return write._replace(
            keys=write.keys[:ok], digests=write.digests[:ok], token_ids=write.token_ids[: ok * bs],
            kv=kv[:ok], block_keys=write.block_keys[:ok],
        )  # fmt: skip

    def _encode_all(self, write: PendingWrite) -> list[bytes]:
        """The entries of `write` as new bytes (for stores that keep the values they get): all
        of them, or those before the first the codec cannot store."""
        expected = write.scope.expected
        if expected is None:
            encode, _ = self._encoder(write)
            values = (self._encode_one(write, encode, i, None) for i in range(len(write.keys)))
            return list(itertools.takewhile(lambda value: value is not None, values))
        kv = blocks_to_entries(write.kv, write.num_blocks // len(write.keys))
        tokens = token_bytes(write.token_ids)
        parents = [write.parent, *write.keys[:-1]]
        return expected.encode_many(write.keys, write.digests, parents, tokens, payload_bytes(kv))

    def _encode_one(
        self, write: PendingWrite, encode: Encoder, i: int, out: memoryview | None
    ) -> bytes | memoryview | None:
        """Entry i of `write`, or None if the codec cannot store its K/V (an inf or a NaN
        under int8 or fp8): entries i.. are then dropped and counted."""
        try:
            return encode(i, out)
        except EntryError as e:
            if e.reason != "input":
                raise
        n = len(write.keys)
        self._metrics.inc("dropped_writes_blocks_total", (n - i) * (write.num_blocks // n))
        return None

    def _encoder(self, write: PendingWrite) -> tuple[Encoder, int]:
        """encode(i, out): entry i of `write` (into `out` if given); and a bound of its size."""
        n = len(write.keys)
        per, tokens_per = write.num_blocks // n, len(write.token_ids) // n
        kv = blocks_to_entries(write.kv, per)  # one copy at most, for the whole write
        keys, digests, parents = write.keys, write.digests, [write.parent, *write.keys[:-1]]
        expected, root = write.scope.expected, write.scope.root
        if expected is None:

            def entry(i: int) -> BlockEntry:
                tokens = write.token_ids[i * tokens_per : (i + 1) * tokens_per]
                key_id = write.scope.hasher.key_id
                return BlockEntry(root, keys[i], digests[i], parents[i], tokens, kv[i], per, key_id)

            return lambda i, out: encode_entry(entry(i), self._codec, out), max_entry_bytes(
                entry(0)
            )
        payload, tokens = payload_bytes(kv), token_bytes(write.token_ids)
        size, step = payload.nbytes // n, 4 * tokens_per

        def encode(i: int, out: memoryview | None) -> bytes | memoryview:
            token_part, part = tokens[i * step : (i + 1) * step], payload[i * size : (i + 1) * size]
            return expected.encode(keys[i], digests[i], parents[i], token_part, part, out)

        return encode, expected.total_bytes

    def bytes_per_block(self) -> float | None:
        """The mean size of the entries encoded so far, per block; None before the first."""
        size, blocks = self._encoded
        return size / blocks if blocks else None

    def _put(self, write: PendingWrite, items: list[tuple[bytes, bytes | memoryview]]) -> None:
        if not items:  # the write's first entry could not be encoded
            return
        per = write.num_blocks // len(write.keys)
        self._encoded = [
            self._encoded[0] + sum(len(value) for _, value in items),
            self._encoded[1] + per * len(items),
        ]  # one writer thread: a new list, so a reader never sees a half update
        for target in write.targets:
            watcher = self._events[target]
            if watcher is not None:
                watcher.writing(write)
            try:
                written = self._stores[target].put_many(items) * per
            finally:
                if watcher is not None:
                    watcher.writing(None)  # the write's copy of the blocks is not kept
            self._metrics.inc("tier_writes_blocks_total", written, tier=self._stores[target].name)
