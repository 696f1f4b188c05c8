"""Spill-tier events end to end: a replica's cache with a host-memory or Redis tier
publishes every medium on ZMQ; the router's subscriber rebuilds each medium's blocks, and
the router prices a prefix by where it is held: a replica whose host tier holds it wins over
a cold one, and a block in a shared Redis counts for every replica that reads it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import pytest

from engine.events.publisher import EventsConfig, EventSubscriber, ZmqEventPublisher
from engine.router.config import RouterConfig
from engine.router.fleet import Fleet
from kvstore.cache import PrefixCache
from kvstore.fleet.events import (
    MEDIUM_HOST,
    MEDIUM_REDIS,
    EventSink,
    KVEvent,
    MediaBlocks,
)
from kvstore.stores import MemoryStore, RedisStore, SpillStore
from tests.tiers.tier_events_helpers import (
    BS,
    device_blocks,
    make_cache,
    memory_store,
    run_prompts,
    tier_blocks,
)

LOOPBACK = "tcp://127.0.0.1:*"


class Counted(EventSink):
    def __init__(self, sink: EventSink):
        self.sink, self.count = sink, 0

    def emit(self, event: KVEvent) -> None:
        self.count += 1
        self.sink.emit(event)


class Replica:
    """A cache over `store` whose events go out on loopback."""

    def __init__(self, store: SpillStore):
        config = EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK, heartbeat_s=0.1)
        self.pub = ZmqEventPublisher(config, snapshot=lambda: self.cache.snapshot_events())
        self.counted = Counted(self.pub)
        self.store = store
        self.cache: PrefixCache = make_cache(store, self.counted)

    def info(self) -> dict:
        """What its /health says under "cache"."""
        port = int(self.pub.endpoint.rsplit(":", 1)[1])
        replay = int(self.pub.replay_endpoint.rsplit(":", 1)[1])
        tier = {"name": self.store.name, "medium": None, "shared": self.store.identity()}
        tier["medium"] = MEDIUM_REDIS if self.store.name == "redis" else MEDIUM_HOST
        return {
            "block_size": BS,
            "namespace": dataclasses.asdict(self.cache.namespace),
            "kv_events": {"port": port, "replay_port": replay},
            "tiers": [tier],
        }

    def caught_up(self, sub: EventSubscriber) -> Callable[[], bool]:
        assert self.cache.tiers.flush(10)
        wait_until(lambda: self.pub.published_events == self.counted.count)
        target = self.pub.last_seq
        return lambda: sub.synced and sub.last_seq >= target

    def close(self) -> None:
        self.cache.close()
        self.pub.close()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def replicas() -> Iterator[Callable[[SpillStore], Replica]]:
    made: list[Replica] = []

    def make(store: SpillStore) -> Replica:
        made.append(Replica(store))
        return made[-1]

    yield make
    for replica in made:
        replica.close()


def fleet_over(reps: list[Replica], tier_events: bool = True) -> Fleet:
    """A router's fleet attached to `reps` as its health loop attaches replicas."""
    urls = tuple(f"http://127.0.0.1:{9000 + i}" for i in range(len(reps)))
    fleet = Fleet(RouterConfig(replicas=urls, tier_events=tier_events))
    for replica, rep in zip(fleet.replicas, reps, strict=True):
        replica.alive = True
        fleet._attach(replica, rep.info())
    return fleet


def close(fleet: Fleet) -> None:
    for replica in fleet.replicas:
        replica.events.close()


def test_a_subscriber_rebuilds_a_replicas_device_and_host_tier_over_the_wire(replicas):
    replica = replicas(memory_store(30))
    sub = EventSubscriber(replica.pub.endpoint, replica.pub.replay_endpoint, replay_timeout_s=0.3)
    with sub:
        chains = run_prompts(replica.cache, 40)
        wait_until(replica.caught_up(sub))
        assert replica.store.stats().evictions > 0
        assert sub.media.tiers[MEDIUM_HOST].blocks == tier_blocks(replica.store, chains, 1)
        assert sub.blocks.blocks == device_blocks(replica.cache)


def test_the_router_sends_a_prefix_to_the_replica_whose_host_tier_holds_it(replicas):
    warm, cold = replicas(memory_store(1000)), replicas(memory_store(1000))
    fleet = fleet_over([warm, cold])
    device_only = fleet_over([warm, cold], tier_events=False)
    try:
        chains = run_prompts(warm.cache, 10)
        for f in (fleet, device_only):
            for replica in f.replicas:
                wait_until(lambda r=replica, f=f: f.blocks(r) is not None)
        wait_until(warm.caught_up(fleet.replicas[0].events))
        wait_until(warm.caught_up(device_only.replicas[0].events))
        keys = chains[0]  # long gone from the warm replica's 12-block pool, in its host tier
        num_tokens = len(keys) * BS + 1
        chosen, choice = fleet.choose(num_tokens, keys)
        assert chosen is fleet.replicas[0]
        assert choice.num_cached_tokens == len(keys) * BS
        assert isinstance(fleet.blocks(chosen), MediaBlocks)
        # fed device events alone, the router sees no replica holding it
        assert device_only.cached_tokens(device_only.replicas[0], num_tokens, keys) == 0
        assert device_only.choose(num_tokens, keys)[1].num_cached_tokens == 0
    finally:
        close(fleet)
        close(device_only)


def test_a_block_one_replica_wrote_to_a_shared_redis_counts_for_every_reader(
    replicas, redis_server
):
    writer = replicas(RedisStore(redis_server.url, "ns"))
    reader = replicas(RedisStore(redis_server.url, "ns"))
    fleet = fleet_over([writer, reader])
    try:
        assert len(fleet.shared) == 1  # one identity: the same server, no secret in it
        chains = run_prompts(writer.cache, 6)
        wait_until(writer.caught_up(fleet.replicas[0].events))
        keys = chains[0]
        full = len(keys) * BS
        for replica in fleet.replicas:
            assert fleet.cached_tokens(replica, full + 1, keys) == full
        assert fleet.tier_blocks(fleet.replicas[1]) == {MEDIUM_REDIS: len(set().union(*chains))}
        # the reader restarts (a new publisher on its ports: the subscriber drops what it
        # knew of it and replays from 0); the shared set is kept, and still its set
        shared = fleet.shared[writer.store.identity()]
        sub = fleet.replicas[1].events
        endpoints = (reader.pub.endpoint, reader.pub.replay_endpoint)
        reader.pub.close()
        reader.pub = ZmqEventPublisher(EventsConfig(*endpoints, heartbeat_s=0.1))
        wait_until(lambda: sub.restarts == 1 and sub.synced)
        assert sub.media.tiers[MEDIUM_REDIS] is shared
        assert shared.blocks == set().union(*chains)
    finally:
        close(fleet)


def test_host_memory_is_private_and_a_redis_identity_carries_no_secret():
    assert MemoryStore(1 << 20).identity() is None
    store = RedisStore("redis://user:hunter2@127.0.0.1:1/3", "ns")
    assert store.identity() == "redis://127.0.0.1:1/3"
    store.close()
