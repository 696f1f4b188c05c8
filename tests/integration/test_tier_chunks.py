"""Chunked tier entries (chunk_blocks = N): one stored value holds N consecutive blocks,
aligned from the root and keyed by its last block. Real LMDB and a real redis-server."""

import numpy as np
import pytest
import torch

from hashing import BlockHasher, Namespace
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig
from kvstore.entry import ExpectedEntry, read_header

LAYERS, HEADS, BS, DIM = 2, 2, 4, 8
NS = Namespace("fp-chunks", "float32", LAYERS, HEADS, DIM, BS)


def kv_for(tokens: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(int(tokens[:4].sum()))
    n = len(tokens)
    return [
        (torch.randn(1, HEADS, n, DIM, generator=g), torch.randn(1, HEADS, n, DIM, generator=g))
        for _ in range(LAYERS)
    ]


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 5000, n).astype(np.uint32)


def whole_chunk_blocks(num_blocks: int, chunk: int) -> int:
    return num_blocks // chunk * chunk


@pytest.fixture(params=[1, 4], ids=["chunk1", "chunk4"])
def chunk(request) -> int:
    return request.param


@pytest.fixture(params=["lmdb", "redis"])
def tier(request) -> str:
    return request.param


@pytest.fixture
def make_config(tier, chunk, tmp_path, request):
    url = request.getfixturevalue("redis_server").url if tier == "redis" else None

    def make(**kw) -> CacheConfig:
        base = {
            "block_size": BS,
            "device_blocks": 64,
            "chunk_blocks": chunk,
            "lookup_deadline_ms": 500.0,
            **kw,
        }
        if tier == "lmdb":
            base.update(lmdb_dir=str(tmp_path / "lmdb"), lmdb_map_size_gb=0.05)
        else:
            base["redis_url"] = url
        return CacheConfig(**base)

    return make


def num_stored_entries(cache: PrefixCache, tier: str, request) -> int:
    if tier == "redis":
        return request.getfixturevalue("redis_server").client().dbsize()
    return cache.tiers.stores[0].stats().entries


def assert_kv_equal(loaded, expected, num_tokens: int) -> None:
    assert loaded.num_tokens == num_tokens
    for (k, v), (k2, v2) in zip(expected, loaded.layers, strict=True):
        assert torch.equal(k[:, :, :num_tokens], k2) and torch.equal(v[:, :, :num_tokens], v2)


