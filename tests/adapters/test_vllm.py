"""vLLM: the real TieringOffloadingSpec builds its manager with KvstoreTier as a secondary
tier (SecondaryTierFactory, `type` + `module_path`), and the manager is driven as vLLM's
scheduler drives it: real OffloadKeys, chunks through the real CPU primary buffer."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from collections.abc import Callable

import msgspec
import numpy as np
import pytest
import torch
import zmq
from adapter_helpers import (
    compose_redis,
    compose_service,
    corrupt,
    count,
    flag_value,
    import_stack,
    verify_failures,
)

import_stack("vllm", "vllm.v1.kv_offload.tiering.spec")

from vllm.distributed import kv_events as vllm_events
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from engine.events.publisher import (
    EventsConfig,
    EventSubscriber,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
)
from hashing import Namespace
from kvstore.adapters.vllm import KvstoreTier
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig, ConfigError
from kvstore.fleet.events import AllBlocksCleared, BlockRemoved, BlockStored, EventSink, KVEvent
from kvstore.stores import MemoryStore

BLOCK_BYTES = 2 * 2 * 2 * 16 * 8 * 2  # layers x K/V x heads x 16 tokens x head_dim x bf16
STEP = ScheduleEndContext((), ())
_ids = itertools.count()


def offloading_config(settings: dict, model: str) -> OffloadingConfig:
    tier = {"type": "KvstoreTier", "module_path": "kvstore.adapters.vllm", "kvstore": settings}
    parallel = OffloadingParallelConfig(
        rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
        is_parallelism_agnostic=False,
    )  # fmt: skip
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layers.0.attn", "layers.1.attn"), 0),),
        worker_kv_bytes_per_block=BLOCK_BYTES,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": 16 * 4096, "secondary_tiers": [tier]},
        engine_id=f"kvstore-test-{os.getpid()}-{next(_ids)}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=parallel,
    )


class Engine:
    """One vLLM engine's offloading manager (scheduler side) with a KvstoreTier."""

    def __init__(self, settings: dict, model: str = "org/model", spec=None):
        self.spec = spec or TieringOffloadingSpec(offloading_config(settings, model))
        self.manager = self.spec.get_manager()
        (self.tier,) = self.manager.secondary_tiers
        self.view = self.manager.primary_tier.get_kv_memoryview().cast("B")
        self.chunk_bytes = self.tier.block_size_bytes

    def chunk(self, chunk_id: int) -> memoryview:
        return self.view[chunk_id * self.chunk_bytes : (chunk_id + 1) * self.chunk_bytes]

    def store(self, chunks: dict[bytes, bytes]) -> None:
        """GPU -> primary (written into the CPU buffer) -> cascade into the tier."""
        req = self._request()
        out = self.manager.prepare_store(list(chunks), req)
        for key, chunk_id in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            self.chunk(int(chunk_id))[:] = chunks[key]
        self.manager.complete_store(list(chunks), req)
        self.manager.on_schedule_end(STEP)  # cascades go out at the step's end
        self.tier.drain_jobs()
        self.manager.on_schedule_end(STEP)
        self.manager.on_request_finished(req)

    def reset_primary(self) -> None:
        """An empty primary tier: every later hit comes from the secondary tier."""
        self.manager.reset_cache()
        self.manager.on_reset_flushed()

    def load(self, keys: list[bytes]) -> dict[bytes, bytes]:
        """Look the keys up as the scheduler does, step after step, until each is a HIT or a
        MISS; returns the hits' chunks as read from the primary buffer."""
        req = self._request()
        results = self._settle(keys, req)
        hits = [k for k, r in zip(keys, results, strict=True) if r is LookupResult.HIT]
        spec = self.manager.prepare_load(hits, req)
        chunks = {k: bytes(self.chunk(int(c))) for k, c in zip(hits, spec.chunk_ids, strict=True)}
        self.manager.complete_load(hits, req)
        self.manager.on_request_finished(req)
        return chunks

    def _settle(self, keys: list[bytes], req: ReqContext) -> list[LookupResult]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            results = [self.manager.lookup(k, req) for k in keys]
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results):
                return results
            self.manager.on_schedule_end(STEP)  # flushes lookups and promotions
            self.tier.drain_jobs()
            time.sleep(0.005)
        raise AssertionError(f"lookups did not settle: {results}")

    def _request(self) -> ReqContext:
        req = ReqContext(f"req-{next(_ids)}")
        self.manager.on_new_request(req)
        return req

    def close(self) -> None:
        self.view.release()
        self.manager.shutdown()


