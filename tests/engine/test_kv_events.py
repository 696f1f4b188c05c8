"""KV events over ZMQ: a real PrefixCache's events, published on loopback sockets in vLLM's
format, rebuild exactly the cache's blocks in a subscriber, through late starts, replay,
snapshots, gaps, restarts and silence."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import msgspec
import numpy as np
import pytest
import torch
import zmq

from bench.launch import free_port
from engine.events.publisher import (
    EventsConfig,
    EventSubscriber,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
    medium_for,
)
from engine.events.wire import END_SEQ, decode_wire
from hashing import Namespace
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig, ConfigError
from kvstore.fleet.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockSet,
    BlockStored,
    EventSink,
    KVEvent,
)

LAYERS, HEADS, BS, DIM = 2, 2, 4, 8
LOOPBACK = "tcp://127.0.0.1:*"


class Tee(EventSink):
    """Records the cache's events and forwards them (all but those `drop` rejects)."""

    def __init__(self, sink: EventSink, drop: Callable[[KVEvent], bool] = lambda e: False):
        self.sink, self.drop = sink, drop
        self.events: list[KVEvent] = []
        self.dropped: list[KVEvent] = []

    def emit(self, event: KVEvent) -> None:
        self.events.append(event)
        if self.drop(event):
            self.dropped.append(event)
        else:
            self.sink.emit(event)


def make_cache(events: EventSink, num_blocks: int = 16) -> PrefixCache:
    ns = Namespace("fp", "float32", LAYERS, HEADS, DIM, BS)
    config = CacheConfig(block_size=BS, device_blocks=num_blocks, device="cpu")
    return PrefixCache(config, ns, events=events)


