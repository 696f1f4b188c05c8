"""PrefixCache over real spill tiers: promotion, verification, write policies, failures."""

import threading

import numpy as np
import pytest
import torch

from hashing import Namespace
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig
from kvstore.stores import MemoryStore, make_stores

LAYERS, HEADS, BS, DIM = 2, 2, 4, 8
NS = Namespace("fp", "float32", LAYERS, HEADS, DIM, BS)


def kv_for(tokens: np.ndarray, scale: float = 1.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(int(tokens[:4].sum()))
    n = len(tokens)
    return [
        (
            torch.randn(1, HEADS, n, DIM, generator=g) * scale,
            torch.randn(1, HEADS, n, DIM, generator=g) * scale,
        )
        for _ in range(LAYERS)
    ]


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 5000, n).astype(np.uint32)


def tier_config(tier: str, tmp_path, redis_url: str | None = None, **kw) -> CacheConfig:
    base = {"block_size": BS, "device_blocks": 64, "lookup_deadline_ms": 500.0, **kw}
    if tier == "memory":
        base.setdefault("memory_cache_gb", 0.01)
        base.setdefault("memory_write_policy", "write-through")
    elif tier == "lmdb":
        base.update(lmdb_dir=str(tmp_path / "lmdb"), lmdb_map_size_gb=0.05)
    else:
        base["redis_url"] = redis_url
    return CacheConfig(**base)


def held_only_in_tiers(cache: PrefixCache, prompt: np.ndarray) -> None:
    """Store the prompt's K/V, write it to the tiers, and drop it from the device."""
    cache.store(prompt, kv_for(prompt))
    cache.flush(10)
    cache.evict_device()


def flip_a_payload_bit(store, key: bytes) -> None:
    """Rewrite the store's entry `key` with one bit flipped in its payload."""
    value = bytearray(store.get_many([key])[0])
    value[len(value) // 2] ^= 0x10
    store.delete([key])
    store.put_many([(key, bytes(value))])


def assert_kv_equal(loaded, expected, num_tokens: int) -> None:
    for (k, v), (k2, v2) in zip(expected, loaded.layers, strict=True):
        assert torch.equal(k[:, :, :num_tokens], k2) and torch.equal(v[:, :, :num_tokens], v2)


# staged: tier reads land in host memory and reach the pool in one copy, as a GPU pool's do
@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "host-staged"])
def test_blocks_only_in_a_tier_are_promoted_and_come_back_bit_exact(
    tier, redis_url, tmp_path, staged
):
    prompt = tokens(6 * BS + 2)
    kv = kv_for(prompt)
    with PrefixCache(tier_config(tier, tmp_path, redis_url), NS) as cache:
        cache.pool.stages_on_host = staged
        assert cache.store(prompt, kv) == 6
        assert cache.flush(10)
        assert cache.evict_device() == 6
        hit = cache.lookup(prompt)
        assert hit.num_cached_tokens == 6 * BS
        assert hit.tier_tokens == {tier: 6 * BS}
        assert_kv_equal(cache.load(hit), kv, 6 * BS)
        cache.release(hit)
        again = cache.lookup(prompt)  # now promoted: a device hit
        assert again.tier_tokens == {"device": 6 * BS}
        cache.release(again)
        assert cache.metrics.get("promoted_blocks_total") == 6
        cache.check_integrity()


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "host-staged"])
def test_a_corrupted_tier_entry_is_a_miss_that_is_deleted_and_counted(
    tier, redis_url, tmp_path, staged
):
    prompt = tokens(5 * BS + 1, seed=3)
    with PrefixCache(tier_config(tier, tmp_path, redis_url), NS) as cache:
        cache.pool.stages_on_host = staged
        held_only_in_tiers(cache, prompt)
        store = cache.tiers.stores[0]
        key = cache.hasher.hash_blocks(prompt)[2]
        flip_a_payload_bit(store, key)
        hit = cache.lookup(prompt)
        assert hit.num_cached_tokens == 2 * BS  # stops at the bad block
        cache.release(hit)
        assert store.get_many([key]) == [None]
        assert store.stats().verify_failures == 1
        assert cache.metrics.get("verify_failures_total", tier=tier, reason="checksum") == 1


