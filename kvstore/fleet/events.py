"""Index events: what the device index stored and removed, for routers that index a fleet.

The shapes are those of vLLM's KV events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`),
so a replica can be indexed as vLLM replicas are; the wire format (ZMQ, msgpack) is the
transport's (`engine/events/publisher.py`), never this layer's. Block hashes are the 16-byte lookup
keys; the first block of a chain has no parent (`None`), as in vLLM.

Media (vLLM's `medium` field, one vocabulary for the publisher, the router and the replay):
a device pool is `GPU` or `CPU` (vLLM's names; `CPU` for a pool on the CPU), a spill tier is
`HOST` (host memory), `DISK` (LMDB) or `REDIS` (Redis or Redis Cluster, a tier several
replicas may share). `CPU` cannot also name the host-memory tier: on a CPU engine it is the
device pool's. `MediaBlocks` keeps one `BlockSet` per medium of a replica.

A spill tier stores entries of `chunk_blocks` blocks (docs/FORMAT.md): each of its
`BlockStored` events is one entry, whose blocks are fetched together or not at all, and its
`BlockRemoved` events list whole entries' blocks. A block that leaves the device pool and
stays in a tier gets a device `BlockRemoved` only: it is still in the tier's set.

Invariant a consumer can rely on: applying every event of one index (one medium) in order,
as set operations on block hashes, gives exactly the index's cached blocks. Each event is idempotent
as a set operation, so a snapshot (`RadixIndex.snapshot`) followed by any suffix of events
that includes everything after it converges to the same set.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from hashing import BlockHash

__all__ = [
    "DEVICE_MEDIA",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_GPU",
    "MEDIUM_HOST",
    "MEDIUM_REDIS",
    "SPILL_MEDIA",
    "TIER_MEDIUM",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockSet",
    "BlockStored",
    "EventSink",
    "KVEvent",
    "MediaBlocks",
]

MEDIUM_GPU, MEDIUM_CPU = "GPU", "CPU"  # a device pool, by where it lives
MEDIUM_HOST, MEDIUM_DISK, MEDIUM_REDIS = "HOST", "DISK", "REDIS"  # spill tiers
DEVICE_MEDIA = (MEDIUM_GPU, MEDIUM_CPU)
SPILL_MEDIA = (MEDIUM_HOST, MEDIUM_DISK, MEDIUM_REDIS)  # fastest first
TIER_MEDIUM = {"memory": MEDIUM_HOST, "lmdb": MEDIUM_DISK, "redis": MEDIUM_REDIS}  # tier name


class BlockStored(NamedTuple):
    """Consecutive blocks of one chain entered the index (or, with a spill `medium`, one
    entry of that tier: its blocks are fetched together or not at all)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None  # the block before the first; None at a chain's start
    token_ids: list[int]  # block_size per block, in order
    block_size: int
    medium: str | None = None  # None: the publisher's device pool


class BlockRemoved(NamedTuple):
    """Blocks left the index (evicted), or whole entries left a spill `medium`."""

    block_hashes: list[BlockHash]
    medium: str | None = None  # None: the publisher's device pool


class AllBlocksCleared(NamedTuple):
    """Every block left the index (or a publisher started: consumers drop what they had)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventSink(ABC):
    """Receives an index's events in order. `emit` is called under the cache's lock, so it
    must be quick (append to a queue) and must not call back into the cache."""

    @abstractmethod
    def emit(self, event: KVEvent) -> None:
        """Take one event."""


class BlockSet(EventSink):
    """The blocks of one index as its events describe them (a consumer's view); as a sink
    it applies each event as it comes, whatever its medium (`MediaBlocks` tells them apart)."""

    def __init__(self) -> None:
        self.blocks: set[BlockHash] = set()
        # a spill entry of several blocks, by its last block: removing that key removes all
        self.entries: dict[BlockHash, list[BlockHash]] = {}

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self.blocks.update(event.block_hashes)
            if event.medium is not None and len(event.block_hashes) > 1:
                self.entries[event.block_hashes[-1]] = event.block_hashes
        elif isinstance(event, BlockRemoved):
            self.blocks.difference_update(event.block_hashes)
            for key in event.block_hashes if self.entries else ():
                self.blocks.difference_update(self.entries.pop(key, ()))
        elif isinstance(event, AllBlocksCleared):
            self.blocks.clear()
            self.entries.clear()
        else:
            raise TypeError(f"not a KV event: {type(event).__name__}")

    def emit(self, event: KVEvent) -> None:
        self.apply(event)

    def apply_all(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(event)

    def __contains__(self, key: object) -> bool:
        return key in self.blocks

    def num_prefix_blocks(self, keys: Sequence[BlockHash]) -> int:
        """Leading `keys` held: blocks a request with those keys would find cached here."""
        n = 0
        for key in keys:
            if key not in self.blocks:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self.blocks)


class MediaBlocks(EventSink):
    """One replica's blocks per medium, by its events: `device` (its pool, whatever its
    medium) and `tiers`, a `BlockSet` per spill medium (`SPILL_MEDIA`). A shared tier's set
    is the same object in every replica that reads it: its blocks count for each of them.

    As a sink it routes each event by its medium: the device's (`None`, `GPU`, `CPU`) to
    `device`, a spill medium's to its set (made on its first event unless it is `shared`).
    `AllBlocksCleared` clears the device and the private tiers, never a shared one: a
    replica that restarts has lost its pool, not what the other readers of Redis wrote."""

    def __init__(
        self,
        device: BlockSet,
        tiers: Mapping[str, BlockSet] | None = None,
        shared: Iterable[str] = (),
    ):
        tiers = dict(tiers or {})
        for medium in tiers:
            _check_spill(medium)
        self.device = device
        self.tiers = tiers
        self.shared = frozenset(shared)  # media whose sets other replicas share
        for medium in self.shared:
            _check_spill(medium)
            if medium not in tiers:
                raise ValueError(f"shared medium {medium!r} needs its set in `tiers`")

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self.device.apply(event)
            for medium, blocks in self.tiers.items():
                if medium not in self.shared:
                    blocks.apply(event)
            return
        medium = getattr(event, "medium", None)
        if medium is None or medium in DEVICE_MEDIA:
            self.device.apply(event)
            return
        _check_spill(medium)
        self.tiers.setdefault(medium, BlockSet()).apply(event)

    def emit(self, event: KVEvent) -> None:
        self.apply(event)

    def apply_all(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(event)

    def copy(self) -> MediaBlocks:
        """Its own sets copied, the shared ones the same objects."""
        tiers = {m: s if m in self.shared else _copied(s) for m, s in self.tiers.items()}
        return MediaBlocks(_copied(self.device), tiers, self.shared)

    def num_blocks(self) -> int:
        """Blocks its device and its private tiers hold (a shared tier's are not its own)."""
        private = sum(len(s) for m, s in self.tiers.items() if m not in self.shared)
        return len(self.device) + private


def _check_spill(medium: str) -> None:
    if medium not in SPILL_MEDIA:
        raise ValueError(f"unknown spill medium {medium!r}; choose from {SPILL_MEDIA}")


def _copied(blocks: BlockSet) -> BlockSet:
    copy = BlockSet()
    copy.blocks, copy.entries = set(blocks.blocks), dict(blocks.entries)
    return copy
