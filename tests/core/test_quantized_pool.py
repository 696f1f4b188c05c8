"""A quantized device pool (`kv_cache_dtype` int8, fp8_e4m3): its capacity, what a load
returns, its blocks as the tier codec's payloads, and its tier round trips byte for byte."""

from __future__ import annotations

import dataclasses
import struct
import sys
from pathlib import Path

import pytest
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from test_cache_tiers import BS, DIM, HEADS, NS, kv_for, tier_config, tokens

from hashing import Namespace
from kvstore import QuantError
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig, ConfigError
from kvstore.device.hybrid_pool import HybridPool, make_pool
from kvstore.device.pool import BlockPool, pool_blocks
from kvstore.device.quant_kv import layer_view
from kvstore.entry import CHECKSUM_BYTES, BlockEntry, encode_entry, read_header

TINY = Namespace("tiny", "float32", 8, 2, 64, 16)  # the yardstick's KV shape


def reference(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """An independent round trip of K/V [..., dim]: a bfloat16 scale per token and head."""
    qmax = 127.0 if kv_dtype == "int8" else 448.0
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax)).bfloat16().float()
    q = (x / scale).clamp(-qmax, qmax)
    q = q.round() if kv_dtype == "int8" else q.to(torch.float8_e4m3fn).float()
    return q * scale


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_the_same_memory_holds_twice_bf16s_blocks_and_four_times_float32s(kv_dtype) -> None:
    config = CacheConfig(block_size=16, device_cache_gb=0.01)
    quantized = pool_blocks(config, dataclasses.replace(TINY, kv_cache_dtype=kv_dtype))
    bf16 = pool_blocks(config, dataclasses.replace(TINY, kv_dtype="bfloat16"))
    fp32 = pool_blocks(config, TINY)
    # a block: 16 tokens x 2 heads x (K, V) x 8 layers, each 64 values of 1 byte and a
    # 2-byte scale = 33792 bytes, against 65536 (bfloat16) and 131072 (float32)
    assert (quantized, bf16, fp32) == (317, 163, 81)
    assert quantized / bf16 >= 1.9 and quantized / fp32 >= 3.8


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_a_load_returns_each_tokens_quantized_kv_and_a_block_is_the_codecs_payload(
    kv_dtype,
) -> None:
    ns = dataclasses.replace(NS, kv_cache_dtype=kv_dtype)
    config = CacheConfig(block_size=BS, device_blocks=16, kv_cache_dtype=kv_dtype)
    prompt = tokens(3 * BS + 1, seed=2)
    kv = kv_for(prompt)
    with PrefixCache(config, ns) as cache:
        assert cache.store(prompt, kv) == 3
        hit = cache.lookup(prompt)
        loaded = cache.load(hit)
        for (k, v), (k2, v2) in zip(kv, loaded.layers, strict=True):
            assert torch.equal(k2, reference(k[:, :, : 3 * BS], kv_dtype))
            assert torch.equal(v2, reference(v[:, :, : 3 * BS], kv_dtype))
        row = cache.pool.read_blocks(hit.block_ids[:1])[0]
        cache.release(hit)
    # block 0 as an entry the tier codec writes from the same K/V: its payload is the row
    block0 = torch.stack([torch.stack((k[0, :, :BS], v[0, :, :BS])) for k, v in kv])
    codec = {"int8": "int8", "fp8_e4m3": "fp8"}[kv_dtype]
    zeros = bytes(16)
    entry = encode_entry(BlockEntry(ns.root(), zeros, zeros, zeros, prompt[:BS], block0), codec)
    h = read_header(entry)
    payload = entry[h.header_bytes : h.header_bytes + h.stored_bytes]
    assert bytes(row.numpy()) == payload


def quantized_cache(tier: str, tmp_path, redis_url, kv_dtype: str = "int8") -> PrefixCache:
    config = tier_config(tier, tmp_path, redis_url, kv_cache_dtype=kv_dtype)
    return PrefixCache(config, NS)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_pools_blocks_go_to_a_tier_and_come_back_byte_for_byte(
    tier, redis_url, tmp_path, kv_dtype
) -> None:
    prompt = tokens(6 * BS + 2, seed=8)
    with quantized_cache(tier, tmp_path, redis_url, kv_dtype) as cache:
        cache.store(prompt, kv_for(prompt))
        hit = cache.lookup(prompt)
        before = cache.pool.read_blocks(hit.block_ids).clone()
        cache.release(hit)
        cache.flush(10)
        cache.evict_device()
        entry = cache.tiers.stores[0].get_many([cache.hasher.hash_blocks(prompt)[0]])[0]
        assert read_header(entry).codec == {"int8": "int8", "fp8_e4m3": "fp8"}[kv_dtype]
        hit = cache.lookup(prompt)
        assert hit.tier_tokens == {tier: 6 * BS}
        after = cache.pool.read_blocks(hit.block_ids)
        assert torch.equal(after, before)  # as they were: no second quantization
        cache.pool.rows[hit.block_ids[2], -1] ^= 1  # control: one value bit of one block
        assert not torch.equal(cache.pool.read_blocks(hit.block_ids), before)
        cache.release(hit)
        assert cache.metrics.get("promoted_blocks_total") == 6