def test_a_perturbed_but_well_formed_entry_fails_the_comparison_with_reference(tmp_path):
    """Control: a block re-encoded with other KV verifies, so only the equivalence check
    against the original KV catches it; the round-trip assert must then fail."""
    from kvstore.entry import BlockEntry, decode_entry, encode_entry

    prompt = tokens(3 * BS + 1, seed=4)
    kv = kv_for(prompt)
    with PrefixCache(tier_config("lmdb", tmp_path), NS) as cache:
        cache.store(prompt, kv)
        cache.flush(10)
        cache.evict_device()
        store, keys = cache.tiers.stores[0], cache.hasher.hash_blocks(prompt)
        digests = cache.hasher.digest_blocks(prompt)
        e = decode_entry(
            store.get_many([keys[1]])[0],
            namespace=NS.root(),
            key=keys[1],
            digest=digests[1],
            dtype=torch.float32,
        )
        bad = BlockEntry(e.namespace, e.key, e.digest, e.parent, e.token_ids, e.kv + 1e-3)
        store.delete([keys[1]])
        store.put_many([(keys[1], encode_entry(bad))])
        hit = cache.lookup(prompt)
        assert hit.num_cached_tokens == 3 * BS
        with pytest.raises(AssertionError):
            assert_kv_equal(cache.load(hit), kv, 3 * BS)
        cache.release(hit)


def test_a_second_cache_with_an_empty_pool_hits_the_shared_tier(tmp_path, request):
    for tier in ("lmdb", "redis"):
        url = request.getfixturevalue("redis_server").url if tier == "redis" else None
        prompt = tokens(7 * BS, seed=5)
        kv = kv_for(prompt)
        with PrefixCache(tier_config(tier, tmp_path, url), NS) as writer:
            writer.store(prompt, kv)
        with PrefixCache(tier_config(tier, tmp_path, url), NS) as reader:
            hit = reader.lookup(prompt)
            assert hit.tier_tokens == {tier: 6 * BS}  # capped: the last token is computed
            assert_kv_equal(reader.load(hit), kv, 6 * BS)
            reader.release(hit)
        other = Namespace("other-model", "float32", LAYERS, HEADS, DIM, BS)
        with PrefixCache(tier_config(tier, tmp_path, url), other) as stranger:
            assert stranger.lookup(prompt).num_cached_tokens == 0


def test_write_back_tier_receives_blocks_evicted_from_the_device(tmp_path):
    config = CacheConfig(block_size=BS, device_blocks=8, memory_cache_gb=0.01)
    a, b = tokens(6 * BS + 1, seed=6), tokens(6 * BS + 1, seed=7)
    with PrefixCache(config, NS) as cache:
        cache.store(a, kv_for(a))
        cache.flush(10)
        assert cache.tiers.stores[0].stats().entries == 0  # write-back: nothing yet
        cache.store(b, kv_for(b))  # evicts 4 of a's 6 blocks, tail first
        cache.flush(10)
        assert cache.tiers.stores[0].stats().entries == 4
        hit = cache.lookup(a)
        assert hit.tier_tokens == {"device": 2 * BS, "memory": 4 * BS}
        assert_kv_equal(cache.load(hit), kv_for(a), 6 * BS)
        cache.release(hit)
        cache.check_integrity()


def test_selective_write_through_writes_blocks_once_hit_n_times(tmp_path):
    config = CacheConfig(
        block_size=BS,
        device_blocks=32,
        memory_cache_gb=0.01,
        memory_write_policy="selective",
        selective_min_hits=2,
    )
    prompt = tokens(4 * BS + 1, seed=8)
    with PrefixCache(config, NS) as cache:
        cache.store(prompt, kv_for(prompt))
        store = cache.tiers.stores[0]
        cache.release(cache.lookup(prompt))
        cache.flush(10)
        assert store.stats().entries == 0
        cache.release(cache.lookup(prompt))
        cache.flush(10)
        assert store.stats().entries == 4


