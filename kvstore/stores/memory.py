"""MemoryStore: encoded entries in host RAM, bounded by bytes, LRU or FIFO eviction; retained
entries are passed over until their retention ends (unless every entry is retained)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvstore.stores.base import Changes, Counters, SpillStore, StoreStats

MEMORY_POLICIES = ("lru", "fifo")


class MemoryStore(SpillStore):
    """Host-RAM tier. Values are immutable `bytes` copies, independent of the caller's buffers.

    Capacity counts value bytes. "lru" refreshes an entry on every hit; "fifo" never does.
    """

    name = "memory"
    reads_in_place = True

    def __init__(
        self, capacity_bytes: int, policy: str = "lru", clock: Callable[[], float] = time.monotonic
    ):
        if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        if policy not in MEMORY_POLICIES:
            raise ValueError(f"policy must be one of {MEMORY_POLICIES}, got {policy!r}")
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()  # oldest / least recent first
        self._bytes = 0
        self._until: dict[bytes, float] = {}  # retained entries: the clock's time it ends
        self.clock = clock
        self._lock = threading.Lock()
        self._counters = Counters(self.name)

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._entries:
                    return i
            return len(keys)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._entries for key in keys]

    def _fetch(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with self._lock:
            values = [self._entries.get(key) for key in keys]
            if self.policy == "lru":
                for key, value in zip(keys, values, strict=True):
                    if value is not None:
                        self._entries.move_to_end(key)
        return values

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        written = dropped = evicted = 0
        changes = Changes()
        with self._lock:
            for key, value in items:
                if key in self._entries:
                    changes.stored([key])
                    continue
                if len(value) > self.capacity_bytes:
                    dropped += 1
                    continue
                evicted += self._make_room(len(value), changes)
                self._entries[bytes(key)] = bytes(value)
                self._bytes += len(value)
                changes.stored([key])
                written += 1
            self._changed(changes)  # under the lock: reported in the order they happened
        self._counters.add(writes=written, dropped_writes=dropped, evictions=evicted)
        return written

    def _make_room(self, nbytes: int, changes: Changes) -> int:
        """Evict (into `changes`) until nbytes more fit; returns how many."""
        evicted = passed = 0
        now = self.clock()
        while self._bytes + nbytes > self.capacity_bytes:
            key, old = self._entries.popitem(last=False)
            if self._until.get(key, now) > now and passed < len(self._entries):
                self._entries[key] = old  # retained: it goes behind the others
                passed += 1
                continue
            self._until.pop(key, None)
            self._bytes -= len(old)
            changes.removed([key])
            evicted += 1
        return evicted

    def retain(self, keys: Sequence[bytes], ttl_s: float) -> int:
        retained = 0
        with self._lock:
            until = self.clock() + ttl_s
            for key in keys:
                if key in self._entries:
                    self._until[key] = max(self._until.get(key, until), until)
                    retained += 1
        return retained

    def delete(self, keys: Sequence[bytes]) -> int:
        changes, removed = Changes(), 0
        with self._lock:
            for key in keys:
                value = self._entries.pop(key, None)
                self._until.pop(key, None)
                if value is not None:
                    self._bytes -= len(value)
                    changes.removed([key])
                    removed += 1
            self._changed(changes)
        return removed

    def stats(self) -> StoreStats:
        with self._lock:
            entries, nbytes, now = len(self._entries), self._bytes, self.clock()
            self._until = {k: t for k, t in self._until.items() if t > now}
            retained = len(self._until)
        return self._stats(entries, nbytes, self.capacity_bytes, retained=retained)

    def clear(self) -> int:
        changes = Changes()
        with self._lock:
            changes.removed(self._entries)
            removed = len(self._entries)
            self._entries.clear()
            self._until.clear()
            self._bytes = 0
            self._changed(changes)
        return removed

    def close(self) -> None:
        self.clear()
