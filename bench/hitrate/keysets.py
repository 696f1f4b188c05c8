"""The spill tiers of the tier replay: sets of block ids that evict the way their stores do.

One entry holds one block (`chunk_blocks` = 1, the default), so capacities are in blocks.
Each model follows its store (kvstore/stores/) as `make_stores` builds it:

- memory (`MemoryStore`, policy "lru"): LRU over entries. A read (`_fetch`, under
  `get_prefix`) refreshes every present key it was asked for, those after the first gap too;
  writing a present key is skipped and refreshes nothing; a write into a full store evicts
  the least recently used entry.
- lmdb (`LmdbStore`): FIFO by insertion, reads refresh nothing. A put is split into batches
  of at most (high_water - low_water) of the map; a batch that would pass the high-water mark
  first deletes the oldest entries down to the low-water mark less the batch. The capacity is
  the entries the map holds at its high-water mark (pages counted as entries).
- redis (`RedisStore` on a server with `maxmemory` and `allkeys-lru`, as the compose file of
  docs/DEPLOY.md runs it): LRU; MGET refreshes every present key asked for, and SET NX of a
  present key refreshes it too (Redis looks the key up to test NX). Redis approximates LRU by
  sampling a few keys; the model evicts the exact least recently used one.

A tier at least as large as the trace's unique blocks never evicts: a plain bool array.

Given an `EventSink`, a tier reports each write's evictions and stores as `BlockRemoved` /
`BlockStored` events (`TierEvents`), as a replica's spill tier reports them to a router (keys:
each id as a little-endian 16-byte integer, as `tiers.key_blob`; a spill tier's event names
no parent, and its token ids are the block ids, one token a block as the replay's index).
"""

from __future__ import annotations

import inspect
from collections import OrderedDict, deque
from collections.abc import Sequence
from fractions import Fraction
from typing import Protocol

import numpy as np

from kvstore.fleet.events import BlockRemoved, BlockStored, EventSink
from kvstore.stores import LmdbStore

__all__ = [
    "LOWER_TIERS",
    "FifoSet",
    "KeySet",
    "LruSet",
    "TierEvents",
    "UnboundedSet",
    "make_keyset",
]

LOWER_TIERS = ("memory", "lmdb", "redis")  # fastest first, as `make_stores` orders them
_LMDB_ARGS = inspect.signature(LmdbStore.__init__).parameters
# LmdbStore's default water marks, as exact fractions of the map (0.8 / 0.9 is 8/9 exactly)
LMDB_HIGH_WATER = Fraction(str(_LMDB_ARGS["high_water"].default))
LMDB_LOW_WATER = Fraction(str(_LMDB_ARGS["low_water"].default))


class KeySet(Protocol):
    """A spill tier's content, as block ids."""

    name: str
    capacity: int

    def run(self, ids: np.ndarray) -> int:
        """A read of `ids`: the length of the leading run present (refreshing recency as the
        store's read does)."""

    def put(self, ids: Sequence[int]) -> None:
        """A write of `ids` (present ones are skipped), evicting as the store does."""

    def __len__(self) -> int: ...


class TierEvents:
    """A tier's writes as events: per write, the ids it evicted, then the ids it stored, net of
    the write itself (an id it stored and evicted is in neither, one it evicted and stored
    again only in the second), so a consumer applying them holds exactly the tier's ids."""

    def __init__(self, sink: EventSink):
        self.sink = sink

    def write(self, present: np.ndarray, added: Sequence[int], gone: Sequence[int]) -> None:
        new = set(added)
        removed = [b for b in gone if not present[b] and b not in new]
        stored = [b for b in added if present[b]]
        if removed:
            self.sink.emit(BlockRemoved(_keys(removed)))
        if stored:
            self.sink.emit(BlockStored(_keys(stored), None, stored, 1))


def _keys(ids: Sequence[int]) -> list[bytes]:
    return [b.to_bytes(16, "little") for b in ids]


def _leading(present: np.ndarray) -> int:
    """Length of the leading run of True."""
    if len(present) == 0 or present.all():
        return len(present)
    return int(present.argmin())