def run_workload(cache: PrefixCache, num_prompts: int, seed: int = 0) -> None:
    """Prompts on a few shared prefixes: hits, stores, and evictions (16 pool blocks)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 1000, 3 * BS) for _ in range(3)]
    for i in range(num_prompts):
        tail = rng.integers(0, 1000, BS * int(rng.integers(1, 5)) + 1)
        prompt = np.concatenate([prefixes[i % 3], tail]).astype(np.uint32)
        hit = cache.lookup(prompt)
        kv = torch.zeros(1, HEADS, len(prompt), DIM)
        cache.store(prompt, [(kv, kv)] * LAYERS, keys=hit.keys)
        cache.release(hit)
    cache.check_integrity()


def cached_keys(cache: PrefixCache) -> set[bytes]:
    keys = {key for event in cache.snapshot_events() for key in event.block_hashes}
    assert len(keys) == len(cache.index.all_block_ids())
    return keys


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def caught_up(sub: EventSubscriber, pub: ZmqEventPublisher, tee: Tee) -> Callable[[], bool]:
    """Once every event the cache emitted is published: the subscriber applied it."""
    wait_until(lambda: pub.published_events == len(tee.events) - len(tee.dropped))
    target = pub.last_seq
    return lambda: sub.synced and sub.last_seq >= target


class Replica:
    """A cache whose events a publisher sends (through a Tee), with its snapshot."""

    def __init__(self, snapshot: bool = True, **kw):
        kw = {"endpoint": LOOPBACK, "replay_endpoint": LOOPBACK, "heartbeat_s": 0.1, **kw}
        hook = (lambda: self.cache.snapshot_events()) if snapshot else None
        self.pub = ZmqEventPublisher(EventsConfig(**kw), snapshot=hook)
        self.tee = Tee(self.pub)
        self.cache = make_cache(self.tee)

    def keys(self) -> set[bytes]:
        return cached_keys(self.cache)

    def caught_up(self, sub: EventSubscriber) -> Callable[[], bool]:
        return caught_up(sub, self.pub, self.tee)


@pytest.fixture
def replicas() -> Iterator[Callable[..., Replica]]:
    made: list[Replica] = []

    def make(**kw) -> Replica:
        made.append(Replica(**kw))
        return made[-1]

    yield make
    for replica in made:
        replica.pub.close()


@pytest.fixture
def subscribers() -> Iterator[Callable[..., EventSubscriber]]:
    made: list[EventSubscriber] = []

    def make(replica: Replica, cls: type = EventSubscriber, **kw) -> EventSubscriber:
        kw = {"replay_timeout_s": 0.3, "retry_s": 0.05, **kw}
        pub = replica.pub
        made.append(cls(pub.endpoint, pub.replay_endpoint, **kw).start())
        return made[-1]

    yield make
    for sub in made:
        sub.close()


def replay_all(pub: ZmqEventPublisher, start: int = 0) -> list[tuple[int, bytes]]:
    """Every batch from `start` through a plain DEALER, as a vLLM consumer asks for them."""
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert dealer.poll(2000), "no replay answer"
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return out
            assert topic == pub.config.topic.encode()
            out.append((int.from_bytes(seq, "big"), payload))


# --- the format ---------------------------------------------------------------------------


def test_a_batch_encodes_as_vllm_lays_it_out_and_decodes_back():
    h = [bytes([i]) * 16 for i in range(3)]
    events = [
        AllBlocksCleared(),
        BlockStored(h[:2], None, list(range(2 * BS)), BS),
        BlockStored(h[2:], h[1], list(range(BS)), BS),
        BlockRemoved(h[1:]),
    ]
    payload = encode_batch(12.5, events, medium_for(torch.device("cpu")))
    assert decode_batch(payload) == (12.5, events)
    raw = msgspec.msgpack.decode(payload)  # an array-like batch of map-like events
    assert raw[0] == 12.5 and raw[2] == 0 and len(raw) == 3
    types = ["AllBlocksCleared", "BlockStored", "BlockStored", "BlockRemoved"]
    assert [e["type"] for e in raw[1]] == types
    assert raw[1][1] == {
        "type": "BlockStored", "block_hashes": h[:2], "parent_block_hash": None,
        "token_ids": list(range(2 * BS)), "block_size": BS, "lora_id": None, "medium": "CPU",
        "lora_name": None,
    }  # fmt: skip
    assert raw[1][3] == {"type": "BlockRemoved", "block_hashes": h[1:], "medium": "CPU"}
    assert decode_wire(payload).events[3].medium == "CPU"
    assert medium_for(torch.device("cuda", 1)) == medium_for("cuda") == "GPU"


def test_events_config_names_the_bad_field():
    for bad, field in (({"endpoint": "localhost:5557"}, "endpoint"),
                       ({"replay_endpoint": "tcp://*:5557"}, "replay_endpoint"),
                       ({"buffer_batches": 0}, "buffer_batches"),
                       ({"flush_interval_ms": 0}, "flush_interval_ms"),
                       ({"heartbeat_s": -1}, "heartbeat_s"),
                       ({"medium": "TPU"}, "medium")):  # fmt: skip
        with pytest.raises(ConfigError) as e:
            EventsConfig(**bad)
        assert e.value.field == field


# --- a cache's events, end to end ------------------------------------------------------------


def test_a_cache_run_with_evictions_arrives_decoded_and_rebuilds_its_blocks(replicas, subscribers):
    replica = replicas(buffer_batches=100_000)
    sub = subscribers(replica)
    run_workload(replica.cache, 40)
    evicted = replica.cache.metrics.get("evicted_blocks_total")
    assert evicted > 0
    wait_until(replica.caught_up(sub))
    assert sub.blocks.blocks == replica.keys()
    assert (sub.gaps, sub.restarts, sub.bad_batches) == (0, 0, 0)
    # every event, in order and unchanged, after the publisher's opening AllBlocksCleared
    batches = replay_all(replica.pub)
    assert [seq for seq, _ in batches] == list(range(replica.pub.last_seq + 1))
    decoded = [event for _, payload in batches for event in decode_batch(payload)[1]]
    assert decoded == [AllBlocksCleared(), *replica.tee.events]
    removed = [e for e in replica.tee.events if isinstance(e, BlockRemoved)]
    assert sum(len(e.block_hashes) for e in removed) == evicted
    assert replica.pub.snapshots == 0


def test_a_late_subscriber_catches_up_by_replay(replicas, subscribers):
    replica = replicas()
    run_workload(replica.cache, 30)
    wait_until(lambda: replica.pub.published_events == len(replica.tee.events))
    sub = subscribers(replica)
    wait_until(replica.caught_up(sub))
    assert sub.blocks.blocks == replica.keys()
    assert (replica.pub.replays, replica.pub.snapshots, sub.replays) == (1, 0, 1)
    run_workload(replica.cache, 10, seed=1)  # and then it follows the stream
    wait_until(replica.caught_up(sub))
    assert sub.blocks.blocks == replica.keys()


def test_a_subscriber_after_the_buffer_rolled_over_catches_up_from_the_snapshot(
    replicas, subscribers
):
    replica = replicas(buffer_batches=4, flush_interval_ms=1.0)
    for seed in range(8):  # batches apart
        run_workload(replica.cache, 4, seed=seed)
        time.sleep(0.01)
    wait_until(lambda: replica.pub.last_seq >= 8)
    (snapshot,) = replay_all(replica.pub)  # seq 0 is gone: the answer is one snapshot
    assert snapshot[0] >= 8
    sub = subscribers(replica)
    wait_until(replica.caught_up(sub))
    assert sub.blocks.blocks == replica.keys()
    assert replica.pub.snapshots == 2
    run_workload(replica.cache, 12, seed=99)  # the snapshot, then every later batch
    wait_until(replica.caught_up(sub))
    assert sub.blocks.blocks == replica.keys()


def test_without_a_snapshot_a_rolled_over_buffer_under_counts_never_over_claims(
    replicas, subscribers
):
    replica = replicas(snapshot=False, buffer_batches=2, flush_interval_ms=1.0)
    cache = replica.cache
    kept = np.arange(3 * BS + 1, dtype=np.uint32)
    kv = torch.zeros(1, HEADS, len(kept), DIM)
    assert cache.store(kept, [(kv, kv)] * LAYERS) == 3
    hit = cache.lookup(kept)  # locked: its blocks stay cached, their event rolls out
    for seed in range(6):
        time.sleep(0.01)
        run_workload(cache, 4, seed=seed)
    sub = subscribers(replica)
    wait_until(replica.caught_up(sub))
    assert sub.blocks.blocks < replica.keys()
    assert set(hit.keys) <= replica.keys() - sub.blocks.blocks
    cache.release(hit)


class Partitioned(EventSubscriber):
    """Loses the PUB batches whose seqs are in `lost`; while `cut`, loses them all and
    misses that the connection dropped (a partition it cannot see)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.lost: set[int] = set()
        self.cut = False

    def _on_pub(self, seq: int, payload: bytes) -> None:
        if self.cut or seq in self.lost:
            self.lost.discard(seq)
            return
        super()._on_pub(seq, payload)

    def _disconnected(self) -> None:
        if not self.cut:
            super()._disconnected()