def chunks_of(n: int, seed: int = 0) -> dict[bytes, bytes]:
    """n chunks under sha256-sized block hashes, group 0, each of distinct bytes."""
    out = {}
    for i in range(n):
        block_hash = bytes([seed, i]) * 16
        out[make_offload_key(block_hash, 0)] = bytes((seed + i + j) % 251 for j in range(4096))
    return out


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(settings: dict, model: str = "org/model") -> Engine:
        made.append(Engine(settings, model))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def test_the_factory_builds_a_kvstore_tier_from_the_tier_config(tier, engines):
    engine = engines(tier.settings)
    assert isinstance(engine.tier, KvstoreTier)
    assert [s.name for s in engine.tier.blocks.stores] == [tier.name]
    assert engine.tier.block_size_bytes == 4096  # the chunk, aligned by vLLM


def test_chunks_round_trip_bit_exact_through_the_primary_buffer(tier, engines):
    engine, chunks = engines(tier.settings), chunks_of(4)
    engine.store(chunks)
    blocks = engine.tier.blocks
    assert count(blocks, "adapter_writes_blocks_total", tier=tier.name) == 4
    engine.reset_primary()
    assert engine.load(list(chunks)) == chunks
    assert count(blocks, "adapter_hits_blocks_total", tier=tier.name) == 4


@pytest.mark.parametrize("tier", ["lmdb", "redis"], indirect=True)
def test_a_second_engine_loads_what_the_first_stored(tier, engines):
    chunks = chunks_of(3, seed=7)
    engines(tier.settings).store(chunks)
    reader = engines(tier.settings)
    assert reader.load(list(chunks)) == chunks


def test_a_corrupted_chunk_is_a_miss_and_is_deleted(tier, engines):
    engine, chunks = engines(tier.settings), chunks_of(3, seed=3)
    engine.store(chunks)
    engine.reset_primary()
    keys, blocks = list(chunks), engine.tier.blocks
    assert blocks.get([keys[1]])[0] is not None  # control: it verifies before the damage
    corrupt(blocks, keys[1])
    got = engine.load(keys)
    assert got == {keys[0]: chunks[keys[0]], keys[2]: chunks[keys[2]]}
    assert verify_failures(blocks, tier.name, "checksum") == 1
    assert blocks.contains([keys[1]]) == [False]  # rejected entries are deleted


@pytest.mark.parametrize("tier", ["memory", "lmdb", "redis"], indirect=True)
def test_two_models_never_share_a_chunk(tier, engines):
    chunks = chunks_of(2, seed=9)
    writer = engines(tier.settings, model="org/model-a")
    writer.store(chunks)
    other = engines(tier.settings, model="org/model-b")
    other.tier.blocks.stores = writer.tier.blocks.stores  # even on the very same stores
    assert other.load(list(chunks)) == {}
    assert writer.tier.blocks.namespace.id != other.tier.blocks.namespace.id


@pytest.mark.parametrize("tier", ["redis"], indirect=True)
def test_redis_killed_is_misses_and_failed_jobs_then_recovery(tier, engines):
    engine, chunks = engines(tier.settings), chunks_of(2, seed=11)
    engine.store(chunks)
    engine.reset_primary()
    tier.redis.kill()
    assert engine.load(list(chunks)) == {}  # misses, no exception
    engine.store(chunks_of(1, seed=12))  # the job fails inside the tier, not in vLLM
    blocks = engine.tier.blocks
    assert count(blocks, "adapter_dropped_writes_blocks_total", tier="redis") == 1
    tier.redis.restart()  # empty, on the same port
    time.sleep(0.25)  # the breaker's cooldown
    engine.reset_primary()
    engine.store(chunks)
    engine.reset_primary()
    assert engine.load(list(chunks)) == chunks


def test_the_compose_fleet_config_loads_through_vllms_spec_factory(
    redis_server_factory, monkeypatch
):
    """vllm-a's --kv-transfer-config of docker-compose.yml, verbatim but for a smaller CPU
    buffer, through vLLM's OffloadingSpecFactory, on a loopback Redis with its password."""
    command, env = compose_service("vllm-a")
    for name, value in compose_redis(redis_server_factory, env).items():
        monkeypatch.setenv(name, value)
    kv = json.loads(flag_value(command, "--kv-transfer-config"))
    assert (kv["kv_connector"], kv["kv_role"]) == ("OffloadingConnector", "kv_both")
    extra = {**kv["kv_connector_extra_config"], "cpu_bytes_to_use": 16 * 4096}
    config = offloading_config({}, "org/model")
    spec = OffloadingSpecFactory.create_spec(dataclasses.replace(config, extra_config=extra))
    engine = Engine({}, spec=spec)
    try:
        assert [s.name for s in engine.tier.blocks.stores] == ["redis"]
        chunks = chunks_of(2, seed=21)
        engine.store(chunks)
        engine.reset_primary()
        assert engine.load(list(chunks)) == chunks
    finally:
        engine.close()


