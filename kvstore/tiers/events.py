"""A spill store's changes as block events of its medium (kvstore/fleet/events.py), so a
router sees what each tier of a replica holds, not only its device pool.

The store reports each change this process makes, as entry keys, in the order they took
effect (`SpillStore.watch`); the writer says which write is being put (`writing`), for the
blocks, parent and tokens of each entry it stores. One `BlockStored` per entry: its blocks
are fetched together or not at all. An entry of N > 1 blocks is removed by its last
block's key: the blocks of the last `MAX_CHUNKS` entries this process stored are kept (16
bytes a block) so that its `BlockRemoved` lists them all; another entry (another
process's, an earlier run's, an older one) is removed by its last key alone, and a
consumer that kept the entry's blocks by that key (`BlockSet` does) removes them all.

Not seen, so not reported: a shared LMDB's entries written or evicted by another process,
and Redis's own evictions and expiries (docs/DEPLOY.md, "KV events").
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvstore.fleet.events import TIER_MEDIUM, BlockRemoved, BlockStored, EventSink
from kvstore.stores import SpillStore
from kvstore.tiers.writer import PendingWrite

MAX_CHUNKS = 1 << 20  # entries whose blocks are kept for their removal (N > 1 only)


class TierEvents:
    """The events of one spill store, sent to `sink` (under no lock of the cache's)."""

    def __init__(self, store: SpillStore, sink: EventSink, block_size: int, chunk_blocks: int):
        self.medium = TIER_MEDIUM[store.name]
        self._sink, self._block_size, self._chunk = sink, block_size, chunk_blocks
        self._chunks: dict[bytes, list[bytes]] = {}  # entry key -> its blocks (N > 1 only)
        self._lock = threading.Lock()
        self._local = threading.local()  # the write being put on this thread
        store.watch(self.changed)

    def writing(self, write: PendingWrite | None) -> None:
        """`write` is being put on this thread (None: done)."""
        self._local.write = write

    def changed(self, removed: list[bytes], stored: list[bytes]) -> None:
        """The store's listener: removed entries, then stored ones."""
        if removed:
            self._sink.emit(BlockRemoved(self._removed_blocks(removed), self.medium))
        write = getattr(self._local, "write", None)
        if stored and write is not None:
            for event in self._stored_events(write, stored):
                self._sink.emit(event)

    def _removed_blocks(self, keys: Sequence[bytes]) -> list[bytes]:
        if self._chunk == 1:
            return list(keys)
        with self._lock:
            chunks = [self._chunks.pop(key, None) or [key] for key in keys]
        return [block for chunk in chunks for block in chunk]

    def _stored_events(self, write: PendingWrite, stored: list[bytes]) -> list[BlockStored]:
        """One event per stored entry of `write` (entry i: blocks [i*N, (i+1)*N))."""
        n, bs, blocks = self._chunk, self._block_size, write.block_keys
        where = {key: i for i, key in enumerate(write.keys)}
        root, events = write.scope.hasher.root, []
        for key in stored:
            i = where.get(key)
            if i is None or len(blocks) < (i + 1) * n:
                continue  # not this write's entry (cannot happen on the writer's thread)
            chunk = list(blocks[i * n : (i + 1) * n])
            parent = blocks[i * n - 1] if i else write.parent
            tokens = write.token_ids[i * n * bs : (i + 1) * n * bs].tolist()
            events.append(BlockStored(chunk, None if parent == root else parent, tokens, bs,
                                      self.medium))  # fmt: skip
        if n > 1:
            with self._lock:
                self._chunks.update((e.block_hashes[-1], e.block_hashes) for e in events)
                while len(self._chunks) > MAX_CHUNKS:  # the oldest go (Redis expires unseen)
                    self._chunks.pop(next(iter(self._chunks)))
        return events
