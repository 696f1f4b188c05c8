"""Cache-aware routing: pick the replica where a request's first token comes soonest.

One implementation for the live router (`kvstore router`, engine/router/) and the capacity
replay's `kv` route (bench/hitrate/fleet.py). Each replica is known by

- its blocks, rebuilt from the replica's own events (kvstore/fleet/events.py), never guessed
  from the requests routed to it: a `BlockSet` of its device pool, or a `MediaBlocks` with a
  set per spill medium too (host memory, LMDB, Redis; a shared Redis's set is the same object
  for every replica that reads it);
- its load, as the replica reports it: tokens waiting for prefill and tokens held by
  running requests.

The cost of sending a request to replica r is the work ahead of its first token there:

    cost(r) = prefill_weight * (uncached_tokens(r) + queued_tokens(r))
              + prefill_weight * block_size * sum of load(b) over the prefix blocks b it holds
              - prefill_weight * block_size * device_affinity * its prefix blocks on device
              + decode_weight * running_tokens(r)

Each block of the prompt's prefix is priced by the cheapest medium that holds it on r: the
device is free, a spill medium costs its `*_block_cost` (a fraction of computing the block
again), or the fraction replica r measured itself when it publishes one (its read gate's
fetch time over its prefill time per block, capped at 1: a tier dearer than computing is
not read there, kvstore/tiers/gate.py). The prefix ends at the first block no medium
holds: the cache computes every block after it anyway. With device blocks only (a
`BlockSet`) the load sum is 0.

`device_affinity` values a device copy beyond the prefill it saves now: a turn sent
elsewhere strands it (the conversation's next turns would hit it there) and makes another
replica's device hold the prefix too. Without it, a replica busier by a little more than
what a shared Redis copy costs over its device copy loses its conversations to replicas
that read them from Redis, and device hits fall below session routing's (docs/BENCHMARKS.md,
"Replicas and routes").

The cheapest replica wins (ties: the fewer requests routed, then the lower index). Cache
overlap alone would pile every request onto the replica that holds the most (every prompt
shares its first block with it); the load terms move work away from a busy replica once
its queue costs more than the prefill the cache saves. A replica whose events are stale
(`None` for its blocks) makes the decision fall back to least loaded: an overlap that may be
wrong must not outweigh load.

A request's `prompt_cache_key` (OpenAI's routing hint) keeps it on the replica its key last
went to while that replica's work ahead (`load_cost`: the cost's terms that do not depend on
the request) exceeds the least loaded candidate's by at most `key_load_slack`
(`within_key_bound`); past that bound the request is routed by cost and the key moves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from hashing import BlockHash
from kvstore.fleet.events import MEDIUM_DISK, MEDIUM_HOST, MEDIUM_REDIS, BlockSet, MediaBlocks

__all__ = [
    "HeldPrefix",
    "ReplicaLoad",
    "RouteChoice",
    "RoutingConfig",
    "choose_replica",
    "held_prefix",
    "load_cost",
    "within_key_bound",
]


@dataclass(frozen=True)
class RoutingConfig:
    """Weights of the routing cost, in prefill-token units (module docstring)."""

    prefill_weight: float = 1.0  # per token to prefill: this request's uncached + queued
    decode_weight: float = 0.1  # per token of KV held by running requests
    # how much more work ahead (`load_cost`) than the least loaded replica a prompt_cache_key's
    # replica may have and still take the key's next request: about a long shared prefix's
    # prefill, so a key moves once the queue ahead of it costs more than computing it again
    key_load_slack: float = 4096.0
    # loading a block from a spill tier, as a fraction of computing it again (block_size *
    # prefill_weight). On a CPU replica (docs/BENCHMARKS.md, `bench io` read bandwidths against
    # `bench ttft` prefill) they are under 0.01 for host memory and LMDB and 0.01-0.03 for
    # Redis; on a GPU prefill is far faster while a load still crosses PCIe, a disk or the
    # network, so the defaults are estimates for a GPU replica, in the tiers' order of speed
    host_block_cost: float = 0.05  # host-memory tier (medium HOST)
    disk_block_cost: float = 0.2  # LMDB (DISK)
    redis_block_cost: float = 0.5  # Redis, shared or not (REDIS)
    # each prefix block a replica holds on its device is also worth this fraction of a
    # block's prefill there: a turn sent elsewhere strands the device copy its conversation's
    # next turns would hit, and a tier copy elsewhere must be loaded into a device again
    device_affinity: float = 1.0

    def __post_init__(self) -> None:
        names = ("prefill_weight", "decode_weight", "key_load_slack", "device_affinity")
        for name in (*names, *_BLOCK_COSTS.values()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in _BLOCK_COSTS.values():
            if getattr(self, name) > 1:  # a tier dearer than computing would never be read
                raise ValueError(
                    f"{name} must be <= 1 (a block's prefill), got {getattr(self, name)!r}"
                )

    def block_cost(self, medium: str) -> float:
        """Loading one block from spill `medium`, as a fraction of computing it."""
        name = _BLOCK_COSTS.get(medium)
        if name is None:
            raise ValueError(
                f"no load cost for medium {medium!r}; spill media are {list(_BLOCK_COSTS)}"
            )
        return getattr(self, name)


_BLOCK_COSTS = {
    MEDIUM_HOST: "host_block_cost",
    MEDIUM_DISK: "disk_block_cost",
    MEDIUM_REDIS: "redis_block_cost",
}


class ReplicaLoad(NamedTuple):
    """A replica's work in flight, in tokens, as it reports it."""

    queued_tokens: int = 0  # prompt tokens admitted and not yet prefilled
    running_tokens: int = 0  # KV tokens (prompt + generated) of running requests
    routed: int = 0  # requests routed to it so far (the tie-break)


