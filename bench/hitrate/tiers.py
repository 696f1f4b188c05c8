"""The cache's tier flow replayed on a block trace: one replica's device index and spill tiers.

The device tier is the real `RadixIndex` with a real policy, one block a unit as in
`bench.hitrate.replay`; the spill tiers are the models of `bench.hitrate.keysets`; which
tier an event writes is decided by the real `WritePolicies` over a `CacheConfig` (its
default write policies: memory write-back, lmdb and redis write-through). Per request, as
`PrefixCache.lookup` and `store` do it (kvstore/cache.py, kvstore/tiers/):

1. match the longest device prefix (a hit recorded on each matched node) and lock it; the
   selective tiers count the device hits and get the leading blocks that reached
   `selective_min_hits` (`on_hit`);
2. ask the spill tiers fastest first for the rest (`TierReader.fetch_into`): each gives its
   leading run from where the previous one stopped, at most the device blocks free or
   evictable, and is asked once; room for a tier's blocks is made by evicting unlocked
   device leaves (the write-back tiers get them);
3. insert the promoted blocks and move the lock to their end; each tier's blocks fill the
   faster write-through tiers (`on_promote`);
4. "compute" the rest: evict for it, insert what fits (a prompt longer than the free and
   evictable pool is stored only in part, and only that part is written), and write it to
   the write-through tiers (`on_store`); unlock.

Two simplifications: every request records one hit on its device path, as the plain replay
does (the real cache re-matches its path to move the lock and again in `store`), and writes
land at once (the real writer is a background thread whose bounded queue may drop writes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from bench.hitrate.keysets import LOWER_TIERS, KeySet, make_keyset
from bench.traces import BlockTrace
from kvstore.config import WRITE_POLICIES, CacheConfig
from kvstore.fleet.events import EventSink
from kvstore.index import RadixIndex, TreeNode
from kvstore.index.policies import make_policy
from kvstore.index.policies.base import Policy
from kvstore.metrics import DEVICE_TIER
from kvstore.tiers.policy import WritePolicies

__all__ = [
    "KEY_BYTES",
    "TIERS",
    "BlockRequest",
    "Replica",
    "TierConfig",
    "block_requests",
    "default_write_policy",
    "key_blob",
]

KEY_BYTES = 16
TIERS = (DEVICE_TIER, *LOWER_TIERS)  # fastest first
_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CacheConfig)}


def default_write_policy(tier: str) -> str:
    """`CacheConfig`'s default write policy of spill tier `tier`."""
    return _CONFIG_DEFAULTS[f"{tier}_write_policy"]


@dataclass(frozen=True)
class TierConfig:
    """One replica's tiers: `device_blocks` of device pool, then `spill` as (tier, blocks)
    fastest first; `write_policy` (tier, policy) pairs override `CacheConfig`'s defaults."""

    device_blocks: int
    spill: tuple[tuple[str, int], ...] = ()
    write_policy: tuple[tuple[str, str], ...] = ()
    selective_min_hits: int = _CONFIG_DEFAULTS["selective_min_hits"]

    def __post_init__(self) -> None:
        if isinstance(self.device_blocks, bool) or not isinstance(self.device_blocks, int):
            raise ValueError(f"device capacity must be an int, got {self.device_blocks!r}")
        if self.device_blocks < 1:
            raise ValueError(f"device capacity must be >= 1 block, got {self.device_blocks}")
        names = [name for name, _ in self.spill]
        for name, blocks in self.spill:
            if name not in LOWER_TIERS:
                raise ValueError(f"unknown tier {name!r}; spill tiers are {LOWER_TIERS}")
            if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
                raise ValueError(f"{name} capacity must be an int >= 1 block, got {blocks!r}")
        if names != sorted(set(names), key=LOWER_TIERS.index):
            raise ValueError(f"list each spill tier once, fastest first {LOWER_TIERS}: {names}")
        for name, policy in self.write_policy:
            if name not in names:
                raise ValueError(f"write policy for {name!r}, which is not a tier here: {names}")
            if policy not in WRITE_POLICIES:
                raise ValueError(f"{name} write policy {policy!r}: choose from {WRITE_POLICIES}")
        self.cache_config()  # validates selective_min_hits

    @property
    def tiers(self) -> tuple[str, ...]:
        return (DEVICE_TIER, *(name for name, _ in self.spill))

    @property
    def capacities(self) -> dict[str, int]:
        return {DEVICE_TIER: self.device_blocks, **dict(self.spill)}

    @property
    def write_policies(self) -> dict[str, str]:
        """The write policy of every spill tier (defaults and overrides)."""
        given = dict(self.write_policy)
        return {name: given.get(name, default_write_policy(name)) for name, _ in self.spill}

    def cache_config(self) -> CacheConfig:
        policies = {f"{name}_write_policy": p for name, p in self.write_policy}
        return CacheConfig(selective_min_hits=self.selective_min_hits, **policies)


class BlockRequest(NamedTuple):
    """One request's cacheable blocks, in the forms the index and the key sets take."""

    ids: np.ndarray  # int64 dense block ids
    id_list: list[int]
    keys: list[bytes]  # each id as a 16-byte key
    tokens: np.ndarray  # uint32: each id as its one token


def key_blob(num_unique: int) -> bytes:
    """Keys of dense ids 0..U-1 back to back: id as a little-endian 16-byte integer."""
    keys = np.zeros((num_unique, 2), dtype="<u8")
    keys[:, 0] = np.arange(num_unique, dtype=np.uint64)
    return keys.tobytes()