class GatedMemoryStore(MemoryStore):
    """A real MemoryStore whose writes wait for a gate (to hold writes in the queue)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.gate = threading.Event()

    def put_many(self, items):
        self.gate.wait(10)
        return super().put_many(items)


def test_a_block_reused_while_its_write_is_queued_never_lands_under_the_old_key():
    config = CacheConfig(block_size=BS, device_blocks=4, memory_write_policy="write-through")
    store = GatedMemoryStore(10**7)
    a, b = tokens(4 * BS + 1, seed=9), tokens(4 * BS + 1, seed=10)
    with PrefixCache(config, NS, stores=[store]) as cache:
        cache.store(a, kv_for(a))  # write of a queued, held at the gate
        ids_a = cache.lookup(a)
        cache.release(ids_a)
        cache.store(b, kv_for(b))  # evicts a; b reuses a's block ids
        hit_b = cache.lookup(b)
        assert sorted(hit_b.block_ids) == sorted(ids_a.block_ids)
        cache.release(hit_b)
        store.gate.set()
        assert cache.flush(10)
        cache.evict_device()
        hit = cache.lookup(a)
        assert hit.tier_tokens == {"memory": 4 * BS}
        assert_kv_equal(cache.load(hit), kv_for(a), 4 * BS)
        cache.release(hit)


def test_forced_key_collisions_in_a_tier_are_misses_never_wrong_kv(tmp_path):
    from hashing import BlockHasher

    config = tier_config("lmdb", tmp_path, key_bytes=1)
    hasher = BlockHasher(NS, config.secret_bytes, key_bytes=1)
    a = tokens(BS + 1, seed=11)
    target = hasher.hash_blocks(a)[0]
    rng = np.random.default_rng(12)
    b = next(
        c
        for c in (rng.integers(0, 5000, BS + 1).astype(np.uint32) for _ in range(10**5))
        if hasher.hash_blocks(c)[0] == target and not np.array_equal(c[:BS], a[:BS])
    )
    with PrefixCache(config, NS) as cache:
        cache.store(a, kv_for(a))
        cache.flush(10)
        cache.evict_device()
        hit = cache.lookup(b)
        assert hit.num_cached_tokens == 0
        cache.release(hit)
        assert cache.tiers.stores[0].stats().verify_failures == 1


def test_redis_down_degrades_to_misses_and_never_fails_a_request(redis_server):
    config = CacheConfig(
        block_size=BS,
        device_blocks=16,
        redis_url=redis_server.url,
        lookup_deadline_ms=100.0,
        breaker_failures=2,
    )
    prompt = tokens(3 * BS + 1, seed=13)
    with PrefixCache(config, NS) as cache:
        redis_server.kill()
        assert cache.store(prompt, kv_for(prompt)) == 3  # device tier still works
        cache.evict_device()
        for _ in range(3):
            hit = cache.lookup(prompt)
            assert hit.num_cached_tokens == 0
            cache.release(hit)
        assert cache.tiers.stores[0].stats().breaker_state == "open"


def test_a_redis_down_at_start_is_one_warning_and_the_cache_still_serves(redis_server, caplog):
    url = redis_server.url
    redis_server.kill()
    config = CacheConfig(block_size=BS, device_blocks=16, redis_url=url, breaker_failures=5)
    prompt = tokens(3 * BS + 1, seed=14)
    with caplog.at_level("WARNING", logger="kvstore"), PrefixCache(config, NS) as cache:
        assert [r.getMessage() for r in caplog.records] == [
            f"redis tier unreachable at start ({url}: ConnectionError: Error 111 connecting to "
            f"127.0.0.1:{redis_server.port}. Connection refused.): lookups miss it and writes "
            "to it are dropped until it answers"
        ]
        assert cache.store(prompt, kv_for(prompt)) == 3
        hit = cache.lookup(prompt)
        assert hit.num_cached_tokens == 3 * BS  # from the device pool
        cache.release(hit)


def test_load_into_copies_blocks_into_a_callers_paged_buffer(tmp_path):
    prompt = tokens(3 * BS + 1, seed=14)
    kv = kv_for(prompt)
    with PrefixCache(CacheConfig(block_size=BS, device_blocks=8), NS) as cache:
        cache.store(prompt, kv)
        hit = cache.lookup(prompt)
        dst = torch.zeros(10, LAYERS, 2, HEADS, BS, DIM)
        assert cache.load_into(hit, dst, [7, 2, 5]) == 3 * BS
        assert torch.equal(dst[2, 1, 0], kv[1][0][0, :, BS : 2 * BS])  # block 1, layer 1, K
        assert torch.equal(dst[5, 0, 1], kv[0][1][0, :, 2 * BS : 3 * BS])  # block 2, layer 0, V
        with pytest.raises(ValueError, match="block_table"):
            cache.load_into(hit, dst, [1])
        cache.release(hit)


def test_request_salts_isolate_tenants_in_the_device_pool_and_every_tier(tmp_path, redis_server):
    config = CacheConfig(block_size=BS, device_blocks=8, memory_cache_gb=0.01,
                         lmdb_dir=str(tmp_path / "lmdb"), redis_url=redis_server.url)  # fmt: skip
    a = tokens(6 * BS + 1, seed=15)
    with PrefixCache(config, NS) as cache:
        cache.store(a, kv_for(a), cache_salt="tenant-x")
        for salt, expected in (("tenant-y", 0), ("", 0), ("tenant-x", 6 * BS)):
            hit = cache.lookup(a, cache_salt=salt)
            assert hit.num_cached_tokens == expected
            cache.release(hit)
        b = tokens(8 * BS, seed=16)
        cache.store(b, kv_for(b), cache_salt="tenant-y")  # evicts x's blocks: memory gets them
        cache.flush(10)
        assert cache.tiers.stores[0].stats().entries == 6
    with PrefixCache(config, NS) as fresh:  # empty pool and memory tier: lmdb, redis remain
        for salt, expected in (("tenant-y", 0), ("", 0), ("tenant-x", 6 * BS)):
            hit = fresh.lookup(a, cache_salt=salt)
            assert hit.num_cached_tokens == expected
            if expected:
                assert hit.tier_tokens == {"lmdb": 6 * BS}
                assert_kv_equal(fresh.load(hit), kv_for(a), 6 * BS)
            fresh.release(hit)
        assert fresh.tiers.stores[1].stats().verify_failures == 0


def test_write_back_of_a_salted_prefix_verifies_under_its_salt():
    config = CacheConfig(block_size=BS, device_blocks=8, memory_cache_gb=0.01)
    a, b = tokens(6 * BS + 1, seed=17), tokens(8 * BS, seed=18)
    with PrefixCache(config, NS) as cache:
        cache.store(a, kv_for(a), cache_salt="t1")
        cache.store(b, kv_for(b))  # evicts all of a into the write-back memory tier
        cache.flush(10)
        hit = cache.lookup(a, cache_salt="t1")
        assert hit.tier_tokens == {"memory": 6 * BS}
        assert_kv_equal(cache.load(hit), kv_for(a), 6 * BS)
        cache.release(hit)


def test_a_hit_in_a_slower_tier_fills_the_faster_write_through_tiers(tmp_path, redis_server):
    prompt = tokens(5 * BS + 1, seed=19)
    lmdb = {"lmdb_dir": str(tmp_path / "lmdb"), "lmdb_map_size_gb": 0.05}
    with PrefixCache(CacheConfig(block_size=BS, redis_url=redis_server.url), NS) as writer:
        writer.store(prompt, kv_for(prompt))  # Redis only
    both = CacheConfig(block_size=BS, redis_url=redis_server.url, **lmdb)
    with PrefixCache(both, NS) as replica:
        hit = replica.lookup(prompt)
        assert hit.tier_tokens == {"redis": 5 * BS}
        replica.release(hit)
    with PrefixCache(CacheConfig(block_size=BS, **lmdb), NS) as local:  # LMDB alone now hits
        hit = local.lookup(prompt)
        assert hit.tier_tokens == {"lmdb": 5 * BS}
        assert_kv_equal(local.load(hit), kv_for(prompt), 5 * BS)
        local.release(hit)


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "host-staged"])
@pytest.mark.parametrize(
    "entries",
    [{}, {"codec": "int8"}, {"kv_cache_dtype": "int8"}],
    ids=["none", "int8", "int8-pool"],
)
def test_caches_with_two_secrets_share_a_tier_without_deleting_each_others_entries(
    tier, redis_url, tmp_path, caplog, staged, entries
):
    """A misconfigured process (another secret) must not empty a shared tier: each cache
    reads the other's entries as foreign misses, keeps them, and says why once; so with
    quantized entries, whose hot paths differ (a quantized pool copies its rows as they are,
    an auto pool dequantizes them)."""
    prompts = {"a": tokens(4 * BS + 1, seed=10), "b": tokens(4 * BS + 1, seed=11)}
    config = {s: tier_config(tier, tmp_path, redis_url, secret=s, **entries) for s in "ab"}
    (store,) = make_stores(config["a"], config["a"].bind(NS))  # one store both caches share
    caches = {s: PrefixCache(config[s], NS, [store]) for s in "ab"}
    for s, cache in caches.items():
        cache.pool.stages_on_host = staged
        assert cache.store(prompts[s], kv_for(prompts[s])) == 4
        assert cache.flush(10)
        cache.evict_device()
    assert store.stats().entries in (8, None)  # Redis does not count cheaply
    with caplog.at_level("WARNING", logger="kvstore.tiers"):
        for reader, writer in (("a", "b"), ("b", "a")):
            hit = caches[reader].lookup(prompts[writer])
            assert hit.num_cached_tokens == 0  # foreign: a miss ...
            caches[reader].release(hit)
            keys = caches[writer].hasher.hash_blocks(prompts[writer])
            assert store.contains_many(keys) == [True] * 4  # ... never deleted
            assert caches[reader].metrics.get("foreign_entries_total", tier=tier,
                                              reason="secret") == 1  # fmt: skip
    announced = [r for r in caplog.records if "KVSTORE_SECRET" in r.message]
    assert len(announced) == 2
    for s, cache in caches.items():  # each still reads its own, bit-exact
        cache.evict_device()
        hit = cache.lookup(prompts[s])
        assert hit.tier_tokens == {tier: 4 * BS}
        if not entries:  # lossless: bit-exact (the quantized ones: tests of their own)
            assert_kv_equal(cache.load(hit), kv_for(prompts[s]), 4 * BS)
        cache.release(hit)
    assert (store.stats().verify_failures, store.stats().foreign) == (2, 2)
    for cache in caches.values():
        cache.close()


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "host-staged"])
def test_a_damaged_memory_entry_is_read_from_lmdb_behind_it(tmp_path, staged):
    prompt = tokens(5 * BS + 1, seed=20)
    config = tier_config("memory", tmp_path, lmdb_dir=str(tmp_path / "lmdb"),
                         lmdb_map_size_gb=0.05, lmdb_write_policy="write-through")  # fmt: skip
    with PrefixCache(config, NS) as cache:
        cache.pool.stages_on_host = staged
        held_only_in_tiers(cache, prompt)
        flip_a_payload_bit(cache.tiers.stores[0], cache.hasher.hash_blocks(prompt)[0])
        hit = cache.lookup(prompt)  # memory fails at its first block: all 5 come from LMDB
        assert hit.tier_tokens == {"lmdb": 5 * BS}
        assert_kv_equal(cache.load(hit), kv_for(prompt), 5 * BS)
        cache.release(hit)
        cache.check_integrity()


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "host-staged"])
def test_a_tenant_at_its_quota_gets_a_tier_miss_not_an_error(tmp_path, staged):
    first, second = tokens(6 * BS + 2, seed=21), tokens(6 * BS + 2, seed=22)
    with PrefixCache(tier_config("memory", tmp_path, tenant_quota_blocks=2), NS) as cache:
        cache.pool.stages_on_host = staged
        for prompt in (first, second):
            cache.store(prompt, kv_for(prompt))
        cache.flush(10)
        cache.evict_device()
        held = cache.lookup(first, tenant="t")
        assert held.num_cached_tokens == 2 * BS  # the quota's 2 blocks
        hit = cache.lookup(second, tenant="t")  # no block left to promote into
        assert hit.num_cached_tokens == 0
        cache.release(hit)
        cache.release(held)
        cache.check_integrity()
