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

Invariant a consumer can rely on: applying every event of one index in order, as set
operations on block hashes, gives exactly the index's cached blocks. Each event is idempotent
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
    """Consecutive blocks of one chain entered the index."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None  # the block before the first; None at a chain's start
    token_ids: list[int]  # block_size per block, in order
    block_size: int


class BlockRemoved(NamedTuple):
    """Blocks left the index (evicted)."""

    block_hashes: list[BlockHash]


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
    it applies each event as it comes."""

    def __init__(self) -> None:
        self.blocks: set[BlockHash] = set()

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self.blocks.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self.blocks.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.blocks.clear()
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


class MediaBlocks:
    """One replica's blocks per medium, by its events: `device` (its pool, whatever its
    medium) and `tiers`, a `BlockSet` per spill medium (`SPILL_MEDIA`). A shared tier's set
    is the same object in every replica that reads it: its blocks count for each of them."""

    def __init__(self, device: BlockSet, tiers: Mapping[str, BlockSet] | None = None):
        tiers = dict(tiers or {})
        for medium in tiers:
            if medium not in SPILL_MEDIA:
                raise ValueError(f"unknown spill medium {medium!r}; choose from {SPILL_MEDIA}")
        self.device = device
        self.tiers = tiers
