"""Spill tiers publish their changes as block events of their medium: a consumer that
applies a real cache's events per medium holds exactly what each tier holds, entries of
several blocks included, and a block that left the device but stays in a tier is still in
that tier's set."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.events.wire import decode_batch, encode_batch
from kvstore.fleet.events import (
    MEDIUM_DISK,
    MEDIUM_HOST,
    MEDIUM_REDIS,
    AllBlocksCleared,
    BlockRemoved,
    BlockSet,
    BlockStored,
    EventSink,
    KVEvent,
    MediaBlocks,
)
from kvstore.stores import LmdbStore, MemoryStore, RedisStore, SpillStore
from tests.tiers.tier_events_helpers import (
    BS,
    device_blocks,
    make_cache,
    memory_store,
    run_prompts,
    tier_blocks,
)


class Recorder(EventSink):
    """Every event, in order, and the consumer's view they build."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []
        self.view = MediaBlocks(BlockSet())

    def emit(self, event: KVEvent) -> None:
        self.events.append(event)
        self.view.apply(event)


@pytest.mark.parametrize("chunk_blocks", [1, 2])
def test_a_host_tier_that_evicts_is_rebuilt_per_medium_from_its_events(chunk_blocks):
    recorder = Recorder()
    store = memory_store(30)
    cache = make_cache(store, recorder, chunk_blocks)
    chains = run_prompts(cache, 40)
    assert store.stats().evictions > 0  # the tier did evict: removals were reported
    expected = tier_blocks(store, chains, chunk_blocks)
    assert recorder.view.tiers[MEDIUM_HOST].blocks == expected
    assert recorder.view.device.blocks == device_blocks(cache)
    # one event per entry, and a removal lists whole entries
    spill = [e for e in recorder.events if getattr(e, "medium", None) == MEDIUM_HOST]
    stored = [e for e in spill if isinstance(e, BlockStored)]
    assert {len(e.block_hashes) for e in stored} == {chunk_blocks}
    assert all(len(e.token_ids) == chunk_blocks * BS for e in stored)
    removed = [e for e in spill if isinstance(e, BlockRemoved)]
    assert all(len(e.block_hashes) % chunk_blocks == 0 for e in removed)
    cache.close()


def test_a_block_evicted_from_the_device_stays_in_its_tier_set():
    recorder = Recorder()
    store = memory_store(1000)  # holds everything written back
    cache = make_cache(store, recorder)
    chains = run_prompts(cache, 10)
    first = chains[0][0]  # the first prompt's first block: long gone from a 12-block pool
    assert first not in recorder.view.device
    assert first in recorder.view.tiers[MEDIUM_HOST]
    assert recorder.view.tiers[MEDIUM_HOST].blocks == tier_blocks(store, chains, 1)
    cache.close()


def test_control_a_lost_tier_removal_breaks_the_comparison():
    recorder = Recorder()
    store = memory_store(30)
    cache = make_cache(store, recorder)
    chains = run_prompts(cache, 40)
    view = MediaBlocks(BlockSet())
    lost = next(e for e in recorder.events if isinstance(e, BlockRemoved) and e.medium)
    view.apply_all(e for e in recorder.events if e is not lost)
    assert view.tiers[MEDIUM_HOST].blocks != tier_blocks(store, chains, 1)
    cache.close()


def test_an_lmdb_tier_that_evicts_is_rebuilt_from_its_events(tmp_path: Path):
    recorder = Recorder()
    store = LmdbStore(str(tmp_path / "lmdb"), map_size_bytes=1 << 20)
    cache = make_cache(store, recorder)
    chains = run_prompts(cache, 150)
    assert store.stats().evictions > 0
    assert recorder.view.tiers[MEDIUM_DISK].blocks == tier_blocks(store, chains, 1)
    deleted = chains[-1][:2]
    store.delete(deleted)  # a damaged entry's deletion is reported too
    assert not set(deleted) & recorder.view.tiers[MEDIUM_DISK].blocks
    cache.close()


def test_a_redis_tier_reports_what_it_stored_and_deleted(redis_server):
    recorder = Recorder()
    store = RedisStore(redis_server.url, "ns")
    cache = make_cache(store, recorder)
    chains = run_prompts(cache, 8)
    assert recorder.view.tiers[MEDIUM_REDIS].blocks == tier_blocks(store, chains, 1)
    store.delete(chains[0])
    assert not set(chains[0]) & recorder.view.tiers[MEDIUM_REDIS].blocks
    assert recorder.view.tiers[MEDIUM_REDIS].blocks == tier_blocks(store, chains, 1)
    cache.close()