def test_a_damaged_scale_in_a_tier_is_deleted_counted_and_a_miss(tier, redis_url, tmp_path):
    prompt = tokens(5 * BS + 1, seed=9)
    with quantized_cache(tier, tmp_path, redis_url) as cache:
        cache.store(prompt, kv_for(prompt))
        cache.flush(10)
        cache.evict_device()
        store, key = cache.tiers.stores[0], cache.hasher.hash_blocks(prompt)[2]
        data = bytearray(store.get_many([key])[0])
        nan = struct.unpack("<I", struct.pack("<f", float("nan")))[0] >> 16
        struct.pack_into("<H", data, read_header(data).header_bytes, nan)
        body = bytes(data[:-CHECKSUM_BYTES])
        store.delete([key])
        store.put_many([(key, body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little"))])
        hit = cache.lookup(prompt)
        assert hit.num_cached_tokens == 2 * BS  # stops at the block whose scale is bad
        cache.release(hit)
        assert store.get_many([key]) == [None]
        assert cache.metrics.get("verify_failures_total", tier=tier, reason="format") == 1
        cache.check_integrity()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16"])
def test_a_pool_block_is_the_codecs_payload_for_zeros_tiny_and_wide_values(
    kv_dtype, model_dtype
) -> None:
    """Tokens of all zeros, of values under the smallest scale, and of a wide range, in a
    float32 or bfloat16 model's pool: the pool's torch steps and the codec's numpy ones."""
    ns = dataclasses.replace(NS, kv_dtype=model_dtype, kv_cache_dtype=kv_dtype)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[model_dtype]
    prompt = tokens(BS + 1, seed=12)
    kv = [(k.to(dtype), v.to(dtype)) for k, v in kv_for(prompt)]
    kv[0][0][0, :, 0] = 0  # token 0 of layer 0's K: all zeros
    kv[0][1][0, :, 1] = 1e-39  # token 1 of layer 0's V: under bfloat16's smallest scale
    kv[1][0][0, :, 2] *= 1e4  # token 2 of layer 1's K: wide
    config = CacheConfig(block_size=BS, device_blocks=8, kv_cache_dtype=kv_dtype)
    with PrefixCache(config, ns) as cache:
        cache.store(prompt, kv)
        hit = cache.lookup(prompt)
        row = cache.pool.read_blocks(hit.block_ids)[0]
        cache.release(hit)
    block = torch.stack([torch.stack((k[0, :, :BS], v[0, :, :BS])) for k, v in kv])
    codec, zeros = {"int8": "int8", "fp8_e4m3": "fp8"}[kv_dtype], bytes(16)
    entry = encode_entry(BlockEntry(ns.root(), zeros, zeros, zeros, prompt[:BS], block), codec)
    h = read_header(entry)
    assert bytes(row.numpy()) == entry[h.header_bytes : h.header_bytes + h.stored_bytes]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_quantized_pool_refuses_kv_holding_an_inf_or_a_nan_and_keeps_no_block(
    kv_dtype, bad
) -> None:
    """The pool's scale of such a token would be inf or NaN and read back every value of
    its row as NaN: a store says why instead, and frees the blocks it took."""
    ns = dataclasses.replace(NS, kv_cache_dtype=kv_dtype)
    config = CacheConfig(block_size=BS, device_blocks=16, kv_cache_dtype=kv_dtype)
    prompt = tokens(3 * BS + 1, seed=13)
    kv = kv_for(prompt)
    kv[1][0][0, 1, BS + 2, 3] = bad  # layer 1's K, head 1, a token of block 1
    with PrefixCache(config, ns) as cache:
        free = cache.pool.num_free_blocks
        with pytest.raises(QuantError, match=f"kv_cache_dtype {kv_dtype} cannot store them"):
            cache.store(prompt, kv)
        assert cache.pool.num_free_blocks == free
        hit = cache.lookup(prompt)
        assert hit.num_cached_tokens == 0
        cache.release(hit)
        cache.check_integrity()
        kv[1][0][0, 1, BS + 2, 3] = 0.5  # control: the same K/V, finite
        assert cache.store(prompt, kv) == 3


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_a_pool_block_whose_kv_held_an_inf_never_reaches_a_tier_and_the_blocks_before_do(
    tier, redis_url, tmp_path, kv_dtype
) -> None:
    """A paged forward writes an inf K token into block 2 of 4 (as a model that overflows
    would); at eviction the writer keeps blocks 0 and 1, drops 2 and 3 and counts them,
    where readers would have counted a damaged entry."""
    policy = {f"{tier}_write_policy": "write-back"}  # written at eviction, after the forward
    config = tier_config(tier, tmp_path, redis_url, kv_cache_dtype=kv_dtype, **policy)
    prompt = tokens(4 * BS + 1, seed=14)
    with PrefixCache(config, NS) as cache:
        cache.store(prompt, kv_for(prompt))
        hit = cache.lookup(prompt)
        block = hit.block_ids[2]
        cache.release(hit)
        new = torch.zeros(1, 2, HEADS, DIM)  # [tokens, K/V, heads, dim]
        new[0, 0, 0, 5] = float("inf")
        layer = layer_view(cache.pool.kv, cache.pool.scales, 0)
        layer.write(torch.tensor([block]), torch.tensor([1]), new)
        assert not torch.isfinite(cache.pool.scales[block, 0, 0, 0, 1])
        cache.evict_device()
        cache.flush(10)
        keys = cache.hasher.hash_blocks(prompt)
        assert [v is not None for v in cache.tiers.stores[0].get_many(keys)] == [1, 1, 0, 0]
        assert cache.metrics.get("dropped_writes_blocks_total") == 2
        hit = cache.lookup(prompt)
        assert hit.tier_tokens == {tier: 2 * BS}
        cache.release(hit)
        assert cache.metrics.get("verify_failures_total", tier=tier, reason="format") == 0


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_a_float_pools_write_through_a_quantized_codec_keeps_the_blocks_before_an_inf(
    tier, redis_url, tmp_path, codec
) -> None:
    """The codec cannot store a block whose K/V hold an inf: the write keeps the entries
    before it (a prefix a lookup can still read) and drops and counts it and the rest."""
    config = tier_config(tier, tmp_path, redis_url, codec=codec)
    prompt = tokens(4 * BS + 1, seed=15)
    kv = kv_for(prompt)
    kv[1][1][0, 0, 2 * BS + 3, 1] = float("inf")  # layer 1's V, a token of block 2
    with PrefixCache(config, NS) as cache:
        assert cache.store(prompt, kv) == 4  # the float32 pool holds it as it is
        cache.flush(10)
        keys = cache.hasher.hash_blocks(prompt)
        assert [v is not None for v in cache.tiers.stores[0].get_many(keys)] == [1, 1, 0, 0]
        assert cache.metrics.get("dropped_writes_blocks_total") == 2
        cache.evict_device()
        hit = cache.lookup(prompt)
        assert hit.tier_tokens == {tier: 2 * BS}
        cache.release(hit)


def test_a_quantized_namespace_binds_only_a_config_of_its_dtype() -> None:
    int8 = dataclasses.replace(NS, kv_cache_dtype="int8")
    for config in (
        CacheConfig(block_size=BS),
        CacheConfig(block_size=BS, kv_cache_dtype="fp8_e4m3"),
    ):
        with pytest.raises(ConfigError, match="namespace has 'int8'") as info:
            config.bind(int8)
        assert info.value.field == "kv_cache_dtype"
    assert CacheConfig(block_size=BS, kv_cache_dtype="int8").bind(int8).codec == "int8"


def test_a_quantized_namespace_never_shares_an_auto_ones_keys() -> None:
    int8 = dataclasses.replace(NS, kv_cache_dtype="int8")
    fp8 = dataclasses.replace(NS, kv_cache_dtype="fp8_e4m3")
    assert len({NS.root(), int8.root(), fp8.root()}) == 3
    assert b"kv_cache_dtype" not in NS.framed()  # auto's roots are those of before the field
    config = CacheConfig(block_size=BS, kv_cache_dtype="int8")
    bound = config.bind(NS)
    assert (bound.kv_cache_dtype, bound.codec) == ("int8", "int8")


@pytest.mark.parametrize(
    ("fields", "field", "why"),
    [
        ({"codec": "lz4"}, "codec", "give none or int8"),
        ({"chunk_blocks": 2}, "kv_cache_dtype", "chunk_blocks 1"),
        ({"layer_loads": True}, "kv_cache_dtype", "layer_loads off"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype", "must be one of"),
    ],
)
def test_settings_a_quantized_pool_cannot_keep_are_refused_by_name(fields, field, why) -> None:
    with pytest.raises(ConfigError, match=why) as info:
        CacheConfig(**{"kv_cache_dtype": "int8", **fields})
    assert info.value.field == field


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_hybrid_pool_keeps_a_plain_pools_payloads_in_its_two_planes(kv_dtype):
    """A hybrid pool (layers 0 and 2 in the window plane) holds the bytes a plain pool holds
    for the same K/V: its tier entries are the same, and they come back byte for byte."""
    ns = dataclasses.replace(Namespace("hybrid", "float32", 3, 2, 8, BS), kv_cache_dtype=kv_dtype)
    plain = BlockPool(8, ns, torch.device("cpu"))
    hybrid = HybridPool(8, ns, torch.device("cpu"), window_layers=[0, 2], num_window_slots=4)
    g = torch.Generator().manual_seed(4)
    kv = [(torch.randn(1, 2, 2 * BS, 8, generator=g), torch.randn(1, 2, 2 * BS, 8, generator=g))
          for _ in range(3)]  # fmt: skip
    ids, other = plain.allocate(2), hybrid.allocate(2)
    plain.scatter(ids, kv)
    hybrid.scatter(other, kv)
    rows = plain.read_blocks(ids)
    assert torch.equal(hybrid.read_blocks(other), rows)
    # a layer's part of a block: 2 x 2 heads x 4 tokens x (8 values + a 2-byte scale) = 160
    assert rows.shape[1] == 3 * 160 and hybrid.nbytes == 8 * 160 + 4 * 2 * 160
    again = hybrid.allocate(2)
    hybrid.write_blocks(again, rows)  # a tier read: payload rows into both planes
    assert torch.equal(hybrid.read_blocks(again), rows)
    for (k, v), (k2, v2) in zip(plain.gather(ids), hybrid.gather(again), strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    hybrid.drop_window(again[:1])  # a hit whose window starts at block 1
    kept = hybrid.read_kv_blocks(again, window_from=1)
    assert kept[0, [0, 2]].abs().sum() == 0 and torch.equal(kept[1], plain.read_kv_blocks(ids)[1])
    hybrid.window.rows[int(hybrid.window.slot[again[1]]), -1] ^= 1  # control: one value bit
    assert not torch.equal(hybrid.read_blocks(again[1:]), rows[1:])


@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_a_quantized_hybrid_pool_stays_within_its_byte_budget(block_size) -> None:
    """Each plane pads its own scales: the budget counts each plane's rows as they are."""
    ns = Namespace("hybrid", "bfloat16", 3, 1, 8, block_size, kv_cache_dtype="int8")
    config = CacheConfig(block_size=block_size, device_cache_gb=0.0001, window_share=1.0,
                         kv_cache_dtype="int8")  # fmt: skip
    pool = make_pool(config, ns, window_layers=[1])
    budget = 0.0001 * 2**30
    assert pool.nbytes <= budget
    row = pool.rows.shape[1] + pool.window.rows.shape[1]  # a block and its window slot
    assert pool.nbytes + row > budget  # and no further block would have fit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_fp8_pools_read_of_every_byte_is_torchs_float8_value_times_its_scale(dtype) -> None:
    """A CPU fp8 pool dequantizes through float16's bits (vector code, not the scalar float8
    cast): all 254 finite e4m3 bytes, at the smallest, a middle and nearly the largest scale
    a writer makes, read as the cast's value times the scale, rounded once."""
    from kvstore.device.quant_kv import dequantize

    every = torch.arange(256, dtype=torch.uint8)
    finite = every[(every & 0x7F) != 0x7F].view(torch.float8_e4m3fn).expand(3, -1)
    scales = torch.tensor([2.0**-126, 0.0137, 3.0e35]).bfloat16()  # a token a row
    want = finite.float() * scales.float().unsqueeze(-1)
    magnitudes = want.abs()[want != 0]  # the ranges covered: float32 subnormals to near its max
    assert magnitudes.min() < 2.0**-126 and magnitudes.max() > 2.0**126
    if dtype == torch.float16:
        want = want.clamp(-65504.0, 65504.0)
    assert torch.equal(dequantize(finite, scales, dtype), want.to(dtype))
