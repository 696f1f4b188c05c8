"""FIFO-family eviction policies: S3-FIFO, and two long-memory adaptive variants of it
(adaptive S3-FIFO and ARC over radix entries); docs/POLICIES.md describes them. They share
the lazy-heap machinery of `kvstore.index.policies.heap`."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvstore.index.policies.base import IntegrityError
from kvstore.index.policies.heap import HeapEntry, HeapPolicy

SMALL, MAIN = 0, 1
_MAX_FREQ = 3


class S3FIFOPolicy(HeapPolicy):
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

    def _initial(self, entry: HeapEntry, tag: int | None) -> tuple[Any, int]:
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

    def _initial(self, entry: HeapEntry, tag: int | None) -> tuple[Any, int]:
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