def test_two_secrets_on_one_tier_keep_each_others_chunks(tier, engines, caplog):
    """An engine with another secret reads the chunks as foreign misses and never deletes
    them; it says so once; the writer still loads them. A damaged chunk is still deleted."""
    right = engines({**tier.settings, "secret": "right"})
    wrong = engines({**tier.settings, "secret": "wrong"})
    wrong.tier.blocks.stores = right.tier.blocks.stores  # the very same stores
    chunks = chunks_of(3, seed=31)
    right.store(chunks)
    with caplog.at_level("WARNING", logger="kvstore.tiers"):
        assert wrong.load(list(chunks)) == {}
        assert wrong.load(list(chunks)) == {}  # still there, still a miss
    foreign = wrong.tier.blocks.metrics.get("foreign_entries_total", tier=tier.name,
                                            reason="secret")  # fmt: skip
    assert foreign == 6  # each load reads all 3 again: a lookup only sees them present
    assert right.tier.blocks.contains(list(chunks)) == [True] * 3  # 0 deleted
    assert len([r for r in caplog.records if "KVSTORE_SECRET" in r.message]) == 1
    right.reset_primary()
    assert right.load(list(chunks)) == chunks
    first = next(iter(chunks))
    corrupt(right.tier.blocks, first)  # the control: damage is still deleted
    right.reset_primary()
    assert first not in right.load(list(chunks))
    assert right.tier.blocks.contains([first]) == [False]


def test_a_bad_tier_entry_stops_vllm_with_one_error_line_saying_what_to_fix(tmp_path, caplog):
    config = offloading_config({"memory_cache_gb": 0.01}, "org/model")
    tiers = config.extra_config["secondary_tiers"]
    for bad, message in (({"io_thread": 2}, "io_thread: is not a key of a KvstoreTier entry"),
                         ({"locality": "NEAR"}, "locality: must be one of LOCAL, REMOTE"),
                         ({"kvstore": {"redis_ur": "x"}}, "did you mean 'redis_url'")):  # fmt: skip
        entry = {**tiers[0], **bad}
        extra = {**config.extra_config, "secondary_tiers": [entry]}
        spec = TieringOffloadingSpec(dataclasses.replace(config, extra_config=extra))
        caplog.clear()
        with caplog.at_level("ERROR", logger="kvstore.adapters"), pytest.raises(ConfigError):
            spec.get_manager()
        (record,) = caplog.records
        assert message in record.message and "vLLM does not start" in record.message


@pytest.mark.parametrize("tier", ["redis"], indirect=True)
def test_a_failed_store_leaves_no_view_of_the_primary_buffer(tier, engines, caplog):
    """vLLM unmaps its shared primary buffer at shutdown only if no view of it is left:
    a store that failed (Redis down) must not keep one alive."""
    engine = engines(tier.settings)
    tier.redis.kill()
    engine.store(chunks_of(2, seed=41))
    assert count(engine.tier.blocks, "adapter_dropped_writes_blocks_total", tier="redis") == 2
    region = engine.spec._scheduler_mmap
    with caplog.at_level("WARNING"):
        engine.close()
    assert not [r for r in caplog.records if "Keeping" in r.message]
    assert region.mmap_obj is None  # unmapped


# --- kvstore's KV events, read by vLLM's own event classes -----------------------------------


class CountingSink(EventSink):
    def __init__(self, sink: EventSink):
        self.sink, self.count = sink, 0

    def emit(self, event: KVEvent) -> None:
        self.count += 1
        self.sink.emit(event)


def _events_workload(cache: PrefixCache, block_size: int) -> None:
    """Prompts on shared prefixes through a 16-block pool: stores, hits and evictions."""
    rng = np.random.default_rng(3)
    prefixes = [rng.integers(0, 1000, 3 * block_size) for _ in range(3)]
    for i in range(40):
        tail = rng.integers(0, 1000, block_size * int(rng.integers(1, 5)) + 1)
        prompt = np.concatenate([prefixes[i % 3], tail]).astype(np.uint32)
        hit = cache.lookup(prompt)
        kv = torch.zeros(1, 2, len(prompt), 8)
        cache.store(prompt, [(kv, kv)] * 2, keys=hit.keys)
        cache.release(hit)


