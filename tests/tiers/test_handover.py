"""`PrefixCache.hand_over` over a real Redis: a prefill cache makes a prompt's blocks readable
from the shared tier before it returns, whatever the write policy; a second cache (a decode
replica) loads exactly those bytes; a damaged entry is a counted miss there."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest
import torch
from tier_events_helpers import BS, DIM, HEADS, LAYERS

from hashing import Namespace
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig
from kvstore.stores import MemoryStore, RedisStore
from kvstore.tiers.writer import PendingMark

NUM_BLOCKS = 6


def cache_over(store, policy: str = "write-through", blocks: int = 16) -> PrefixCache:
    ns = Namespace("fp", "float32", LAYERS, HEADS, DIM, BS)
    config = CacheConfig(
        block_size=BS,
        device_blocks=blocks,
        device="cpu",
        redis_write_policy=policy,
        memory_write_policy=policy,
    )
    return PrefixCache(config, ns, stores=[store])


def prefill(cache: PrefixCache, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """A prompt of NUM_BLOCKS whole blocks and 2 more tokens, stored as prefill would."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 1000, BS * NUM_BLOCKS + 2).astype(np.uint32)
    kv = torch.randn(1, HEADS, len(prompt), DIM, generator=torch.Generator().manual_seed(seed))
    hit = cache.lookup(prompt)
    cache.store(prompt, [(kv, kv * 2)] * LAYERS, keys=hit.keys)
    cache.release(hit)
    return prompt, kv


def load(cache: PrefixCache, prompt: np.ndarray) -> tuple[int, list]:
    hit = cache.lookup(prompt)
    try:
        kv = cache.load(hit)
        return kv.num_tokens, kv.layers
    finally:
        cache.release(hit)


@pytest.fixture
def redis_pair(redis_server):
    prefix = uuid.uuid4().hex[:16]
    stores = [RedisStore(redis_server.url, prefix), RedisStore(redis_server.url, prefix)]
    yield stores
    for store in stores:
        store.close()


def test_a_hand_over_writes_every_block_the_shared_tier_lacks_whatever_the_policy(redis_pair):
    prefill_store, decode_store = redis_pair
    with cache_over(prefill_store, policy="off") as cache:
        prompt, kv = prefill(cache)
        done = cache.hand_over(prompt)
        assert (done.num_blocks, done.present, done.written, done.complete) == (6, 0, 6, True)
        assert done.missing == 0
    with cache_over(decode_store) as decode:
        num_tokens, layers = load(decode, prompt)
        assert num_tokens == NUM_BLOCKS * BS
        for k, v in layers:  # the bytes the prefill cache computed, unchanged
            assert torch.equal(k, kv[:, :, :num_tokens])
            assert torch.equal(v, kv[:, :, :num_tokens] * 2)
        assert decode.stats()["counters"]["prefix_cache_hits_tokens_total"] == {("redis",): 24}


def test_a_hand_over_after_write_through_finds_the_blocks_present(redis_pair):
    with cache_over(redis_pair[0]) as cache:
        prompt, _ = prefill(cache)
        done = cache.hand_over(prompt)
        assert (done.present, done.written, done.missing, done.complete) == (6, 0, 0, True)


def test_a_hand_over_rewrites_the_entries_the_tier_lost(redis_pair, redis_server):
    prefill_store, decode_store = redis_pair
    with cache_over(prefill_store) as cache:
        prompt, _ = prefill(cache)
        assert cache.flush(10)
        keys = cache.hasher.hash_blocks(prompt)
        assert prefill_store.delete(keys[4:]) == 2  # evicted by the server, say
        done = cache.hand_over(prompt)
        assert (done.present, done.written, done.missing) == (4, 2, 0)
    with cache_over(decode_store) as decode:
        assert load(decode, prompt)[0] == NUM_BLOCKS * BS


def test_blocks_gone_from_both_the_device_and_the_tier_are_missing(redis_pair):
    with cache_over(redis_pair[0], policy="off", blocks=8) as cache:
        prompt, _ = prefill(cache)
        cache.evict_device()  # memory-less: nothing wrote them anywhere
        done = cache.hand_over(prompt)
        assert (done.present, done.written, done.missing) == (0, 0, 6)


def test_a_cache_without_a_shared_tier_hands_nothing_over():
    with cache_over(MemoryStore(1 << 20)) as cache:
        prompt, _ = prefill(cache)
        done = cache.hand_over(prompt)
        assert (done.present, done.written, done.missing, done.complete) == (0, 0, 6, False)


def test_a_damaged_handed_over_entry_is_a_counted_miss_on_the_decode_side(redis_pair, redis_server):
    prefill_store, decode_store = redis_pair
    with cache_over(prefill_store, policy="off") as cache:
        prompt, _ = prefill(cache)
        assert cache.hand_over(prompt).written == NUM_BLOCKS
        keys = cache.hasher.hash_blocks(prompt)
    admin = redis_server.client()
    name = next(k for k in admin.keys("*") if k.endswith(keys[3].hex().encode()))
    value = bytearray(admin.get(name))
    value[-5] ^= 0x40  # one payload bit
    admin.set(name, bytes(value))
    with cache_over(decode_store) as decode:
        assert load(decode, prompt)[0] == 3 * BS  # up to the damaged block, not past it
        counters = decode.stats()["counters"]
        assert counters["verify_failures_total"] == {("checksum", "redis"): 1}


class SlowStore(MemoryStore):
    """Host memory whose puts take 50 ms each: writes stay queued long enough to see."""

    def put_many(self, items):
        time.sleep(0.05)
        return super().put_many(items)


def test_a_writer_barrier_waits_for_the_writes_queued_before_it():
    store = SlowStore(1 << 22)
    with cache_over(store) as cache:  # write-through: 6 queued writes of one block
        prompt, _ = prefill(cache)
        keys = cache.hasher.hash_blocks(prompt)
        writer = cache.tiers.writer
        gate = threading.Event()
        writer.submit(PendingMark(gate))
        assert store.count_prefix(keys) < NUM_BLOCKS  # still queued when asked
        assert writer.barrier(10)
        assert gate.is_set()  # the marks before it passed
        assert store.count_prefix(keys) == NUM_BLOCKS  # and every write queued before it
    assert not writer.barrier(0.1)  # closed: refused
