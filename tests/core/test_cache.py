import numpy as np
import pytest
import torch

from hashing import Namespace
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig, ConfigError

LAYERS, HEADS, BS, DIM = 2, 2, 4, 8


def make_cache(num_blocks: int = 64, **kw) -> PrefixCache:
    ns = Namespace("fp", "float32", LAYERS, HEADS, DIM, BS)
    return PrefixCache(CacheConfig(block_size=BS, device_blocks=num_blocks, **kw), ns)


def kv_for(tokens: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic fake K/V that depends on each token and its position (prefix-consistent)."""
    t = torch.as_tensor(tokens.astype(np.int64), dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    base = (t * 0.01 + pos * 0.001).view(1, 1, -1, 1)
    grid = torch.arange(HEADS * DIM, dtype=torch.float32).view(1, HEADS, 1, DIM)
    return [(base + grid + layer, -(base + grid) - layer) for layer in range(LAYERS)]


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n).astype(np.uint32)


def test_empty_cache_misses():
    cache = make_cache()
    hit = cache.lookup(tokens(20))
    assert (hit.num_cached_tokens, hit.block_ids) == (0, [])
    assert cache.load(hit).num_tokens == 0
    cache.release(hit)
    cache.check_integrity()


def test_store_then_lookup_hits_every_full_block_and_loads_bit_exact_kv():
    cache = make_cache()
    prompt = tokens(10 * BS + 3)
    assert cache.store(prompt, kv_for(prompt)) == 10
    hit = cache.lookup(prompt)
    assert hit.num_cached_tokens == 10 * BS
    loaded = cache.load(hit)
    assert loaded.num_tokens == 10 * BS
    for (k, v), (k2, v2) in zip(kv_for(prompt[: 10 * BS]), loaded.layers, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    cache.release(hit)
    cache.check_integrity()


def test_hit_is_capped_so_the_last_token_is_computed():
    cache = make_cache()
    prompt = tokens(8 * BS)
    cache.store(prompt, kv_for(prompt))
    hit = cache.lookup(prompt)  # exactly 8 blocks long: at most 7 may come from cache
    assert hit.num_cached_tokens == 7 * BS
    cache.release(hit)
    one_past = np.concatenate([prompt, [7]]).astype(np.uint32)
    hit = cache.lookup(one_past)
    assert hit.num_cached_tokens == 8 * BS
    cache.release(hit)
    assert cache.lookup(prompt[:1]).num_cached_tokens == 0


def test_shared_prefix_with_a_different_suffix_hits_the_shared_blocks():
    cache = make_cache()
    a = tokens(12 * BS)
    b = a.copy()
    b[5 * BS + 1] += 1  # diverge inside block 5
    cache.store(a, kv_for(a))
    hit = cache.lookup(b)
    assert hit.num_cached_tokens == 5 * BS
    cache.release(hit)
    assert cache.store(b, kv_for(b)) == 7
    cache.check_integrity()


def test_peek_counts_device_cached_tokens_and_records_nothing():
    cache = make_cache()
    a = tokens(12 * BS)
    cache.store(a, kv_for(a))
    b = a.copy()
    b[5 * BS + 1] += 1  # diverge inside block 5
    before = cache.metrics.snapshot()
    assert cache.peek(b) == 5 * BS
    assert cache.peek(a) == 12 * BS  # whole blocks of all the tokens
    assert cache.peek(a, cache_salt="other") == 0
    assert cache.metrics.snapshot() == before  # no lookup, no hit counted
    cache.check_integrity()  # and no lock left behind


def test_storing_a_cached_prompt_again_adds_nothing():
    cache = make_cache()
    prompt = tokens(6 * BS)
    assert cache.store(prompt, kv_for(prompt)) == 6
    free = cache.pool.num_free_blocks
    assert cache.store(prompt, kv_for(prompt)) == 0
    assert cache.pool.num_free_blocks == free
    cache.check_integrity()


def test_store_covers_only_tokens_that_have_kv():
    cache = make_cache()
    prompt = tokens(6 * BS)
    assert cache.store(prompt, kv_for(prompt[: 3 * BS + 2])) == 3


def test_locked_hit_survives_eviction_and_store_shrinks_instead_of_failing():
    cache = make_cache(num_blocks=8)
    a, b = tokens(6 * BS + 1, seed=1), tokens(6 * BS + 1, seed=2)
    cache.store(a, kv_for(a))
    hit = cache.lookup(a)
    assert hit.num_cached_tokens == 6 * BS
    assert cache.store(b, kv_for(b)) == 2  # only the 2 free blocks; a's 6 are locked
    cache.check_integrity()
    loaded = cache.load(hit)
    assert torch.equal(loaded.layers[0][0], kv_for(a[: 6 * BS])[0][0])
    cache.release(hit)
    c = tokens(8 * BS, seed=3)
    assert cache.store(c, kv_for(c)) == 8  # everything unlocked can go now
    assert cache.lookup(a).num_cached_tokens == 0
    cache.check_integrity()


def test_release_is_idempotent_and_load_after_release_is_an_error():
    cache = make_cache()
    prompt = tokens(3 * BS)
    cache.store(prompt, kv_for(prompt))
    hit = cache.lookup(prompt)
    cache.release(hit)
    cache.release(hit)
    with pytest.raises(ValueError, match="released"):
        cache.load(hit)
    cache.check_integrity()


def test_stats_count_queries_and_hits_in_tokens():
    cache = make_cache()
    prompt = tokens(4 * BS + 1)
    cache.release(cache.lookup(prompt))
    cache.store(prompt, kv_for(prompt))
    cache.release(cache.lookup(prompt))
    stats = cache.stats()
    assert cache.metrics.get("prefix_cache_queries_tokens_total") == 2 * (4 * BS + 1)
    assert stats["hits_tokens"] == {"device": 4 * BS}
    assert stats["device"]["blocks_cached"] == 4


def test_block_size_must_match_the_namespace():
    ns = Namespace("fp", "float32", LAYERS, HEADS, DIM, BS * 2)
    with pytest.raises(ConfigError, match="block_size"):
        PrefixCache(CacheConfig(block_size=BS, device_blocks=4), ns)


def test_bad_token_ids_raise_a_typed_error():
    from hashing import InvalidTokens

    cache = make_cache()
    with pytest.raises(InvalidTokens):
        cache.lookup([1, -2, 3])
    with pytest.raises(InvalidTokens):
        cache.lookup([[1, 2], [3, 4]])


def test_config_codec_and_salt_join_the_namespace_so_they_never_share_blocks():
    ns = Namespace("fp", "float32", LAYERS, HEADS, DIM, BS)
    plain = PrefixCache(CacheConfig(block_size=BS, device_blocks=4), ns)
    salted = PrefixCache(CacheConfig(block_size=BS, device_blocks=4, tenant_salt="t1"), ns)
    zstd = PrefixCache(CacheConfig(block_size=BS, device_blocks=4, codec="zstd"), ns)
    roots = {c.hasher.root for c in (plain, salted, zstd)}
    assert len(roots) == 3
    assert (salted.namespace.salt, zstd.namespace.codec) == ("t1", "zstd")
    with pytest.raises(ConfigError, match="tenant_salt"):
        PrefixCache(CacheConfig(block_size=BS, device_blocks=4, tenant_salt="a"),
                    ns.with_salt("b"))  # fmt: skip


def test_tenant_quota_caps_each_owners_device_blocks_and_frees_on_eviction():
    cache = make_cache(num_blocks=16, tenant_quota_blocks=4)
    a, b = tokens(6 * BS, seed=1), tokens(6 * BS, seed=2)
    assert cache.store(a, kv_for(a), tenant="x") == 4  # capped: a shorter prefix
    assert cache.store(a, kv_for(a), tenant="x") == 0  # at quota
    assert cache.store(b, kv_for(b), tenant="y") == 4  # y has its own quota
    hit = cache.lookup(np.concatenate([a, [1]]).astype(np.uint32), tenant="x")
    assert hit.num_cached_tokens == 4 * BS
    cache.release(hit)
    assert cache.evict_device() == 8
    assert cache.store(b, kv_for(b), tenant="x") == 4  # x's evicted blocks no longer count
    cache.check_integrity()


def test_quota_counts_per_owner_not_per_salt():
    cache = make_cache(num_blocks=16, tenant_quota_blocks=3)
    a = tokens(3 * BS, seed=3)
    assert cache.store(a, kv_for(a), cache_salt="s1", tenant="x") == 3
    assert cache.store(a, kv_for(a), cache_salt="s2", tenant="x") == 0  # another salt, same tenant
    assert cache.store(a, kv_for(a), cache_salt="s2", tenant="z") == 3