def test_a_gap_is_repaired_by_replay(replicas, subscribers):
    replica = replicas(heartbeat_s=1.0)
    sub = subscribers(replica, Partitioned)
    wait_until(replica.caught_up(sub))
    sub.lost = {replica.pub.last_seq + 1}
    run_workload(replica.cache, 1)  # the lost batch
    wait_until(lambda: not sub.lost)
    run_workload(replica.cache, 1, seed=1)  # the one that shows the gap
    wait_until(replica.caught_up(sub))
    assert (sub.gaps, sub.replays, sub.restarts) == (1, 2, 0)
    assert sub.blocks.blocks == replica.keys() and len(sub.blocks) > 0


def test_a_restarted_publisher_makes_the_subscriber_drop_the_old_blocks(replicas, subscribers):
    first = replicas()
    run_workload(first.cache, 20)
    sub = subscribers(first)
    wait_until(first.caught_up(sub))
    old = first.keys()
    assert sub.blocks.blocks == old and old
    first.pub.close()
    # the same ports: the new run's seqs start from 0 again (they go backwards)
    second = replicas(endpoint=first.pub.endpoint, replay_endpoint=first.pub.replay_endpoint)
    run_workload(second.cache, 3, seed=7)
    wait_until(lambda: sub.restarts == 1)
    wait_until(second.caught_up(sub))
    assert sub.blocks.blocks == second.keys()
    assert not sub.blocks.blocks & old and sub.restarts == 1


def test_a_restart_hidden_behind_a_partition_is_found_by_the_replay_witness(replicas, subscribers):
    """Cut off while the replica restarts and outruns its old seqs, the subscriber sees a
    gap; the replay from the last batch it applied finds another payload there."""
    first = replicas()
    run_workload(first.cache, 10)
    sub = subscribers(first, Partitioned)
    wait_until(first.caught_up(sub))
    sub.cut = True
    first.pub.close()
    endpoints = {"endpoint": first.pub.endpoint, "replay_endpoint": first.pub.replay_endpoint}
    second = replicas(flush_interval_ms=1.0, heartbeat_s=0.001, **endpoints)
    run_workload(second.cache, 3, seed=7)
    wait_until(lambda: second.pub.last_seq > first.pub.last_seq + 5)
    sub.cut = False
    wait_until(lambda: sub.restarts == 1)
    wait_until(second.caught_up(sub))
    assert (sub.gaps, sub.restarts) == (1, 1)
    assert sub.blocks.blocks == second.keys()