def test_spill_media_survive_the_wire_and_unknown_media_read_as_the_device():
    stored = BlockStored([b"a" * 16], None, [1, 2, 3, 4], 4, MEDIUM_DISK)
    removed = BlockRemoved([b"b" * 16], MEDIUM_REDIS)
    device = BlockRemoved([b"c" * 16])
    _, events = decode_batch(encode_batch(0.0, [stored, removed, device], "GPU"))
    assert events == [stored, removed, device]
    odd = BlockRemoved([b"d" * 16], "SOMEWHERE")  # a medium kvstore does not know
    _, (back,) = decode_batch(encode_batch(0.0, [odd]))
    assert back.medium is None


def test_a_replicas_restart_clears_its_own_sets_never_a_shared_one():
    shared = BlockSet()
    view = MediaBlocks(BlockSet(), {MEDIUM_REDIS: shared}, shared=[MEDIUM_REDIS])
    view.apply(BlockStored([b"d" * 16], None, [0] * 4, 4))
    view.apply(BlockStored([b"h" * 16], None, [0] * 4, 4, MEDIUM_HOST))
    view.apply(BlockStored([b"r" * 16], None, [0] * 4, 4, MEDIUM_REDIS))
    view.apply(AllBlocksCleared())
    assert (len(view.device), len(view.tiers[MEDIUM_HOST]), len(shared)) == (0, 0, 1)
    copy = view.copy()
    assert copy.tiers[MEDIUM_REDIS] is shared and copy.device is not view.device
    with pytest.raises(ValueError, match="unknown spill medium"):
        view.apply(BlockRemoved([b"x" * 16], "TAPE"))


def store_under_churn(
    store: SpillStore, value_bytes: int, seed: int = 0
) -> tuple[set[bytes], list[bytes]]:
    """Random puts (old keys again among new ones) and deletes on `store`, its listener's
    changes applied in order to a set. Returns (that set, every key used)."""
    view: set[bytes] = set()

    def listener(removed: list[bytes], stored: list[bytes]) -> None:
        view.difference_update(removed)
        view.update(stored)

    store.watch(listener)
    rng = np.random.default_rng(seed)
    keys = [bytes([i % 256, i // 256]) * 8 for i in range(60)]
    for _ in range(80):
        batch = [keys[i] for i in rng.choice(len(keys), size=6, replace=False)]
        if rng.random() < 0.2:
            store.delete(batch[:2])
        else:
            values = [bytes(rng.integers(0, 255, value_bytes, dtype=np.uint8)) for _ in batch]
            store.put_many(list(zip(batch, values, strict=True)))
    return view, keys


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_an_evicted_entry_written_again_in_the_same_call_is_reported_held(policy):
    # the store holds k2, x, y (FIFO order); one call evicts all three to fit k1, k2, k3
    store = MemoryStore(3 * 1600, policy=policy)
    k1, k2, k3, x, y = (bytes([i]) * 16 for i in range(5))
    store.put_many([(k2, b"v" * 1500), (x, b"v" * 1500), (y, b"v" * 1500)])
    calls = []
    store.watch(lambda removed, stored: calls.append((set(removed), set(stored))))
    store.put_many([(k1, b"w" * 1500), (k2, b"w" * 1500), (k3, b"w" * 1500)])
    removed, stored = calls[-1]
    held = {k for k in (k1, k2, k3, x, y) if store.contains_many([k])[0]}
    assert stored == held and not removed & held


@pytest.mark.parametrize("kind", ["memory-lru", "memory-fifo", "lmdb"])
def test_a_listener_applying_a_churning_stores_changes_in_order_holds_what_it_holds(kind, tmp_path):
    if kind == "lmdb":
        store: SpillStore = LmdbStore(str(tmp_path / "lmdb"), map_size_bytes=1 << 18)
        value_bytes = 6000  # 60 keys of 6 kB: over the 256 kB map
    else:
        store, value_bytes = MemoryStore(30 * 1600, policy=kind.split("-")[1]), 1500
    view, keys = store_under_churn(store, value_bytes)
    assert store.stats().evictions > 0
    assert view == {k for k, held in zip(keys, store.contains_many(keys), strict=True) if held}
    store.close()


def test_a_consumer_removes_a_whole_entry_by_its_last_block():
    # a publisher that no longer knows an entry's blocks (restarted, another process) removes
    # it by its key alone: the consumer's set drops every block of it
    blocks = BlockSet()
    entry = [bytes([i]) * 16 for i in range(3)]
    blocks.apply(BlockStored(entry, None, [0] * 3 * BS, BS, MEDIUM_DISK))
    blocks.apply(BlockRemoved([entry[-1]], MEDIUM_DISK))
    assert len(blocks) == 0 and not blocks.entries