@pytest.mark.parametrize("num_tokens", [10 * BS + 2, 8 * BS], ids=["ragged", "aligned"])
def test_a_fresh_cache_gets_whole_chunks_back_bit_exact(
    make_config, tier, chunk, num_tokens, request
):
    prompt = tokens(num_tokens, seed=1)
    kv = kv_for(prompt)
    stored = num_tokens // BS
    with PrefixCache(make_config(), NS) as writer:
        assert writer.store(prompt, kv) == stored
        assert writer.flush(10)
        assert writer.evict_device() == stored
        assert num_stored_entries(writer, tier, request) == stored // chunk
    with PrefixCache(make_config(), NS) as reader:
        hit = reader.lookup(prompt)
        # whole chunks only, capped below the last prompt token (8*BS tokens: 7 blocks at most)
        expected = min(whole_chunk_blocks(stored, chunk), (num_tokens - 1) // BS) * BS
        assert hit.num_cached_tokens == expected
        assert hit.tier_tokens == {tier: expected}
        assert_kv_equal(reader.load(hit), kv, expected)
        reader.release(hit)
        assert reader.metrics.get("promoted_blocks_total") == expected // BS
        reader.check_integrity()


def test_stored_entries_hold_chunk_blocks_keyed_by_their_last_block(make_config, tier, chunk):
    prompt = tokens(9 * BS + 1, seed=2)
    with PrefixCache(make_config(), NS) as cache:
        cache.store(prompt, kv_for(prompt))
        assert cache.flush(10)
        keys = cache.hasher.hash_blocks(prompt)
        store = cache.tiers.stores[0]
        last_blocks = [c * chunk + chunk - 1 for c in range(9 // chunk)]
        values = store.get_many([keys[i] for i in last_blocks])
        headers = [read_header(v) for v in values]
        assert [h.num_blocks for h in headers] == [chunk] * len(last_blocks)
        assert [h.parent for h in headers] == [cache.hasher.root] + [
            keys[i] for i in last_blocks[:-1]
        ]
        others = [k for i, k in enumerate(keys) if i not in last_blocks]
        assert store.get_many(others) == [None] * len(others)
        # the readers' fast verification accepts exactly what the writer wrote
        template = ExpectedEntry(NS.root(), torch.float32, headers[0].shape, chunk)
        digests, token_bytes = cache.hasher.digest_blocks(prompt), prompt.tobytes()
        for c, (value, header) in enumerate(zip(values, headers, strict=True)):
            step = chunk * BS * 4
            i, tokens_c = last_blocks[c], token_bytes[c * step : (c + 1) * step]
            assert template.kv(value, keys[i], digests[i], header.parent, tokens_c) is not None
            assert template.kv(value, keys[i], digests[i], keys[i], tokens_c) is None  # parent


def test_a_device_hit_ending_mid_chunk_is_completed_from_the_tier(
    make_config, tier, chunk, request
):
    prompt = tokens(12 * BS + 1, seed=3)
    kv = kv_for(prompt)
    with PrefixCache(make_config(), NS) as writer:
        writer.store(prompt, kv)
    with PrefixCache(make_config(), NS) as cache:
        cache.store(prompt[: 6 * BS], [(k[:, :, : 6 * BS], v[:, :, : 6 * BS]) for k, v in kv])
        assert cache.flush(10)
        hit = cache.lookup(prompt)
        assert hit.num_cached_tokens == 12 * BS
        assert hit.tier_tokens == {"device": 6 * BS, tier: 6 * BS}
        assert_kv_equal(cache.load(hit), kv, 12 * BS)
        cache.release(hit)
        assert cache.metrics.get("promoted_blocks_total") == 6
        assert num_stored_entries(cache, tier, request) == 12 // chunk
        cache.check_integrity()


def test_write_through_completes_a_chunk_with_blocks_already_on_the_device(
    make_config, tier, chunk, request
):
    long = tokens(10 * BS + 1, seed=4)
    kv = kv_for(long)
    with PrefixCache(make_config(), NS) as cache:
        cache.store(long[: 6 * BS], [(k[:, :, : 6 * BS], v[:, :, : 6 * BS]) for k, v in kv])
        assert cache.flush(10)
        assert num_stored_entries(cache, tier, request) == 6 // chunk
        assert cache.store(long, kv) == 4  # blocks 6..9; chunk [4, 8) reads 4, 5 from the pool
        assert cache.flush(10)
        assert num_stored_entries(cache, tier, request) == 10 // chunk
    with PrefixCache(make_config(), NS) as reader:
        hit = reader.lookup(long)
        assert hit.num_cached_tokens == whole_chunk_blocks(10, chunk) * BS
        assert_kv_equal(reader.load(hit), kv, hit.num_cached_tokens)
        reader.release(hit)


def test_a_corrupted_chunk_is_a_miss_from_that_chunk_on_and_is_counted(make_config, tier, chunk):
    prompt = tokens(12 * BS + 1, seed=5)
    with PrefixCache(make_config(), NS) as writer:
        writer.store(prompt, kv_for(prompt))
        assert writer.flush(10)
        bad_chunk = 5 // chunk  # the entry holding block 5
        key = writer.hasher.hash_blocks(prompt)[bad_chunk * chunk + chunk - 1]
        store = writer.tiers.stores[0]
        value = bytearray(store.get_many([key])[0])
        value[len(value) // 2] ^= 0x10  # one flipped bit in the payload
        store.delete([key])
        store.put_many([(key, bytes(value))])
    with PrefixCache(make_config(), NS) as reader:
        hit = reader.lookup(prompt)
        assert hit.num_cached_tokens == bad_chunk * chunk * BS
        reader.release(hit)
        store = reader.tiers.stores[0]
        assert store.get_many([key]) == [None]
        assert store.stats().verify_failures == 1
        assert reader.metrics.get("verify_failures_total", tier=tier, reason="checksum") == 1


@pytest.mark.parametrize("chunk_blocks", [1, 4])
def test_write_back_completes_chunks_from_ancestors_and_skips_partial_ones(chunk_blocks):
    config = CacheConfig(
        block_size=BS, device_blocks=8, memory_cache_gb=0.01, chunk_blocks=chunk_blocks
    )
    a, b = tokens(6 * BS + 1, seed=6), tokens(6 * BS + 1, seed=7)
    with PrefixCache(config, NS) as cache:
        cache.store(a, kv_for(a))
        cache.store(b, kv_for(b))  # evicts blocks 2..5 of a
        assert cache.flush(10)
        # chunk 4: [0, 4) is written (0, 1 still on the device), [4, 8) is partial: skipped
        assert cache.tiers.stores[0].stats().entries == (4 if chunk_blocks == 1 else 1)
        hit = cache.lookup(a)
        tier_blocks = 4 if chunk_blocks == 1 else 2
        assert hit.tier_tokens == {"device": 2 * BS, "memory": tier_blocks * BS}
        assert_kv_equal(cache.load(hit), kv_for(a), (2 + tier_blocks) * BS)
        cache.release(hit)
        cache.check_integrity()


def test_selective_write_through_writes_whole_chunks_once_hit_n_times():
    config = CacheConfig(
        block_size=BS,
        device_blocks=32,
        memory_cache_gb=0.01,
        chunk_blocks=4,
        memory_write_policy="selective",
        selective_min_hits=2,
    )
    prompt = tokens(6 * BS + 1, seed=8)
    with PrefixCache(config, NS) as cache:
        cache.store(prompt, kv_for(prompt))
        store = cache.tiers.stores[0]
        for expected in (0, 1):  # the second hit writes chunk [0, 4); [4, 8) is partial
            cache.release(cache.lookup(prompt))
            assert cache.flush(10)
            assert store.stats().entries == expected


def test_a_write_larger_than_the_writer_buffer_goes_out_in_verified_batches(tmp_path, chunk):
    from kvstore.entry import ExpectedEntry, decode_entry
    from kvstore.metrics import CacheMetrics
    from kvstore.scopes import Scope
    from kvstore.stores import LmdbStore
    from kvstore.tiers import PendingWrite, TierWriter

    hasher = BlockHasher(NS)
    prompt = tokens(8 * BS, seed=9)
    keys, digests = hasher.hash_blocks(prompt), hasher.digest_blocks(prompt)
    kv = torch.randn(8, LAYERS, 2, HEADS, BS, DIM)
    shape = (LAYERS, 2, HEADS, chunk * BS, DIM)
    template = ExpectedEntry(NS.root(), torch.float32, shape, chunk)
    store = LmdbStore(str(tmp_path / "lmdb"), 2**22)
    metrics = CacheMetrics()
    writer = TierWriter([store], "none", 64, metrics, arena_bytes=1)
    scope = Scope("", hasher, NS.root(), template)
    last = list(range(chunk - 1, 8, chunk))
    entry_keys, entry_digests = [keys[i] for i in last], [digests[i] for i in last]
    writer.write(PendingWrite(entry_keys, entry_digests, hasher.root, prompt, kv, (0,), scope))
    writer.close(10)
    assert metrics.get("tier_writes_blocks_total", tier="lmdb") == 8
    for n, (key, digest) in enumerate(zip(entry_keys, entry_digests, strict=True)):
        entry = decode_entry(
            store.get_many([key])[0],
            namespace=NS.root(),
            key=key,
            digest=digest,
            dtype=torch.float32,
            shape=shape,
        )
        blocks = kv[n * chunk : (n + 1) * chunk].permute(1, 2, 3, 0, 4, 5).reshape(shape)
        assert torch.equal(entry.kv, blocks)
    store.close()


def test_chunks_of_a_compressing_codec_round_trip_through_the_general_path(tmp_path, chunk):
    config = CacheConfig(
        block_size=BS,
        device_blocks=64,
        chunk_blocks=chunk,
        codec="lz4",
        lmdb_dir=str(tmp_path / "lmdb"),
        lmdb_map_size_gb=0.05,
    )
    prompt = tokens(8 * BS + 1, seed=10)
    kv = [(k.round(decimals=1), v.round(decimals=1)) for k, v in kv_for(prompt)]  # compressible
    with PrefixCache(config, NS) as writer:
        writer.store(prompt, kv)
    with PrefixCache(config, NS) as reader:
        hit = reader.lookup(prompt)
        assert hit.tier_tokens == {"lmdb": 8 * BS}
        assert_kv_equal(reader.load(hit), kv, 8 * BS)
        reader.release(hit)
        header = read_header(
            reader.tiers.stores[0].get_many([reader.hasher.hash_blocks(prompt)[7]])[0]
        )
        assert (header.codec, header.num_blocks) == ("lz4", chunk)


def test_lmdb_read_prefix_lends_views_of_the_longest_present_prefix(tmp_path):
    from kvstore.stores import LmdbStore

    store = LmdbStore(str(tmp_path / "lmdb"), 2**22)
    keys = [bytes([i]) * 16 for i in range(4)]
    store.put_many([(keys[0], b"a" * 100), (keys[1], b"b" * 100), (keys[3], b"d" * 100)])
    with store.read_prefix(keys) as values:
        assert [type(v) for v in values] == [memoryview, memoryview]
        assert [bytes(v) for v in values] == [b"a" * 100, b"b" * 100]
    assert (store.stats().hits, store.stats().misses) == (2, 2)
    store.close()