def _vllm_block_set(batches: list) -> set:
    blocks: set = set()
    for batch in batches:
        for event in batch.events:
            if isinstance(event, vllm_events.BlockStored):
                blocks.update(event.block_hashes)
            elif isinstance(event, vllm_events.BlockRemoved):
                blocks.difference_update(event.block_hashes)
            else:
                assert isinstance(event, vllm_events.AllBlocksCleared)
                blocks.clear()
    return blocks


def _published_batches(pub: ZmqEventPublisher, sink: CountingSink, run: Callable[[], None]):
    """Run `run` while a plain SUB socket reads the publisher as vLLM's consumers do; every
    batch it published, decoded by vLLM's KVEventBatch (none may be lost)."""
    decoder = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)
    with zmq.Context() as ctx, ctx.socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, pub.config.topic.encode())
        sub.connect(pub.endpoint)
        assert sub.poll(5000), "no heartbeat"  # subscribed: nothing after this is missed
        frames = [sub.recv_multipart()]
        run()
        deadline = time.monotonic() + 10
        while pub.published_events < sink.count and time.monotonic() < deadline:
            time.sleep(0.01)
        last = pub.last_seq
        while int.from_bytes(frames[-1][1], "big") < last:
            assert sub.poll(5000), "a batch is missing"
            frames.append(sub.recv_multipart())
        pub.close()
    seqs = [int.from_bytes(seq, "big") for _, seq, _ in frames]
    assert seqs == list(range(seqs[0], seqs[-1] + 1))  # none lost
    return [decoder.decode(payload) for _, _, payload in frames]


def test_kv_events_of_a_cache_decode_with_vllms_classes_into_its_exact_blocks():
    """kvstore's publisher over a PrefixCache run with evictions; a plain SUB socket reads it
    as vLLM's consumers do, and vLLM's KVEventBatch decodes every payload."""
    bs, local = 4, "tcp://127.0.0.1:*"
    config = EventsConfig(endpoint=local, replay_endpoint=local, heartbeat_s=0.05)
    pub = ZmqEventPublisher(config)
    sink = CountingSink(pub)
    namespace = Namespace("fp", "float32", 2, 2, 8, bs)
    cache = PrefixCache(CacheConfig(block_size=bs, device_blocks=16, device="cpu"), namespace,
                        events=sink)  # fmt: skip
    batches = _published_batches(pub, sink, lambda: _events_workload(cache, bs))
    evicted = cache.metrics.get("evicted_blocks_total")
    assert evicted > 0
    truth = {key for event in cache.snapshot_events() for key in event.block_hashes}
    assert len(truth) == len(cache.index.all_block_ids())
    assert _vllm_block_set(batches) == truth
    events = [event for batch in batches for event in batch.events]
    stored = [e for e in events if isinstance(e, vllm_events.BlockStored)]
    removed = [e for e in events if isinstance(e, vllm_events.BlockRemoved)]
    assert len(stored) + len(removed) == sink.count
    assert sum(len(e.block_hashes) for e in removed) == evicted
    assert {b.data_parallel_rank for b in batches} == {0}
    assert {e.medium for e in stored + removed} == {"CPU"}
    assert {e.block_size for e in stored} == {bs}
    for e in stored:
        assert len(e.token_ids) == bs * len(e.block_hashes)
        assert all(isinstance(h, bytes) and len(h) == 16 for h in e.block_hashes)
        assert (e.lora_id, e.lora_name, e.extra_keys, e.group_idx) == (None, None, None, None)


def _vllm_media_sets(batches: list) -> dict[str, set]:
    """Per medium, the blocks vLLM's events describe (AllBlocksCleared clears them all)."""
    media: dict[str, set] = {}
    for batch in batches:
        for event in batch.events:
            if isinstance(event, vllm_events.AllBlocksCleared):
                for blocks in media.values():
                    blocks.clear()
            elif isinstance(event, vllm_events.BlockStored):
                media.setdefault(event.medium, set()).update(event.block_hashes)
            else:
                media.setdefault(event.medium, set()).difference_update(event.block_hashes)
    return media


