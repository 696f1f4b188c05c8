"""Eviction policies: which evictable radix node gives up its blocks first.

A policy tracks every entry of the index (an opaque int key with a size in blocks) and an
evictable flag per entry; `victim()` names the evictable entry to evict next. The index
flips the flag as nodes gain or lose children and locks, and either removes the victim or
shrinks it (partial eviction from a leaf's tail).

Every policy in this module orders evictable entries in lazy min-heaps: an update pushes a fresh
`(priority, key)` and leaves the old item behind; an item is live iff its entry still exists,
is evictable and still has that priority. Stale items are dropped when they reach the top,
and the heaps are rebuilt once they hold twice as many items as there are entries, so every
operation is O(log n) amortized and no eviction scans the entries. `lhd` (in
`kvstore.policy_lhd`) ranks by a score that changes with age, so it samples instead.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any

from kvstore.policy_base import IntegrityError, Policy
from kvstore.policy_lhd import LHDPolicy


class _Entry:
    __slots__ = ("evictable", "freq", "prio", "queue", "size")

    def __init__(self, size: int, queue: int = 0):
        self.size = size
        self.evictable = False
        self.freq = 0
        self.prio: Any = 0
        self.queue = queue


class _HeapPolicy(Policy):
    """Shared machinery: entries split over `num_queues` queues, each a lazy min-heap."""

    num_queues = 1

    def __init__(self, capacity_blocks: int | None = None):
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1 or None, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._entries: dict[int, _Entry] = {}
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

    def _reprioritize(self, key: int, entry: _Entry, prio: Any, queue: int | None = None) -> None:
        if queue is not None and queue != entry.queue:
            self._queue_blocks[entry.queue] -= entry.size
            self._queue_blocks[queue] += entry.size
            entry.queue = queue
        entry.prio = prio
        self._push(key, entry)

    def _push(self, key: int, entry: _Entry) -> None:
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

    def _initial(self, entry: _Entry, tag: int | None) -> tuple[Any, int]:
        """(priority, queue) of a new entry."""
        return self._next_tick(), 0

    # --- Policy --------------------------------------------------------------------------
    def insert(self, key: int, size: int, tag: int | None = None, like: int | None = None) -> None:
        if key in self._entries:
            raise KeyError(f"policy entry {key} already exists")
        entry = _Entry(size)
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


class LRUPolicy(_HeapPolicy):
    """Least recently used first (insert, hit and touch all refresh recency)."""

    def access(self, key: int) -> None:
        entry = self._entries[key]
        self._reprioritize(key, entry, self._next_tick())

    touch = access

    def victim(self) -> int | None:
        return self._peek(0)


class LFUPolicy(_HeapPolicy):
    """Fewest hits first; among equal counts, least recently used first."""

    def _initial(self, entry: _Entry, tag: int | None) -> tuple[Any, int]:
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


class SLRUPolicy(_HeapPolicy):
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


SMALL, MAIN = 0, 1
_MAX_FREQ = 3


class S3FIFOPolicy(_HeapPolicy):
    """S3-FIFO (Yang et al., SOSP'23): a small FIFO (10% of capacity) filters one-hit
    entries; entries hit while there move to the main FIFO, which reinserts hit entries
    (2-bit counter) instead of evicting them. Runs evicted unhit from the small FIFO leave a
    ghost tag; a new entry whose tag is a ghost goes straight to the main FIFO."""

    num_queues = 2

    def __init__(self, capacity_blocks: int | None = None, small_fraction: float = 0.1):
        super().__init__(capacity_blocks)
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction must be in (0, 1), got {small_fraction}")
        self.small_fraction = small_fraction
        self._ghost: OrderedDict[int, int] = OrderedDict()  # tag -> blocks, FIFO order
        self._ghost_blocks = 0

    def _initial(self, entry: _Entry, tag: int | None) -> tuple[Any, int]:
        if tag is not None and tag in self._ghost:
            self._ghost_blocks -= self._ghost.pop(tag)
            return self._next_tick(), MAIN
        return self._next_tick(), SMALL

    def access(self, key: int) -> None:
        entry = self._entries[key]
        entry.freq = min(entry.freq + 1, _MAX_FREQ)

    def touch(self, key: int) -> None:
        """FIFO order ignores recency."""

    def remove(self, key: int, tag: int | None = None) -> None:
        entry = self._entries[key]
        if entry.queue == SMALL:
            self._remember(tag, entry.size)
        super().remove(key, tag)

    def resize(self, key: int, size: int, tag: int | None = None) -> None:
        entry = self._entries[key]
        if entry.queue == SMALL and size < entry.size:
            self._remember(tag, entry.size - size)
        super().resize(key, size, tag)

    def _remember(self, tag: int | None, size: int) -> None:
        if tag is None:
            return
        self._ghost_blocks += size - self._ghost.pop(tag, 0)
        self._ghost[tag] = size
        limit = (1.0 - self.small_fraction) * self._capacity()
        while self._ghost_blocks > limit and self._ghost:
            self._ghost_blocks -= self._ghost.popitem(last=False)[1]

    def victim(self) -> int | None:
        while True:
            small, main = self._peek(SMALL), self._peek(MAIN)
            if small is None and main is None:
                return None
            from_small = small is not None and (
                main is None or self._queue_blocks[SMALL] >= self._small_limit()
            )
            key = small if from_small else main
            entry = self._entries[key]
            if entry.freq == 0:
                return key
            # a hit entry survives: small -> head of main (counter cleared), main -> reinsert
            entry.freq = 0 if from_small else entry.freq - 1
            self._reprioritize(key, entry, self._next_tick(), MAIN)

    def _small_limit(self) -> float:
        return self.small_fraction * self._capacity()

    def check_integrity(self) -> None:
        super().check_integrity()
        if self._ghost_blocks != sum(self._ghost.values()):
            raise IntegrityError("S3-FIFO ghost size out of sync")


class _History:
    """Ghost tags of evicted runs, oldest first, standing for at most a bound of blocks. Each
    tag records how many blocks had been sent to the history when it came."""

    def __init__(self) -> None:
        self.tags: OrderedDict[int, tuple[int, int]] = OrderedDict()  # tag -> (size, sent)
        self.blocks = 0  # blocks the remembered tags stand for
        self.sent = 0  # blocks ever sent

    def add(self, tag: int, size: int, limit: float) -> None:
        self.discard(tag)
        self.sent += size
        self.tags[tag] = (size, self.sent)
        self.blocks += size
        while self.blocks > limit and self.tags:
            self.blocks -= self.tags.popitem(last=False)[1][0]

    def discard(self, tag: int) -> int | None:
        """Forget `tag`: how many blocks were sent after it, or None if it is not held."""
        item = self.tags.pop(tag, None)
        if item is None:
            return None
        self.blocks -= item[0]
        return self.sent - item[1]

    def check(self) -> None:
        if self.blocks != sum(size for size, _ in self.tags.values()):
            raise IntegrityError("ghost history size out of sync")


class AdaptiveS3FIFOPolicy(S3FIFOPolicy):
    """S3-FIFO whose small-queue share adapts as ARC's does, with long ghost memory.

    Runs evicted from the small queue leave a ghost tag in one history, runs evicted from
    the main queue in another, each remembering up to `ghost_factor` x capacity blocks (reuse
    in prompt workloads comes back after many capacities' worth of other traffic: a user
    answering, a tool returning). A new entry whose tag is in either history was evicted too
    early and goes straight to the main queue. A hit in the small history means one-time
    entries got too little time, so the small queue's target grows by the entry's size
    (times the ratio of the histories' sizes, at least 1, as in ARC); a hit in the main
    history shrinks it alike. Only ghost hits within a capacity's worth of evictions adapt
    the target (no other split of this capacity could have kept older ones). The target
    starts at `small_fraction` (half: adaptation is slow when evictions are rare, and half
    is the safe middle) and stays within [min_small, max_small] of capacity.
    """

    def __init__(
        self,
        capacity_blocks: int | None = None,
        small_fraction: float = 0.5,
        ghost_factor: float = 4.0,
        min_small: float = 0.02,
        max_small: float = 0.9,
    ):
        super().__init__(capacity_blocks, small_fraction)
        if ghost_factor <= 0:
            raise ValueError(f"ghost_factor must be > 0, got {ghost_factor}")
        if not 0.0 < min_small <= small_fraction <= max_small < 1.0:
            raise ValueError("need 0 < min_small <= small_fraction <= max_small < 1")
        self.ghost_factor, self.min_small, self.max_small = ghost_factor, min_small, max_small
        self._small_share = small_fraction  # adaptive target share of the small queue
        self._histories = (_History(), _History())  # runs evicted from SMALL, from MAIN

    def _initial(self, entry: _Entry, tag: int | None) -> tuple[Any, int]:
        if tag is not None:
            for queue in (SMALL, MAIN):
                age = self._histories[queue].discard(tag)
                if age is not None:
                    if age <= self._capacity():
                        self._adapt(entry.size, queue)
                    return self._next_tick(), MAIN
        return self._next_tick(), SMALL

    def _adapt(self, size: int, queue: int) -> None:
        """ARC's rule: a ghost hit of `size` blocks in `queue`'s history grows that queue."""
        same, other = self._histories[queue].blocks, self._histories[1 - queue].blocks
        step = size * max(1.0, other / max(same, 1)) / max(self._capacity(), 1)
        share = self._small_share + (step if queue == SMALL else -step)
        self._small_share = min(self.max_small, max(self.min_small, share))

    def remove(self, key: int, tag: int | None = None) -> None:
        entry = self._entries[key]
        if entry.queue == MAIN:
            self._remember_in(MAIN, tag, entry.size)
        super().remove(key, tag)

    def resize(self, key: int, size: int, tag: int | None = None) -> None:
        entry = self._entries[key]
        if entry.queue == MAIN and size < entry.size:
            self._remember_in(MAIN, tag, entry.size - size)
        super().resize(key, size, tag)

    def _remember(self, tag: int | None, size: int) -> None:
        self._remember_in(SMALL, tag, size)

    def _remember_in(self, queue: int, tag: int | None, size: int) -> None:
        if tag is not None:
            self._histories[queue].add(tag, size, self.ghost_factor * self._capacity())

    def _small_limit(self) -> float:
        return self._small_share * self._capacity()

    def check_integrity(self) -> None:
        super().check_integrity()
        for history in self._histories:
            history.check()
        if not self.min_small <= self._small_share <= self.max_small:
            raise IntegrityError(f"small share {self._small_share} out of bounds")


class ARCPolicy(AdaptiveS3FIFOPolicy):
    """ARC (Megiddo & Modha, FAST'03) over radix entries: a recency queue (entries not hit
    since they were inserted) and a frequency queue (entries hit at least once), both in LRU
    order; a hit moves an entry to the frequency queue at once. The split between the queues
    adapts on ghost hits, and ghost hits are admitted to the frequency queue, exactly as in
    `AdaptiveS3FIFOPolicy` (whose histories and adaptation this reuses); only the queue order
    differs (LRU here, FIFO with reinsertion there)."""

    def access(self, key: int) -> None:
        self._reprioritize(key, self._entries[key], self._next_tick(), MAIN)

    def touch(self, key: int) -> None:
        self._reprioritize(key, self._entries[key], self._next_tick())

    def victim(self) -> int | None:
        small, main = self._peek(SMALL), self._peek(MAIN)
        if small is None or (main is not None and self._queue_blocks[SMALL] < self._small_limit()):
            return main
        return small


POLICIES: dict[str, type[Policy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "slru": SLRUPolicy,
    "s3fifo": S3FIFOPolicy,
    "as3fifo": AdaptiveS3FIFOPolicy,
    "arc": ARCPolicy,
    "lhd": LHDPolicy,
}


def make_policy(name: str, capacity_blocks: int | None = None) -> Policy:
    """A fresh policy by name; `capacity_blocks` (the pool size) sizes segmented policies."""
    try:
        cls = POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {list(POLICIES)}"
        ) from None
    return cls(capacity_blocks)
