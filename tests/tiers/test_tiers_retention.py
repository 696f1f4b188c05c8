"""Retention in the spill tiers, each against its real backend: a retained entry outlives
eviction until its TTL ends (host memory and LMDB on an injected clock, Redis on its own
expiry), and a retained prefix reaches every tier of a cache."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import torch
from tier_helpers import make_chain, namespace, wait_for

from hashing import Namespace
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig
from kvstore.stores import LmdbStore, MemoryStore, RedisStore

MAP_BYTES = 1 << 20  # 256 pages of 4 KiB
BIG = dict(layers=2, kv_heads=2, head_dim=64, block_size=16)  # 9 pages an entry


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def present(store, keys: list[bytes]) -> list[bool]:
    return [v is not None for v in store.get_many(keys)]


def test_memory_store_passes_over_a_retained_entry_until_its_ttl_ends() -> None:
    chain = make_chain(namespace(), num_blocks=12)
    size = len(chain.encoded[0])
    clock = Clock()
    store = MemoryStore(capacity_bytes=4 * size, policy="fifo", clock=clock)
    store.put_many(chain.items[:4])
    assert store.retain([chain.keys[0], b"\x00" * 16], 10.0) == 1  # the absent key: skipped
    store.put_many(chain.items[4:8])
    assert present(store, chain.keys[:8]) == [True, False, False, False, False, True, True, True]
    assert store.stats().retained == 1
    clock.now += 10.0  # its retention ends: FIFO takes it in its turn (it went behind 4)
    store.put_many(chain.items[8:12])
    assert present(store, chain.keys) == [False] * 8 + [True] * 4
    assert store.stats().retained == 0


def test_memory_store_evicts_retained_entries_when_nothing_else_is_left() -> None:
    chain = make_chain(namespace(), num_blocks=3)
    store = MemoryStore(capacity_bytes=2 * len(chain.encoded[0]), clock=Clock())
    store.put_many(chain.items[:2])
    assert store.retain(chain.keys[:2], 60.0) == 2
    assert store.put_many(chain.items[2:]) == 1  # a write is never refused for retention
    assert present(store, chain.keys)[2] and store.stats().entries == 2


def test_lmdb_eviction_respects_an_expiry_and_evicts_fifo_once_it_passed(tmp_path: Path) -> None:
    chain = make_chain(namespace(**BIG), num_blocks=80)
    clock = Clock()
    with LmdbStore(str(tmp_path / "db"), MAP_BYTES, clock=clock) as store:
        store.put_many(chain.items[:10])
        assert store.retain(chain.keys[:2], 30.0) == 2
        for item in chain.items[10:40]:  # well past the map: FIFO evicts
            store.put_many([item])
        s = store.stats()
        assert (s.retained, s.entries + s.evictions) == (2, 40)
        survivors = [True, True] + [False] * (40 - s.entries) + [True] * (s.entries - 2)
        assert present(store, chain.keys[:40]) == survivors  # FIFO, passing over the two
        clock.now += 30.0
        for item in chain.items[40:80]:
            store.put_many([item])
        assert present(store, chain.keys[:2]) == [False, False]
        assert store.stats().retained == 0


def test_lmdb_expiry_survives_reopening_and_delete_drops_it(tmp_path: Path) -> None:
    chain = make_chain(namespace(), num_blocks=3)
    clock = Clock()
    with LmdbStore(str(tmp_path / "db"), MAP_BYTES, clock=clock) as store:
        store.put_many(chain.items)
        store.retain(chain.keys, 60.0)
        store.retain(chain.keys[:1], 5.0)  # shorter: the longer retention stays
    with LmdbStore(str(tmp_path / "db"), MAP_BYTES, clock=clock) as store:
        clock.now += 59.0
        assert store.stats().retained == 3
        assert store.delete(chain.keys[:1]) == 1
        assert store.stats().retained == 2


def test_redis_retention_extends_a_short_ttl_and_the_entry_expires_at_its_end(
    redis_server,
) -> None:
    chain = make_chain(namespace(), num_blocks=2)
    with RedisStore(redis_server.url, uuid.uuid4().hex[:16], ttl_s=1) as store:
        store.put_many(chain.items)
        asked = time.monotonic()
        assert store.retain([chain.keys[0], b"\x00" * 16], 2.5) == 1
        admin = redis_server.client()
        rkey = store._rkey(chain.keys[0])
        assert 2000 < admin.pttl(rkey) <= 2500
        assert store.retain([chain.keys[0]], 1.0) == 1  # a shorter one never shortens it
        assert admin.pttl(rkey) > 1500
        wait_for(lambda: present(store, chain.keys) == [True, False], timeout_s=3.0)
        assert time.monotonic() - asked < 2.5
        wait_for(lambda: present(store, chain.keys) == [False, False], timeout_s=4.0)
        assert time.monotonic() - asked >= 2.4


def test_redis_retention_leaves_an_entry_without_expiry_persistent(redis_server) -> None:
    chain = make_chain(namespace(), num_blocks=1)
    with RedisStore(redis_server.url, uuid.uuid4().hex[:16]) as store:
        store.put_many(chain.items)
        assert store.retain(chain.keys, 60.0) == 1
        assert redis_server.client().pttl(store._rkey(chain.keys[0])) == -1


def test_a_retained_prefix_reaches_every_tier_of_a_cache(tmp_path: Path, redis_server) -> None:
    ns = Namespace("fp", "float32", 2, 2, 8, 4)
    config = CacheConfig(
        block_size=4,
        device_blocks=64,
        chunk_blocks=2,
        memory_cache_gb=0.01,  # write-back: written at retain, not at store
        lmdb_dir=str(tmp_path / "lmdb"),
        redis_url=redis_server.url,
        redis_ttl_s=5,
    )
    prompt = np.arange(41, dtype=np.uint32)  # 10 full blocks: 5 entries
    layers = [(torch.randn(1, 2, 41, 8), torch.randn(1, 2, 41, 8)) for _ in range(2)]
    with PrefixCache(config, ns) as cache:
        cache.store(prompt, layers)
        assert cache.flush(10.0)
        assert cache.stats()["tiers"]["memory"]["entries"] == 0
        assert cache.retain(prompt, 3600.0) == (10, 10, 5)
        assert cache.flush(10.0)
        tiers = cache.stats()["tiers"]
        assert [tiers[t]["retained"] for t in ("memory", "lmdb", "redis")] == [5, 5, None]
        assert tiers["memory"]["entries"] == 5
        keys = cache.block_keys(prompt)[1::2]
        redis = cache.tiers.stores[-1]
        assert all(redis_server.client().pttl(redis._rkey(k)) > 3_500_000 for k in keys)


def test_retention_on_a_dead_redis_retains_nothing_and_raises_nothing(redis_server) -> None:
    chain = make_chain(namespace(), num_blocks=2)
    with RedisStore(redis_server.url, uuid.uuid4().hex[:16], deadline_ms=50) as store:
        store.put_many(chain.items)
        redis_server.kill()
        assert store.retain(chain.keys, 60.0) == 0
        assert store.stats().errors == 1
