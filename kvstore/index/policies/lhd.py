"""LHD: evict the entry of least hit density, learned from the ages at which content returns.

Least hit density (Beckmann, Chen & Cidon, NSDI'18) ranks a cached object by the hits it can
still be expected to get per block of cache per unit of time it will still occupy, given its
age (time since its last use) and its class (here: how often it has been hit), and evicts the
lowest. The expectations come from counts the policy keeps as it runs, so the ranking follows
the workload: with conversation traffic, where a session comes back minutes after its last
turn, a young entry that has never been hit is worth little (most prompts never come back,
and those that do come back later), an entry that has been hit a few times and is as old as a
typical think time is worth much.

Two changes fit it to a prefix cache that is small against the reuse distance:

- Return ages are learned from ghosts, not only from hits while resident: an evicted run
  leaves its tag with its hit count and last use, and when the same content is inserted again
  within `horizon` capacities its return counts at its true age (all the blocks of the
  returning run, which measured better than counting the evicted blocks alone: the blocks
  the returning request adds after those evicted count as intervals of the ghost's class
  that start and return together, so a class never counts more returns than starts), and it
  gets its old hit count back (plus one). Plain LHD sees only the returns that its own
  evictions allowed, so a cache that evicts everything before the typical return never
  learns that it comes.
- Density looks ahead `window` capacities, not over the entry's whole future: expected
  returns in the window over the expected blocks-times occupied in it.

Time is the count of blocks inserted (it runs at the same pace whatever the policy evicts),
ages are bucketed in quarters of the capacity, hits are counted in blocks. Counts decay at
each refresh of the table, and a return is weighted by the decay its start has had since, so
the two stay comparable. Victims are the minimum of `samples` evictable entries drawn at
random (seeded: replays are deterministic), or of all of them when there are fewer; ties go
to the least recently used.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvstore.index.policies.base import IntegrityError, Policy

DEFAULT_SCALE = 1024  # blocks: the unit of age when the policy is given no capacity


@dataclass(frozen=True)
class LHDParams:
    classes: int = 6  # hit-count classes: 0, 1, ..., classes - 1 or more hits
    horizon: float = 16.0  # ages tracked and ghosts remembered, in capacities
    buckets_per_capacity: int = 4  # age resolution
    window: float = 3.0  # how far ahead density looks, in capacities
    samples: int = 32  # evictable entries compared per victim
    decay: float = 0.99  # counts kept per refresh (one refresh per half capacity inserted)
    prior: float = 0.1  # pseudo-blocks per class following the pooled counts, in capacities
    seed: int = 0

    def __post_init__(self) -> None:
        if self.classes < 1 or self.buckets_per_capacity < 1 or self.samples < 1:
            raise ValueError("classes, buckets_per_capacity and samples must be >= 1")
        if not (self.horizon > 0 and self.window > 0 and self.prior >= 0):
            raise ValueError("horizon and window must be > 0, prior >= 0")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")


class _ReturnModel:
    """Per hit-count class: blocks that started an interval (an insert or a hit), blocks that
    came back at each age bucket, and the density table refreshed from them."""

    def __init__(self, params: LHDParams, scale: int):
        self.params = params
        self.width = max(1, scale // params.buckets_per_capacity)
        self.num_buckets = math.ceil(params.horizon * params.buckets_per_capacity)
        self.window = max(1, round(params.window * params.buckets_per_capacity))
        self.prior_blocks = params.prior * scale
        shape = (params.classes, self.num_buckets + 1)  # the last bucket: older than horizon
        self.returns = np.zeros(shape)
        self.starts = np.zeros(params.classes)
        self.density = np.ones(shape)  # all equal until the first refresh: LRU order
        self.epoch = 0  # refreshes so far: counts decay once per refresh

    def cls(self, hits: int) -> int:
        return min(hits, self.params.classes - 1)

    def bucket(self, age: int) -> int:
        return min(age // self.width, self.num_buckets)

    def start(self, hits: int, size: int) -> None:
        self.starts[self.cls(hits)] += size

    def returned(self, hits: int, age: int, size: int, since: int) -> None:
        """Blocks back at `age` that started their interval at epoch `since`, weighted as
        their start now is (decayed once per refresh since), so returns never exceed starts."""
        weight = self.params.decay ** (self.epoch - since)
        self.returns[self.cls(hits), self.bucket(age)] += size * weight

    def refresh(self) -> None:
        """Density per (class, age bucket): returns in the next `window` buckets over the
        blocks still away during them; each class is shrunk towards the pooled counts."""
        pooled = self.returns.sum(axis=0) / max(self.starts.sum(), 1.0)
        returns = self.returns + self.prior_blocks * pooled
        starts = self.starts + self.prior_blocks
        away = starts[:, None] - (np.cumsum(returns, axis=1) - returns)
        # Blocks away at a bucket are at least those that return at it or later, so that the
        # density never exceeds 1 (a float rounding apart), whatever the counts; the last
        # floor only turns 0 / 0 (no counts, no prior) into 0.
        away = np.maximum(away, np.cumsum(returns[:, ::-1], axis=1)[:, ::-1])
        away = np.maximum(away, 1e-9)
        cum_r = np.pad(np.cumsum(returns, axis=1), ((0, 0), (1, 0)))
        cum_a = np.pad(np.cumsum(away, axis=1), ((0, 0), (1, 0)))
        lo = np.arange(self.num_buckets + 1)
        hi = np.minimum(lo + self.window, self.num_buckets + 1)
        self.density = (cum_r[:, hi] - cum_r[:, lo]) / (cum_a[:, hi] - cum_a[:, lo])
        self.returns *= self.params.decay
        self.starts *= self.params.decay
        self.epoch += 1


class _Entry:
    __slots__ = ("epoch", "evictable", "hits", "last", "size")

    def __init__(self, size: int, hits: int, last: int, epoch: int):
        self.size, self.hits, self.last, self.epoch = size, hits, last, epoch
        self.evictable = False


class _Ghost(NamedTuple):
    hits: int
    last: int  # time of last use
    size: int  # blocks evicted
    epoch: int  # model epoch when its interval started


class _Ghosts:
    """Tags of evicted runs, oldest eviction first; a tag last used more than the horizon ago
    is no longer a return (and is dropped when it reaches the front)."""

    def __init__(self, horizon_blocks: int):
        self.horizon = horizon_blocks
        self.tags: OrderedDict[int, _Ghost] = OrderedDict()

    def add(self, tag: int, ghost: _Ghost, now: int) -> None:
        self.tags.pop(tag, None)
        self.tags[tag] = ghost
        while self.tags:
            oldest = next(iter(self.tags.values()))
            if now - oldest.last <= self.horizon and len(self.tags) <= self.horizon:
                break
            self.tags.popitem(last=False)

    def pop(self, tag: int | None, now: int) -> _Ghost | None:
        """The ghost of a returning run, or None if it is unknown or too old."""
        ghost = self.tags.pop(tag, None) if tag is not None else None
        return ghost if ghost is not None and now - ghost.last <= self.horizon else None


class LHDPolicy(Policy):
    """Least hit density with ghost-learned return ages (see the module docstring)."""

    def __init__(self, capacity_blocks: int | None = None, params: LHDParams | None = None):
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1 or None, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.params = params or LHDParams()
        scale = capacity_blocks or DEFAULT_SCALE
        self._model = _ReturnModel(self.params, scale)
        self._ghosts = _Ghosts(math.ceil(self.params.horizon * scale))
        self._refresh_every = max(1, scale // 2)
        self._next_refresh = self._refresh_every
        self._entries: dict[int, _Entry] = {}
        self._evictable: list[int] = []  # keys, in any order
        self._slot: dict[int, int] = {}  # key -> its index in _evictable
        self._clock = 0  # blocks inserted so far
        self._rng = random.Random(self.params.seed)

    # --- Policy --------------------------------------------------------------------------
    def insert(self, key: int, size: int, tag: int | None = None, like: int | None = None) -> None:
        if key in self._entries:
            raise KeyError(f"policy entry {key} already exists")
        if like is not None:  # a split: the new head keeps the history of the run
            src = self._entries[like]
            self._entries[key] = _Entry(size, src.hits, src.last, src.epoch)
            return
        hits = self._returning_hits(tag, size)
        self._clock += size
        self._entries[key] = _Entry(size, hits, self._clock, self._model.epoch)
        self._model.start(hits, size)
        if self._clock >= self._next_refresh:
            self._model.refresh()
            self._next_refresh = self._clock + self._refresh_every

    def remove(self, key: int, tag: int | None = None) -> None:
        entry = self._entries.pop(key)
        if entry.evictable:
            self._drop(key)
        self._remember(tag, entry, entry.size)

    def resize(self, key: int, size: int, tag: int | None = None) -> None:
        entry = self._entries[key]
        if size < entry.size:
            self._remember(tag, entry, entry.size - size)
        else:  # blocks added to a run start with it: it can return them all
            self._model.start(entry.hits, size - entry.size)
        entry.size = size

    def access(self, key: int) -> None:
        entry = self._entries[key]
        self._model.returned(entry.hits, self._clock - entry.last, entry.size, entry.epoch)
        entry.hits += 1
        entry.last, entry.epoch = self._clock, self._model.epoch
        self._model.start(entry.hits, entry.size)

    def touch(self, key: int) -> None:
        self._entries[key].last = self._clock

    def set_evictable(self, key: int, flag: bool) -> None:
        entry = self._entries[key]
        if entry.evictable == flag:
            return
        entry.evictable = flag
        if flag:
            self._slot[key] = len(self._evictable)
            self._evictable.append(key)
        else:
            self._drop(key)

    def victim(self) -> int | None:
        pool = self._evictable
        if not pool:
            return None
        if len(pool) > self.params.samples:
            pool = self._rng.choices(pool, k=self.params.samples)
        return min(pool, key=self._rank)

    def entries(self) -> dict[int, tuple[int, bool]]:
        return {k: (e.size, e.evictable) for k, e in self._entries.items()}

    def check_integrity(self) -> None:
        evictable = {k for k, e in self._entries.items() if e.evictable}
        if evictable != set(self._evictable) or len(self._evictable) != len(evictable):
            raise IntegrityError("LHD evictable list out of sync with entry flags")
        slots = {k: i for i, k in enumerate(self._evictable)}
        if slots != self._slot:
            raise IntegrityError("LHD evictable slots out of sync")
        model = self._model
        if not (np.isfinite(model.density).all() and model.density.max() <= 1.0 + 1e-9):
            raise IntegrityError("LHD density table is not finite or exceeds 1")
        if (model.returns.sum(axis=1) > model.starts * (1.0 + 1e-9) + 1e-9).any():
            raise IntegrityError("LHD counts more returns than starts in a hit-count class")

    # --- helpers -------------------------------------------------------------------------
    @property
    def evictable_count(self) -> int:
        """Entries that `victim` may choose."""
        return len(self._evictable)

    @property
    def ghost_count(self) -> int:
        """Evicted runs remembered (tags whose content would count as a return)."""
        return len(self._ghosts.tags)

    @property
    def class_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """Per hit-count class: blocks that started an interval and blocks that returned
        (both decayed as they age), as copies."""
        return self._model.starts.copy(), self._model.returns.sum(axis=1)

    @property
    def max_density(self) -> float:
        """The largest value of the current density table."""
        return float(self._model.density.max())

    def hits(self, key: int) -> int:
        """Hits of an entry, counting those of its content before an eviction it came back from."""
        return self._entries[key].hits

    def density(self, key: int) -> float:
        """Current hit density of an entry (what `victim` minimizes)."""
        entry = self._entries[key]
        model = self._model
        return float(model.density[model.cls(entry.hits), model.bucket(self._clock - entry.last)])

    def _rank(self, key: int) -> tuple[float, int, int]:
        return self.density(key), self._entries[key].last, key

    def _drop(self, key: int) -> None:
        """Remove a key from the evictable list in O(1) (the last key takes its slot)."""
        slot = self._slot.pop(key)
        last = self._evictable.pop()
        if last != key:
            self._evictable[slot] = last
            self._slot[last] = slot

    def _returning_hits(self, tag: int | None, size: int) -> int:
        """Hit count of new content: 0, or one more than before if it comes back from a ghost.
        The return counts for the whole returning run (see the module docstring): the evicted
        blocks as returns of the interval they started, the blocks the returning request adds
        after them as intervals of the ghost's class that start now and return at its age (so
        a class never counts more returns than starts)."""
        ghost = self._ghosts.pop(tag, self._clock)
        if ghost is None:
            return 0
        model, age, back = self._model, self._clock - ghost.last, min(size, ghost.size)
        model.returned(ghost.hits, age, back, ghost.epoch)
        if size > back:
            model.start(ghost.hits, size - back)
            model.returned(ghost.hits, age, size - back, model.epoch)
        return ghost.hits + 1

    def _remember(self, tag: int | None, entry: _Entry, size: int) -> None:
        if tag is not None:
            self._ghosts.add(tag, _Ghost(entry.hits, entry.last, size, entry.epoch), self._clock)