def block_requests(trace: BlockTrace) -> Iterator[BlockRequest]:
    """The trace's requests in order, as `BlockRequest`s."""
    if trace.num_unique >= 2**32:
        raise ValueError("more than 2^32 unique blocks do not fit the uint32 token ids")
    blob, tokens = key_blob(trace.num_unique), trace.blocks.astype(np.uint32)
    offsets = trace.offsets.tolist()
    for r in range(trace.num_requests):
        lo, hi = offsets[r], offsets[r + 1]
        ids = trace.blocks[lo:hi]
        id_list = ids.tolist()
        keys = [blob[b * KEY_BYTES : (b + 1) * KEY_BYTES] for b in id_list]
        yield BlockRequest(ids, id_list, keys, tokens[lo:hi])


class Replica:
    """One cache: a device index and its spill tiers (`shared` ones are other replicas' too);
    `events` gets the index's block events (kvstore.fleet.events) and `tier_events` those of
    its own spill tiers by tier name, as a router would (a shared tier reports to the sink
    it was made with)."""

    def __init__(
        self,
        config: TierConfig,
        policy: str | Policy,
        num_unique: int,
        shared: dict[str, KeySet] | None = None,
        events: EventSink | None = None,
        tier_events: Mapping[str, EventSink] | None = None,
    ):
        if not isinstance(policy, str) and policy.entries():
            raise ValueError("a replica needs a fresh policy instance; this one has entries")
        capacity = config.device_blocks
        self.index = RadixIndex(
            1, make_policy(policy, capacity) if isinstance(policy, str) else policy, events
        )
        self.capacity = capacity
        shared, sinks = shared or {}, tier_events or {}
        self.stores: list[KeySet] = [
            shared[name]
            if name in shared
            else make_keyset(name, blocks, num_unique, sinks.get(name))
            for name, blocks in config.spill
        ]
        self.writes = WritePolicies(config.cache_config(), self.stores)  # type: ignore[arg-type]
        self._on_evict = self._write_back if self.writes.on_evict else None
        self.routed = 0  # requests served (the router's load)

    def serve(self, req: BlockRequest) -> list[int]:
        """Serve one request; returns its block hits per tier (device first)."""
        hits = [0] * (1 + len(self.stores))
        n = len(req.id_list)
        if n == 0:
            return hits
        match = self.index.match_prefix(req.keys, req.tokens)
        hits[0] = pos = match.num_blocks
        node = self._lock(match.last_node)
        self._selective(req, pos)
        if pos < n and self.stores:
            pos, node = self._promote(req, pos, hits, node)
        self._store(req, pos)
        if node is not None:
            self.index.unlock(node)
        return hits

    def _lock(self, node: TreeNode) -> TreeNode | None:
        if node is self.index.root:
            return None
        self.index.lock(node)
        return node

    def _free(self, pending: int = 0) -> int:
        return self.capacity - self.index.num_cached_blocks - pending

    def _evict(self, num_blocks: int) -> None:
        if num_blocks > 0:
            self.index.evict(num_blocks, self._on_evict)

    def _write_back(self, node: TreeNode, start: int, block_ids: list[int]) -> None:
        self._write(self.writes.on_evict, block_ids)

    def _write(self, targets: Sequence[int], ids: Sequence[int]) -> None:
        for t in targets:
            self.stores[t].put(ids)

    def _selective(self, req: BlockRequest, hit: int) -> None:
        """Device hits count towards the selective tiers' threshold (`Tiers.on_hit`)."""
        if self.writes.on_hit and hit:
            reached = self.writes.count_hits(req.keys[:hit])
            if reached:
                self._write(self.writes.on_hit, req.id_list[:reached])

    def _fetch(self, req: BlockRequest, pos: int, hits: list[int]) -> list[tuple[int, int, int]]:
        """Read the spill tiers fastest first from block `pos`, making device room for what
        each gives; returns (tier, start, stop) per tier that gave blocks."""
        segments, pending, n = [], 0, len(req.id_list)
        for t, store in enumerate(self.stores):
            if pos >= n:
                break
            run = store.run(req.ids[pos:])
            got = min(run, self._free(pending) + self.index.num_evictable_blocks)
            if got <= 0:
                continue
            self._evict(got - self._free(pending))
            pending += got
            hits[t + 1] += got
            segments.append((t, pos, pos + got))
            pos += got
        return segments

    def _promote(
        self, req: BlockRequest, hit: int, hits: list[int], node: TreeNode | None
    ) -> tuple[int, TreeNode | None]:
        """Steps 2-3: fetch, insert the promoted blocks, move the lock, fill faster tiers."""
        segments = self._fetch(req, hit, hits)
        if not segments:
            return hit, node
        pos = segments[-1][2]
        self.index.insert(req.keys[:pos], req.tokens[:pos], req.id_list[:pos])
        moved = self._lock(self.index.peek_prefix(req.keys[:pos], req.tokens[:pos]).last_node)
        if node is not None:
            self.index.unlock(node)
        for t, start, stop in segments:
            self._write(self.writes.on_promote(self.stores[t].name), req.id_list[start:stop])
        return pos, moved

    def _store(self, req: BlockRequest, pos: int) -> None:
        """Step 4: the computed blocks, as much as fits, into the device and written through."""
        n = len(req.id_list)
        self._evict(n - pos - self._free())
        fit = pos + min(n - pos, self._free())
        if fit > pos:
            self.index.insert(req.keys[:fit], req.tokens[:fit], req.id_list[:fit])
            self._write(self.writes.on_store, req.id_list[pos:fit])