def test_a_subscriber_started_before_its_replica_catches_up_when_it_comes():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    sub = EventSubscriber(endpoint, replay, replay_timeout_s=0.2, retry_s=0.05).start()
    replica = None
    try:
        time.sleep(0.3)
        assert sub.stale(time.monotonic(), 10.0) and not sub.synced
        replica = Replica(endpoint=endpoint, replay_endpoint=replay)
        run_workload(replica.cache, 10)
        wait_until(replica.caught_up(sub))
        assert sub.blocks.blocks == replica.keys()
        assert not sub.stale(time.monotonic(), 1.0)
    finally:
        started = time.monotonic()
        sub.close()
        assert time.monotonic() - started < 0.5
        if replica is not None:
            replica.pub.close()


def test_heartbeats_keep_an_idle_replica_fresh_and_silence_makes_it_stale(replicas, subscribers):
    replica = replicas(heartbeat_s=0.05)
    sub = subscribers(replica, Partitioned)
    wait_until(replica.caught_up(sub))
    seq = sub.last_seq
    for _ in range(8):  # idle: no event at all
        time.sleep(0.05)
        assert not sub.stale(time.monotonic(), 0.3)
    assert sub.last_seq >= seq + 4  # heartbeats: empty batches with seqs of their own
    assert len(sub.blocks) == 0 and sub.synced
    sub.cut = True  # nothing comes through any more, and nothing says why
    cut = time.monotonic()
    wait_until(lambda: sub.stale(time.monotonic(), 0.3), timeout_s=2.0)
    assert time.monotonic() - cut >= 0.2 and sub.synced


def test_a_stopped_publisher_goes_stale_at_once_and_is_resynced_when_back(replicas, subscribers):
    replica = replicas()
    run_workload(replica.cache, 10)
    sub = subscribers(replica)
    wait_until(replica.caught_up(sub))
    replica.pub.close()
    wait_until(lambda: sub.stale(time.monotonic(), 60.0), timeout_s=2.0)
    assert not sub.synced  # the dropped connection unsyncs it, long before 60 s
    endpoints = {"endpoint": replica.pub.endpoint, "replay_endpoint": replica.pub.replay_endpoint}
    back = replicas(**endpoints)
    wait_until(back.caught_up(sub))
    assert sub.restarts == 1 and sub.blocks.blocks == back.keys() == set()


def test_control_a_lost_block_removed_breaks_the_comparison(replicas, subscribers):
    """The comparison can fail: without the first BlockRemoved, the subscriber still
    claims blocks the cache evicted."""
    replica = replicas()
    tee = replica.tee
    tee.drop = lambda e: isinstance(e, BlockRemoved) and not tee.dropped
    sub = subscribers(replica)
    run_workload(replica.cache, 40)
    wait_until(replica.caught_up(sub))
    (dropped,) = tee.dropped
    truth = replica.keys()
    assert sub.blocks.blocks != truth
    expected = BlockSet()  # what the events that went out say
    expected.apply_all(e for e in tee.events if e is not dropped)
    assert sub.blocks.blocks == expected.blocks
    assert truth < expected.blocks and expected.blocks - truth <= set(dropped.block_hashes)


def test_an_overflowing_queue_resyncs_consumers_from_the_snapshot(replicas, subscribers):
    replica = replicas(max_queue_events=3, flush_interval_ms=200.0)
    sub = subscribers(replica)
    wait_until(lambda: sub.synced)
    run_workload(replica.cache, 20)  # far more than 3 events within one flush interval
    wait_until(lambda: replica.pub.dropped_events > 0)
    wait_until(lambda: sub.blocks.blocks == replica.keys())
    assert len(replica.tee.events) > 3 and (sub.gaps, sub.restarts) == (0, 0)


def test_close_is_prompt_and_publishes_what_is_queued():
    config = EventsConfig(endpoint=LOOPBACK, replay_endpoint=None, flush_interval_ms=1000.0)
    pub = ZmqEventPublisher(config)
    tee = Tee(pub)
    run_workload(make_cache(tee), 5)
    started = time.monotonic()
    pub.close()
    pub.close()
    assert time.monotonic() - started < 0.5
    assert (pub.last_seq, pub.published_events) == (1, len(tee.events))  # after the opening


def test_a_replica_on_ipv6_loopback_is_followed(replicas, subscribers):
    """`kvstore serve --host ::1`: both ends bracket the address and turn IPv6 on."""
    from engine.events.wire import zmq_host

    endpoint = f"tcp://{zmq_host('::1')}:*"
    replica = replicas(endpoint=endpoint, replay_endpoint=endpoint)
    assert replica.pub.endpoint.startswith("tcp://[::1]:")
    sub = subscribers(replica)
    run_workload(replica.cache, 10)
    wait_until(replica.caught_up(sub))
    assert sub.blocks.blocks == replica.keys() != set()
