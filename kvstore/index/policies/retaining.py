"""RetainingPolicy: any eviction policy, with retention on top (what a client asked to keep).

A retained entry is hidden from the wrapped policy (it reads as not evictable there) until
its deadline passes, so every evictable unretained entry goes first, in the wrapped
policy's order. Only when none is left does a retained entry go, earliest deadline first
(a forced eviction: retention never blocks admission). A hit or a later use refreshes the
deadline to now + the entry's TTL. A split's head inherits its run's retention.

Deadlines are read from an injected clock (seconds); expiry is lazy: `expire()` runs at
every `victim()` and whenever counts are read.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.index.policies.base import IntegrityError, Policy


@dataclass
class Retained:
    until: float  # the clock's time its retention ends
    ttl_s: float  # what a hit refreshes it to
    tenant: str  # whose retention cap it counts against
    size: int  # blocks (kept current by resize)


@dataclass
class RetentionCounts:
    """Cumulative counts, in blocks (deferred: evictions)."""

    expired: int = 0  # retentions that ran out
    forced: int = 0  # retained blocks evicted before their deadline (nothing else was left)
    deferred: int = 0  # evictions that took an unretained entry while a retained one waited


class RetainingPolicy(Policy):
    """`inner` orders the unretained entries; retained ones wait behind them."""

    def __init__(self, inner: Policy, clock: Callable[[], float]):
        self.inner, self.clock = inner, clock
        self._flags: dict[int, bool] = {}  # every entry's real evictable flag
        self._retained: dict[int, Retained] = {}
        self._deadlines: list[tuple[float, int]] = []  # lazy heap over every retained entry
        self._waiting: list[tuple[float, int]] = []  # lazy heap over the evictable retained
        self.blocks: Counter[str] = Counter()  # retained blocks per tenant
        self.counts = RetentionCounts()

    # --- retention -----------------------------------------------------------------------
    def retain(self, key: int, size: int, ttl_s: float, tenant: str) -> bool:
        """Retain `key` for ttl_s from now (a retained one keeps the later deadline, the longer
        TTL and its tenant). Returns whether it was newly retained (counted for `tenant`)."""
        until = self.clock() + ttl_s
        entry = self._retained.get(key)
        if entry is not None:
            entry.ttl_s = max(entry.ttl_s, ttl_s)
            self._extend(key, entry, until)
            return False
        entry = self._retained[key] = Retained(until, ttl_s, tenant, size)
        self.blocks[tenant] += size
        if self._flags[key]:
            self.inner.set_evictable(key, False)
        self._push(key, entry)
        return True

    def release(self, key: int) -> int:
        """End `key`'s retention now; returns the blocks it held (0: not retained)."""
        entry = self._retained.pop(key, None)
        if entry is None:
            return 0
        self.blocks[entry.tenant] -= entry.size
        if self._flags[key]:
            self.inner.set_evictable(key, True)
        return entry.size

    def retained(self, key: int) -> Retained | None:
        return self._retained.get(key)

    def expire(self) -> int:
        """Release every retention whose deadline passed; returns the blocks released."""
        now, released = self.clock(), 0
        while self._deadlines and self._deadlines[0][0] <= now:
            until, key = heapq.heappop(self._deadlines)
            entry = self._retained.get(key)
            if entry is not None and entry.until == until:
                released += self.release(key)
        self.counts.expired += released
        return released

    @property
    def num_retained_blocks(self) -> int:
        return sum(e.size for e in self._retained.values())

    def _extend(self, key: int, entry: Retained, until: float) -> None:
        if until > entry.until:
            entry.until = until
            self._push(key, entry)

    def _push(self, key: int, entry: Retained) -> None:
        heapq.heappush(self._deadlines, (entry.until, key))
        if self._flags[key]:
            heapq.heappush(self._waiting, (entry.until, key))
        if len(self._deadlines) > 2 * len(self._retained) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        live = [(e.until, k) for k, e in self._retained.items()]
        self._deadlines = list(live)
        self._waiting = [(u, k) for u, k in live if self._flags[k]]
        heapq.heapify(self._deadlines)
        heapq.heapify(self._waiting)

    # --- Policy --------------------------------------------------------------------------
    def insert(self, key: int, size: int, tag: int | None = None, like: int | None = None) -> None:
        self.inner.insert(key, size, tag, like)
        self._flags[key] = False
        source = self._retained.get(like) if like is not None else None
        if source is not None:  # a split's head: the blocks keep their retention
            self._retained[key] = Retained(source.until, source.ttl_s, source.tenant, size)
            self.blocks[source.tenant] += size
            self._push(key, self._retained[key])

    def remove(self, key: int, tag: int | None = None) -> None:
        entry = self._retained.pop(key, None)
        if entry is not None:
            self.blocks[entry.tenant] -= entry.size
            self.counts.forced += entry.size
        del self._flags[key]
        self.inner.remove(key, tag)

    def resize(self, key: int, size: int, tag: int | None = None) -> None:
        entry = self._retained.get(key)
        if entry is not None:
            self.blocks[entry.tenant] += size - entry.size
            if tag is not None and size < entry.size:  # evicted from its tail
                self.counts.forced += entry.size - size
            entry.size = size
        self.inner.resize(key, size, tag)

    def access(self, key: int) -> None:
        self.inner.access(key)
        self._refresh(key)

    def touch(self, key: int) -> None:
        self.inner.touch(key)
        self._refresh(key)

    def _refresh(self, key: int) -> None:
        entry = self._retained.get(key)
        if entry is not None:
            self._extend(key, entry, self.clock() + entry.ttl_s)

    def set_evictable(self, key: int, flag: bool) -> None:
        if self._flags[key] == flag:
            return
        self._flags[key] = flag
        entry = self._retained.get(key)
        if entry is None:
            self.inner.set_evictable(key, flag)
        elif flag:
            heapq.heappush(self._waiting, (entry.until, key))

    def victim(self) -> int | None:
        self.expire()
        key = self.inner.victim()
        if key is not None:
            self.counts.deferred += self._waiting_top() is not None
            return key
        return self._waiting_top()

    def _waiting_top(self) -> int | None:
        """The evictable retained entry with the earliest deadline (stale items dropped)."""
        while self._waiting:
            until, key = self._waiting[0]
            entry = self._retained.get(key)
            if entry is not None and entry.until == until and self._flags.get(key):
                return key
            heapq.heappop(self._waiting)
        return None

    def entries(self) -> dict[int, tuple[int, bool]]:
        return {k: (size, self._flags[k]) for k, (size, _) in self.inner.entries().items()}

    def check_integrity(self) -> None:
        self.inner.check_integrity()
        if set(self._flags) != set(self.inner.entries()):
            raise IntegrityError("retention flags out of sync with the policy's entries")
        recount: Counter[str] = Counter()
        inner = self.inner.entries()
        for key, entry in self._retained.items():
            recount[entry.tenant] += entry.size
            if inner[key] != (entry.size, False):
                raise IntegrityError(f"retained entry {key}: {inner[key]} in the inner policy")
        if any(n < 0 for n in self.blocks.values()):  # (`+` below would drop them)
            raise IntegrityError(f"a tenant's retained blocks are negative: {dict(self.blocks)}")
        if +recount != +self.blocks:
            raise IntegrityError(f"retained blocks {dict(self.blocks)} != recount {dict(recount)}")