class RouteChoice(NamedTuple):
    replica: int
    num_cached_tokens: int  # the chosen replica's cached prefix, by its events
    costs: list[float]  # per replica (inf: not a candidate)
    fallback: bool  # True: chosen by load alone (some replica's events were stale)


def load_cost(load: ReplicaLoad, config: RoutingConfig) -> float:
    """The work ahead of a new request's first token on a replica, whatever it holds."""
    return config.prefill_weight * load.queued_tokens + config.decode_weight * load.running_tokens


def _cost(uncached: int, tier_load: float, load: ReplicaLoad, config: RoutingConfig) -> float:
    return config.prefill_weight * (uncached + tier_load) + load_cost(load, config)


class HeldPrefix(NamedTuple):
    """What a replica holds of a prompt's prefix, by its events."""

    num_blocks: int  # leading blocks some medium holds
    tier_load: float  # the sum of their load fractions (each at its cheapest medium)
    num_device: int  # of them, those on the device

    def weight(self, config: RoutingConfig) -> float:
        """Tier loads less the device's affinity, in blocks' prefill."""
        return self.tier_load - config.device_affinity * self.num_device


def held_prefix(
    held: BlockSet | MediaBlocks,
    keys: Sequence[BlockHash],
    config: RoutingConfig,
    measured: Mapping[str, float] | None = None,
) -> HeldPrefix:
    """The leading `keys` some medium of the replica holds: each block at its cheapest
    medium, the device free. `measured`: the replica's own load cost per medium (its read
    gate's figures), which replace the configured ones."""
    if not isinstance(held, MediaBlocks):
        n = held.num_prefix_blocks(keys)
        return HeldPrefix(n, 0.0, n)
    costs = measured or {}
    # the raw sets, cheapest first: this runs per replica for every request routed
    tiers = [(costs.get(m, config.block_cost(m)), s.blocks) for m, s in held.tiers.items()]
    tiers.sort(key=lambda tier: tier[0])
    device, load = held.device, 0.0
    n = on_device = device.num_prefix_blocks(keys)
    for key in keys[n:]:
        if key in device:
            on_device += 1
        else:
            for cost, blocks in tiers:
                if key in blocks:
                    load += cost
                    break
            else:
                break  # no medium holds it: this block and every later one are computed
        n += 1
    return HeldPrefix(n, load, on_device)


def within_key_bound(
    pinned: int, loads: Sequence[ReplicaLoad], candidates: Sequence[int], config: RoutingConfig
) -> bool:
    """Whether replica `pinned` (one of `candidates`) may take its prompt_cache_key's next
    request: its `load_cost` is at most `key_load_slack` above the least loaded candidate's."""
    least = min(load_cost(loads[i], config) for i in candidates)
    return load_cost(loads[pinned], config) <= least + config.key_load_slack


def choose_replica(
    keys: Sequence[BlockHash],
    num_prompt_tokens: int,
    block_size: int,
    blocks: Sequence[BlockSet | MediaBlocks | None],
    loads: Sequence[ReplicaLoad],
    config: RoutingConfig,
    candidates: Sequence[int] | None = None,
    measured: Sequence[Mapping[str, float] | None] | None = None,
) -> RouteChoice:
    """The replica among `candidates` (default all) with the cheapest cost for a prompt of
    `num_prompt_tokens` whose whole blocks have the lookup keys `keys`. A replica holding
    every block still computes the last token (it runs it again for its logits), and still
    loads every block it holds in a spill tier: at `measured[i]`'s cost per medium where
    replica i published one (`held_prefix`), else the configured one."""
    pool = range(len(loads)) if candidates is None else candidates
    if not pool:
        raise ValueError("no replica to route to")
    fallback = any(blocks[i] is None for i in pool)
    costs, cached = [math.inf] * len(loads), [0] * len(loads)
    for i in pool:
        held, weight = blocks[i], 0.0
        if not fallback and held is not None:
            prefix = held_prefix(held, keys, config, measured[i] if measured else None)
            cached[i], weight = prefix.num_blocks * block_size, prefix.weight(config)
        cached[i] = min(cached[i], max(num_prompt_tokens - 1, 0))  # the last token is computed
        uncached = num_prompt_tokens - cached[i]
        costs[i] = _cost(uncached, weight * block_size, loads[i], config)
    best = min(pool, key=lambda i: (costs[i], loads[i].routed, i))
    return RouteChoice(best, cached[best], costs, fallback)