def test_kv_events_of_a_device_pool_and_a_spilling_host_tier_rebuild_each_medium():
    """A cache over a host-memory tier that evicts: vLLM's classes decode the stream, and
    the blocks per `medium` are the device pool's ("CPU") and the tier's ("HOST")."""
    bs, local = 4, "tcp://127.0.0.1:*"
    config = EventsConfig(endpoint=local, replay_endpoint=local, heartbeat_s=0.05)
    pub = ZmqEventPublisher(config)
    sink = CountingSink(pub)
    namespace = Namespace("fp", "float32", 2, 2, 8, bs)
    store = MemoryStore(30 * (2 * 2 * 2 * bs * 8 * 4 + 512))  # about 30 entries
    cache = PrefixCache(CacheConfig(block_size=bs, device_blocks=16, device="cpu"), namespace,
                        stores=[store], events=sink)  # fmt: skip
    prompts = []

    def run() -> None:
        rng = np.random.default_rng(3)
        for _ in range(40):
            prompt = rng.integers(0, 1000, bs * int(rng.integers(4, 9)) + 1).astype(np.uint32)
            hit = cache.lookup(prompt)
            kv = torch.randn(1, 2, len(prompt), 8)
            cache.store(prompt, [(kv, kv)] * 2, keys=hit.keys)
            cache.release(hit)
            prompts.append(cache.hasher.hash_blocks(prompt))
        assert cache.tiers.flush(10)

    media = _vllm_media_sets(_published_batches(pub, sink, run))
    assert store.stats().evictions > 0
    device = {key for event in cache.snapshot_events() for key in event.block_hashes}
    held = {
        k
        for keys in prompts
        for k, there in zip(keys, store.contains_many(keys), strict=True)
        if there
    }
    assert media == {"CPU": device, "HOST": held}
    cache.close()


def test_kv_events_encode_byte_for_byte_as_vllm_and_decode_vllms_batches():
    h = [bytes([i]) * 16 for i in range(3)]
    ours = [
        AllBlocksCleared(),
        BlockStored(h[:2], None, list(range(8)), 4),
        BlockStored(h[2:], h[1], list(range(4)), 4),
        BlockRemoved(h[1:]),
    ]
    theirs = vllm_events.KVEventBatch(
        ts=12.5,
        events=[
            vllm_events.AllBlocksCleared(),
            vllm_events.BlockStored(block_hashes=h[:2], parent_block_hash=None,
                                    token_ids=list(range(8)), block_size=4, lora_id=None,
                                    medium="GPU", lora_name=None),
            vllm_events.BlockStored(block_hashes=h[2:], parent_block_hash=h[1],
                                    token_ids=list(range(4)), block_size=4, lora_id=None,
                                    medium="GPU", lora_name=None),
            vllm_events.BlockRemoved(block_hashes=h[1:], medium="GPU"),
        ],
        data_parallel_rank=0,
    )  # fmt: skip
    payload = msgspec.msgpack.encode(theirs)
    assert encode_batch(12.5, ours, "GPU") == payload
    assert decode_batch(payload) == (12.5, ours)
    assert msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(payload) == theirs


def test_kv_events_subscriber_follows_vllms_own_publisher():
    """The other way round: kvstore's EventSubscriber indexes a vLLM replica (its replay
    socket's framing, its batches), started late, through replay and then the stream."""
    ports = []
    for _ in range(2):
        with zmq.Context() as ctx, ctx.socket(zmq.PUB) as probe:
            ports.append(probe.bind_to_random_port("tcp://127.0.0.1"))
    publisher = vllm_events.ZmqEventPublisher(
        0, endpoint=f"tcp://*:{ports[0]}", replay_endpoint=f"tcp://*:{ports[1]}", topic="kv"
    )
    h = [bytes([i]) * 32 for i in range(4)]  # vLLM's block hashes are sha256-sized

    def publish(*events) -> None:
        publisher.publish(vllm_events.KVEventBatch(ts=time.time(), events=list(events)))

    def stored(hashes, parent):
        return vllm_events.BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                       token_ids=[1] * 16 * len(hashes), block_size=16,
                                       lora_id=None, medium="GPU", lora_name=None)  # fmt: skip

    publish(stored(h[:2], None))
    publish(stored(h[2:], h[1]))
    publish(vllm_events.BlockRemoved(block_hashes=[h[3]], medium="GPU"))
    time.sleep(0.3)  # its thread sends them: the subscriber comes after, and replays them
    sub = EventSubscriber(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}",
                          topic="kv", replay_timeout_s=0.5, retry_s=0.05).start()  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while not (sub.synced and sub.last_seq == 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sub.blocks.blocks == set(h[:3]) and sub.replays == 1
        time.sleep(0.2)  # the SUB connection is up: what follows comes by the stream
        publish(vllm_events.BlockRemoved(block_hashes=[h[2]], medium="GPU"))
        while sub.last_seq < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sub.blocks.blocks == set(h[:2])
        assert (sub.gaps, sub.restarts, sub.bad_batches, sub.replays) == (0, 0, 0, 1)
    finally:
        sub.close()
        publisher.shutdown()
