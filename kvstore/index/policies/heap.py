"""Recency and frequency eviction policies (LRU, LFU, SLRU) and the lazy-heap machinery
they share with the FIFO family (`kvstore.index.policies.fifo`).

A policy tracks every entry of the index (an opaque int key with a size in blocks) and an
evictable flag per entry; `victim()` names the evictable entry to evict next. The index
flips the flag as nodes gain or lose children and locks, and either removes the victim or
shrinks it (partial eviction from a leaf's tail).

Every policy in this module orders evictable entries in lazy min-heaps: an update pushes a fresh
`(priority, key)` and leaves the old item behind; an item is live iff its entry still exists,
is evictable and still has that priority. Stale items are dropped when they reach the top,
and the heaps are rebuilt once they hold twice as many items as there are entries, so every
operation is O(log n) amortized and no eviction scans the entries. `lhd` (in
`kvstore.index.policies.lhd`) ranks by a score that changes with age, so it samples instead.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any

from kvstore.index.policies.base import IntegrityError, Policy


class HeapEntry:
    __slots__ = ("evictable", "freq", "prio", "queue", "size")

    def __init__(self, size: int, queue: int = 0):
        self.size = size
        self.evictable = False
        self.freq = 0
        self.prio: Any = 0
        self.queue = queue


class HeapPolicy(Policy):
    """Shared machinery: entries split over `num_queues` queues, each a lazy min-heap."""

    num_queues = 1

    def __init__(self, capacity_blocks: int | None = None):
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1 or None, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._entries: dict[int, HeapEntry] = {}
        self._heaps: list[list[tuple[Any, int]]] = [[] for _ in range(self.num_queues)]
        self._queue_blocks = [0] * self.num_queues  # blocks per queue, evictable or not
        self._num_items = 0
        self._tick = 0

    # --- helpers -------------------------------------------------------------------------
    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _capacity(self) -> int:
        return self.capacity_blocks or sum(self._queue_blocks)

    def _reprioritize(
        self, key: int, entry: HeapEntry, prio: Any, queue: int | None = None
    ) -> None:
        if queue is not None and queue != entry.queue:
            self._queue_blocks[entry.queue] -= entry.size
            self._queue_blocks[queue] += entry.size
            entry.queue = queue
        entry.prio = prio
        self._push(key, entry)

    def _push(self, key: int, entry: HeapEntry) -> None:
        if not entry.evictable:
            return
        heapq.heappush(self._heaps[entry.queue], (entry.prio, key))
        self._num_items += 1
        if self._num_items > 2 * len(self._entries) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heaps = [[] for _ in range(self.num_queues)]
        for key, e in self._entries.items():
            if e.evictable:
                self._heaps[e.queue].append((e.prio, key))
        for heap in self._heaps:
            heapq.heapify(heap)
        self._num_items = sum(map(len, self._heaps))

    def _peek(self, queue: int) -> int | None:
        """Live top of a queue's heap (stale items above it are dropped)."""
        heap, entries = self._heaps[queue], self._entries
        while heap:
            prio, key = heap[0]
            e = entries.get(key)
            if e is not None and e.evictable and e.queue == queue and e.prio == prio:
                return key
            heapq.heappop(heap)
            self._num_items -= 1
        return None

    def _initial(self, entry: HeapEntry, tag: int | None) -> tuple[Any, int]:
        """(priority, queue) of a new entry."""
        return self._next_tick(), 0

    # --- Policy --------------------------------------------------------------------------
    def insert(self, key: int, size: int, tag: int | None = None, like: int | None = None) -> None:
        if key in self._entries:
            raise KeyError(f"policy entry {key} already exists")
        entry = HeapEntry(size)
        if like is not None:
            src = self._entries[like]
            entry.freq, entry.prio, entry.queue = src.freq, src.prio, src.queue
        else:
            entry.prio, entry.queue = self._initial(entry, tag)
        self._entries[key] = entry
        self._queue_blocks[entry.queue] += size

    def remove(self, key: int, tag: int | None = None) -> None:
        entry = self._entries.pop(key)
        self._queue_blocks[entry.queue] -= entry.size

    def resize(self, key: int, size: int, tag: int | None = None) -> None:
        entry = self._entries[key]
        self._queue_blocks[entry.queue] += size - entry.size
        entry.size = size

    def set_evictable(self, key: int, flag: bool) -> None:
        entry = self._entries[key]
        if entry.evictable != flag:
            entry.evictable = flag
            self._push(key, entry)

    def entries(self) -> dict[int, tuple[int, bool]]:
        return {k: (e.size, e.evictable) for k, e in self._entries.items()}

    def check_integrity(self) -> None:
        blocks = [0] * self.num_queues
        for e in self._entries.values():
            blocks[e.queue] += e.size
        if blocks != self._queue_blocks:
            raise IntegrityError(f"queue sizes {self._queue_blocks} != recount {blocks}")
        live = {(e.queue, e.prio, k) for k, e in self._entries.items() if e.evictable}
        in_heaps = {(q, prio, k) for q, heap in enumerate(self._heaps) for prio, k in heap}
        if not live <= in_heaps:
            raise IntegrityError(f"evictable entries missing from heaps: {live - in_heaps}")


