"""Write policies: which stores an event of the cache writes to.

Per store (`<store>_write_policy`): "write-through" writes blocks when they are stored (and
fills from a slower tier's hit), "write-back" when the device pool evicts them, "selective"
once a device block has been hit `selective_min_hits` times, "off" never.

With `write_back_at_commit` (a hybrid model's attention kind, kvstore/attention/hybrid.py),
"write-back" stores are written when blocks are stored, like "write-through": a block lets
go of its window layers' part long before the pool evicts it, so an entry of every layer
can be taken only while it is committed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvstore.config import CacheConfig
from kvstore.stores import SpillStore

MAX_HIT_COUNTS = 1_000_000  # keys whose selective hit counts are kept (LRU)


class WritePolicies:
    """The targets (indices into the stores, fastest first) of each event."""

    def __init__(
        self, config: CacheConfig, stores: Sequence[SpillStore], write_back_at_commit: bool = False
    ):
        self.names = [store.name for store in stores]
        policy = [getattr(config, f"{name}_write_policy", "write-through") for name in self.names]
        if write_back_at_commit:  # (see above)
            policy = ["write-through" if p == "write-back" else p for p in policy]
        self.on_store = self._of(policy, "write-through")
        self.on_evict = self._of(policy, "write-back")
        self.on_hit = self._of(policy, "selective")
        self.min_hits = config.selective_min_hits
        self._hits: OrderedDict[bytes, int] = OrderedDict()

    @staticmethod
    def _of(policy: list[str], name: str) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(policy) if p == name)

    def on_promote(self, tier: str) -> tuple[int, ...]:
        """Write-through stores faster than `tier`: a hit there fills them (like a store)."""
        return tuple(i for i in self.on_store if i < self.names.index(tier))

    def count_hits(self, keys: Sequence[bytes]) -> int:
        """Count a device hit on each key; returns how many leading keys just reached the
        selective threshold (those are the ones to write)."""
        reached = 0
        for i, key in enumerate(keys):
            count = self._hits.pop(key, 0) + 1
            self._hits[key] = count
            if count == self.min_hits:
                reached = i + 1
        while len(self._hits) > MAX_HIT_COUNTS:
            self._hits.popitem(last=False)
        return reached