class UnboundedSet:
    """A tier that holds every block of the trace: nothing is ever evicted."""

    def __init__(self, name: str, capacity: int, num_unique: int, events: EventSink | None = None):
        self.name, self.capacity = name, capacity
        self.present = np.zeros(num_unique, dtype=bool)
        self.size = 0
        self.events = TierEvents(events) if events is not None else None

    def run(self, ids: np.ndarray) -> int:
        return _leading(self.present[ids])

    def put(self, ids: Sequence[int]) -> None:
        if len(ids):
            new = np.unique(np.asarray(ids, dtype=np.int64))
            new = new[~self.present[new]]
            self.size += len(new)
            self.present[new] = True
            if self.events is not None:
                self.events.write(self.present, new.tolist(), ())

    def __len__(self) -> int:
        return self.size


class LruSet:
    """LRU over block ids; reads refresh every present id asked for, and writes of present ids
    refresh them when `refresh_on_write` (Redis) and not otherwise (host memory)."""

    def __init__(
        self,
        name: str,
        capacity: int,
        num_unique: int,
        refresh_on_write: bool,
        events: EventSink | None = None,
    ):
        self.name, self.capacity, self.refresh_on_write = name, capacity, refresh_on_write
        self.present = np.zeros(num_unique, dtype=bool)
        self.order: OrderedDict[int, None] = OrderedDict()  # least recent first
        self.events = TierEvents(events) if events is not None else None

    def run(self, ids: np.ndarray) -> int:
        present = self.present[ids]
        for b in ids[present].tolist():
            self.order.move_to_end(b)
        return _leading(present)

    def put(self, ids: Sequence[int]) -> None:
        order, present = self.order, self.present
        added: list[int] = []
        gone: list[int] = []
        for b in ids:
            if b in order:
                if self.refresh_on_write:
                    order.move_to_end(b)
                continue
            if len(order) >= self.capacity:
                old = order.popitem(last=False)[0]
                present[old] = False
                gone.append(old)
            order[b] = None
            present[b] = True
            added.append(b)
        if self.events is not None:
            self.events.write(present, added, gone)

    def __len__(self) -> int:
        return len(self.order)


class FifoSet:
    """LMDB: FIFO by insertion, evicting in batches between its water marks."""

    def __init__(self, name: str, capacity: int, num_unique: int, events: EventSink | None = None):
        self.name, self.capacity = name, capacity
        self.present = np.zeros(num_unique, dtype=bool)
        self.events = TierEvents(events) if events is not None else None
        self.queue: deque[int] = deque()  # oldest first
        self.low = int(capacity * LMDB_LOW_WATER / LMDB_HIGH_WATER)  # floor, exactly
        self.batch = max(1, capacity - self.low)  # a batch costs at most high - low water

    def run(self, ids: np.ndarray) -> int:
        return _leading(self.present[ids])

    def put(self, ids: Sequence[int]) -> None:
        new = [b for b in ids if not self.present[b]]
        gone: list[int] = []
        for start in range(0, len(new), self.batch):
            gone += self._put_batch(new[start : start + self.batch])
        if self.events is not None:
            self.events.write(self.present, new, gone)

    def _put_batch(self, batch: list[int]) -> list[int]:
        """Write one batch; returns the ids it evicted."""
        gone: list[int] = []
        if len(self.queue) + len(batch) > self.capacity:
            target = max(0, self.low - len(batch))
            gone = [self.queue.popleft() for _ in range(len(self.queue) - target)]
            self.present[gone] = False
        self.queue.extend(batch)
        self.present[batch] = True
        return gone

    def __len__(self) -> int:
        return len(self.queue)


def make_keyset(
    name: str, capacity: int, num_unique: int, events: EventSink | None = None
) -> KeySet:
    """The model of spill tier `name` holding up to `capacity` blocks (`events`: where its
    stores and evictions go, as events)."""
    if name not in LOWER_TIERS:
        raise ValueError(f"unknown spill tier {name!r}; choose from {LOWER_TIERS}")
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"{name} capacity must be an int >= 1 block, got {capacity!r}")
    if capacity >= num_unique:
        return UnboundedSet(name, capacity, num_unique, events)
    if name == "lmdb":
        return FifoSet(name, capacity, num_unique, events)
    return LruSet(name, capacity, num_unique, name == "redis", events)
