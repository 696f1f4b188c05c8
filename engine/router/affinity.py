"""prompt_cache_key affinity: the replica each key's requests go to (OpenAI's routing hint).

A key is remembered with the cache salt of its request (a tenant's, and the request's own
`cache_salt`): two tenants' equal keys share no cache, so they are two keys. The map is
bounded; the key least recently used goes first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engine.router.fleet import Fleet, Replica

MAX_CACHE_KEYS = 100_000  # prompt_cache_keys whose replica is remembered
MOVES = ("load", "unavailable")  # why a known key's request went elsewhere


class CacheKeys:
    """prompt_cache_key -> replica, and how often a known key had to move."""

    def __init__(self, fleet: Fleet, max_keys: int = MAX_CACHE_KEYS):
        self.fleet, self.max_keys = fleet, max_keys
        self._pins: OrderedDict[tuple[str, str], Replica] = OrderedDict()
        self.moves = dict.fromkeys(MOVES, 0)

    def pinned(self, key: tuple[str, str] | None, tried: Sequence[Replica]) -> Replica | None:
        """The replica `key` stays on, when it may take this request (counted as a
        `cache_key` decision); None for no key, a new one, or one that must move."""
        replica = self._pins.get(key) if key is not None else None
        if replica is None:
            return None
        if not self.fleet.takes_key(replica, tried):
            self.moves["unavailable" if not replica.alive or replica in tried else "load"] += 1
            return None
        self._pins.move_to_end(key)
        self.fleet.counts["cache_key"] += 1
        return replica

    def pin(self, key: tuple[str, str] | None, replica: Replica) -> None:
        """`key`'s next requests go to `replica` (a new key, or one that moved)."""
        if key is None:
            return
        self._pins[key] = replica
        self._pins.move_to_end(key)
        if len(self._pins) > self.max_keys:
            self._pins.popitem(last=False)
