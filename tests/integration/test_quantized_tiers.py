"""Quantized tier codecs (int8, fp8) over every real tier: what comes back is exactly the
quantized KV, about a quarter of float32's bytes moves, and a damaged scale is damage."""

import struct

import pytest
import torch
import xxhash
from test_cache_tiers import NS, assert_kv_equal, held_only_in_tiers, kv_for, tier_config, tokens

from kvstore.cache import PrefixCache
from kvstore.entry import CHECKSUM_BYTES, decode_entry, encode_entry, read_header
from kvstore.hits import KVPrefix

BS = NS.block_size


def quantized_reference(kv, codec: str):
    """Per layer (K, V) [1, heads, tokens, dim], each token of each head through an
    independent int8 / e4m3 round trip (its scale rounded to bfloat16)."""
    qmax = 127.0 if codec == "int8" else 448.0
    out = []
    for k, v in kv:
        pair = []
        for x in (k, v):
            amax = x.abs().amax(dim=-1, keepdim=True)
            scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax)).bfloat16().float()
            q = (x / scale).clamp(-qmax, qmax)
            q = q.round() if codec == "int8" else q.to(torch.float8_e4m3fn).float()
            pair.append(q * scale)
        out.append(tuple(pair))
    return out


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_a_quantized_tier_hit_loads_exactly_the_quantized_kv(tier, redis_url, tmp_path, codec):
    prompt = tokens(6 * BS + 2, seed=5)
    kv = kv_for(prompt)
    config = tier_config(tier, tmp_path, redis_url, codec=codec)
    with PrefixCache(config, NS) as cache:
        held_only_in_tiers(cache, prompt)
        store = cache.tiers.stores[0]
        entry = store.get_many([cache.hasher.hash_blocks(prompt)[0]])[0]
        h = read_header(entry)
        assert (h.codec, h.raw_bytes) == (codec, 2 * 2 * 2 * BS * 2 + 2 * 2 * 2 * BS * 8)
        hit = cache.lookup(prompt)
        assert hit.tier_tokens == {tier: 6 * BS}
        loaded = cache.load(hit)
        assert_kv_equal(loaded, quantized_reference(kv, codec), 6 * BS)
        with pytest.raises(AssertionError):  # control: lossy, so not the original KV
            assert_kv_equal(loaded, kv, 6 * BS)
        cache.release(hit)
        assert cache.metrics.get("promoted_blocks_total") == 6
        cache.check_integrity()


def put_back_with_a_bad_scale(store, key: bytes, scale: float) -> None:
    """Rewrite `key`'s entry with its first scale set to `scale`, checksum recomputed."""
    data = bytearray(store.get_many([key])[0])
    bits = struct.unpack("<I", struct.pack("<f", scale))[0] >> 16  # as bfloat16
    struct.pack_into("<H", data, read_header(data).header_bytes, bits)
    body = bytes(data[:-CHECKSUM_BYTES])
    store.delete([key])
    store.put_many([(key, body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little"))])


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_a_damaged_scale_is_deleted_counted_and_recomputed(tier, redis_url, tmp_path, codec):
    prompt = tokens(5 * BS + 1, seed=6)
    with PrefixCache(tier_config(tier, tmp_path, redis_url, codec=codec), NS) as cache:
        held_only_in_tiers(cache, prompt)
        store, key = cache.tiers.stores[0], cache.hasher.hash_blocks(prompt)[3]
        put_back_with_a_bad_scale(store, key, float("nan"))
        hit = cache.lookup(prompt)
        assert hit.num_cached_tokens == 3 * BS  # stops at the block whose scale is bad
        cache.release(hit)
        assert store.get_many([key]) == [None]
        assert cache.metrics.get("verify_failures_total", tier=tier, reason="format") == 1
        assert cache.store(prompt, kv_for(prompt)) == 2  # the rest is recomputed and kept
        assert cache.flush(10)
        assert store.get_many([key]) != [None]


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_an_entry_of_another_codec_amid_quantized_ones_is_read_and_so_are_those_after_it(
    tier, redis_url, tmp_path, codec
):
    """Block 2's entry rewritten with codec none (exact KV, as a writer with another codec
    stores it): the batched read stops there, decodes it, and goes on past it."""
    prompt = tokens(6 * BS + 2, seed=8)
    kv = kv_for(prompt)
    with PrefixCache(tier_config(tier, tmp_path, redis_url, codec=codec), NS) as cache:
        held_only_in_tiers(cache, prompt)
        store, key = cache.tiers.stores[0], cache.hasher.hash_blocks(prompt)[2]
        exact = torch.stack([torch.stack([x[0, :, 2 * BS : 3 * BS] for x in pair]) for pair in kv])
        digest = cache.hasher.digest_blocks(prompt)[2]
        data = store.get_many([key])[0]
        root = read_header(data).namespace  # the scope's, which the cache stores under
        stored = decode_entry(data, namespace=root, key=key, digest=digest, dtype=torch.float32)
        store.delete([key])
        store.put_many([(key, bytes(encode_entry(stored._replace(kv=exact), "none")))])
        hit = cache.lookup(prompt)
        assert hit.tier_tokens == {tier: 6 * BS}
        loaded = cache.load(hit).layers
        want = quantized_reference(kv, codec)
        for (k, v), (qk, qv), (lk, lv) in zip(kv, want, loaded, strict=True):
            for x, q, got in ((k, qk, lk), (v, qv, lv)):
                assert torch.equal(got[:, :, 2 * BS : 3 * BS], x[:, :, 2 * BS : 3 * BS])
                for lo, hi in ((0, 2 * BS), (3 * BS, 6 * BS)):
                    assert torch.equal(got[:, :, lo:hi], q[:, :, lo:hi])
        cache.release(hit)
        assert cache.metrics.get("promoted_blocks_total") == 6


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_chunk_entries_read_from_inside_a_chunk_load_the_quantized_kv(
    tier, redis_url, tmp_path, codec
):
    """Entries of 2 blocks; the device keeps block 0, so the next read starts inside the
    first chunk. Every block is the quantized KV, whichever entry and offset it came from."""
    prompt = tokens(6 * BS + 1, seed=7)
    kv = kv_for(prompt)
    config = tier_config(tier, tmp_path, redis_url, codec=codec, chunk_blocks=2)
    with PrefixCache(config, NS) as cache:
        held_only_in_tiers(cache, prompt)
        assert cache.store(prompt[: BS + 1], kv) == 1  # block 0 back on the device, unquantized
        hit = cache.lookup(prompt)
        assert hit.tier_tokens == {"device": BS, tier: 5 * BS}
        loaded = cache.load(hit)
        assert_kv_equal(KVPrefix(BS, [(k[:, :, :BS], v[:, :, :BS]) for k, v in loaded.layers]),
                        kv, BS)  # fmt: skip
        want = quantized_reference(kv, codec)
        for (k, v), (k2, v2) in zip(want, loaded.layers, strict=True):
            assert torch.equal(k[:, :, BS : 6 * BS], k2[:, :, BS:])
            assert torch.equal(v[:, :, BS : 6 * BS], v2[:, :, BS:])
        cache.release(hit)
        assert cache.metrics.get("promoted_blocks_total") == 5
        cache.check_integrity()