class LRUPolicy(HeapPolicy):
    """Least recently used first (insert, hit and touch all refresh recency)."""

    def access(self, key: int) -> None:
        entry = self._entries[key]
        self._reprioritize(key, entry, self._next_tick())

    touch = access

    def victim(self) -> int | None:
        return self._peek(0)


class LFUPolicy(HeapPolicy):
    """Fewest hits first; among equal counts, least recently used first."""

    def _initial(self, entry: HeapEntry, tag: int | None) -> tuple[Any, int]:
        entry.freq = 1
        return (1, self._next_tick()), 0

    def access(self, key: int) -> None:
        entry = self._entries[key]
        entry.freq += 1
        self._reprioritize(key, entry, (entry.freq, self._next_tick()))

    def touch(self, key: int) -> None:
        entry = self._entries[key]
        self._reprioritize(key, entry, (entry.freq, self._next_tick()))

    def victim(self) -> int | None:
        return self._peek(0)


PROBATION, PROTECTED = 0, 1


class SLRUPolicy(HeapPolicy):
    """Segmented LRU: new entries are probationary; a hit promotes to the protected segment
    (at most `protected_fraction` of capacity; its LRU overflow is demoted back). Victims come
    from probation first, so a scan of one-time prompts cannot flush the reused ones."""

    num_queues = 2

    def __init__(self, capacity_blocks: int | None = None, protected_fraction: float = 0.8):
        super().__init__(capacity_blocks)
        if not 0.0 < protected_fraction < 1.0:
            raise ValueError(f"protected_fraction must be in (0, 1), got {protected_fraction}")
        self.protected_fraction = protected_fraction
        self._protected: OrderedDict[int, None] = OrderedDict()  # LRU order, evictable or not

    def insert(self, key: int, size: int, tag: int | None = None, like: int | None = None) -> None:
        super().insert(key, size, tag, like)
        if self._entries[key].queue == PROTECTED:
            self._protected[key] = None

    def remove(self, key: int, tag: int | None = None) -> None:
        super().remove(key, tag)
        self._protected.pop(key, None)

    def access(self, key: int) -> None:
        entry = self._entries[key]
        if entry.queue == PROTECTED:
            self._protected.move_to_end(key)
        self._protected[key] = None
        self._reprioritize(key, entry, self._next_tick(), PROTECTED)
        self._demote_overflow()

    def touch(self, key: int) -> None:
        entry = self._entries[key]
        if entry.queue == PROTECTED:
            self._protected.move_to_end(key)
        self._reprioritize(key, entry, self._next_tick())

    def _demote_overflow(self) -> None:
        limit = self.protected_fraction * self._capacity()
        while self._queue_blocks[PROTECTED] > limit and len(self._protected) > 1:
            key, _ = self._protected.popitem(last=False)
            self._reprioritize(key, self._entries[key], self._next_tick(), PROBATION)

    def victim(self) -> int | None:
        key = self._peek(PROBATION)
        return key if key is not None else self._peek(PROTECTED)

    def check_integrity(self) -> None:
        super().check_integrity()
        protected = {k for k, e in self._entries.items() if e.queue == PROTECTED}
        if protected != set(self._protected):
            raise IntegrityError("SLRU protected order out of sync with entry segments")
