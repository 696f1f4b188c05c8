"""The int8 and fp8 tier codecs: a bfloat16 scale per token, layer, K/V and head, values
within their precision, exact sizes, and damage (in a value or a scale) always detected."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import xxhash
from tier_helpers import make_chain, namespace

from kvstore.entry import (
    CHECKSUM_BYTES,
    BlockEntry,
    EntryError,
    ExpectedEntry,
    decode_entry,
    encode_entry,
    read_header,
)
from kvstore.layout import tensor_bytes

STORED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def reference_dequantized(kv: torch.Tensor, codec: str) -> torch.Tensor:
    """An independent int8 / e4m3 round trip of [layers, 2, heads, tokens, dim] KV in torch:
    a scale per token and head, rounded to bfloat16."""
    x = kv.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    qmax = 127.0 if codec == "int8" else 448.0
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax)).bfloat16().float()
    if codec == "int8":
        q = torch.round(x / scale).clamp(-127, 127)
    else:
        q = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return (q * scale).to(kv.dtype)


def chunk_of(chain, n: int) -> BlockEntry:
    """The chain's first n blocks as one chunk entry."""
    entries = chain.entries[:n]
    tokens = np.concatenate([e.token_ids for e in entries])
    kv = torch.cat([e.kv for e in entries], dim=3)
    last = entries[-1]
    return BlockEntry(chain.ns.root(), last.key, last.digest, entries[0].parent, tokens, kv, n)


def decode_chunk(chunk: BlockEntry, data: bytes, dtype: torch.dtype) -> torch.Tensor:
    return decode_entry(
        data, namespace=chunk.namespace, key=chunk.key, digest=chunk.digest, dtype=dtype
    ).kv


@pytest.mark.parametrize("codec", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_chunks_decode_to_the_reference_round_trip(codec, dtype) -> None:
    chain = make_chain(namespace(dtype), num_blocks=3, codec="none")
    chunk = chunk_of(chain, 3)
    got = decode_chunk(chunk, encode_entry(chunk, codec), dtype)
    assert got.dtype == dtype
    assert torch.equal(got, reference_dequantized(chunk.kv, codec))
    assert not torch.equal(got, chunk.kv)


@pytest.mark.parametrize(("codec", "rel_tol"), [("int8", 1 / 254), ("fp8", 1 / 16)])
def test_quantized_values_stay_within_the_codec_precision(codec, rel_tol) -> None:
    chain = make_chain(namespace(torch.float32), num_blocks=2, codec=codec)
    for i, data in enumerate(chain.encoded):
        got, want = chain.decode(i, data).kv, chain.entries[i].kv
        amax = want.abs().amax(dim=-1, keepdim=True)  # per layer, K/V, head and token
        step = amax * (1 + 2**-8)  # the scale, rounded to bfloat16, may grow by half an ulp
        bound = step * rel_tol if codec == "int8" else want.abs() * rel_tol + step / 448 / 2**9
        assert bool(((got - want).abs() <= bound + amax * 2**-8).all())


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_a_quantized_entry_stores_scales_and_one_byte_a_value(codec) -> None:
    ns = namespace(torch.float32, layers=3, kv_heads=2, head_dim=8, block_size=4)
    chunk = chunk_of(make_chain(ns, num_blocks=2), 2)
    data = encode_entry(chunk, codec)
    h = read_header(data)
    scales = 3 * 2 * 2 * 8 * 2  # bfloat16 [layers, 2, heads, tokens]
    values = 3 * 2 * 2 * 8 * 8
    assert (h.codec, h.stored_dtype, h.dtype) == (codec, STORED[codec], torch.float32)
    assert h.raw_bytes == h.stored_bytes == scales + values  # 192 scale bytes: 16-aligned
    assert len(data) == h.header_bytes + scales + values + CHECKSUM_BYTES
    assert len(data) < len(encode_entry(chunk, "none")) / 2


def test_an_all_zero_block_round_trips_to_zeros() -> None:
    chain = make_chain(namespace(torch.float32), num_blocks=1)
    e = chain.entries[0]
    zero = e._replace(kv=torch.zeros_like(e.kv))
    for codec in STORED:
        assert torch.equal(chain.decode(0, encode_entry(zero, codec)).kv, zero.kv)


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_every_flipped_bit_of_a_quantized_entry_is_detected(codec) -> None:
    chain = make_chain(namespace(), num_blocks=1, codec=codec)
    original = chain.encoded[0]
    start = read_header(original).header_bytes
    for pos in [*range(start, start + 40), *range(start + 40, len(original), 7)]:
        data = bytearray(original)
        data[pos] ^= 1 << (pos % 8)
        with pytest.raises(EntryError) as info:
            chain.decode(0, bytes(data))
        assert info.value.reason == "checksum" and info.value.damaged


def with_checksum(data: bytearray) -> bytes:
    """`data` with its trailer recomputed: damage that a checksum cannot see."""
    body = bytes(data[:-CHECKSUM_BYTES])
    return body + xxhash.xxh3_64_intdigest(body).to_bytes(CHECKSUM_BYTES, "little")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0, 1e-39, 1e37])
def test_a_scale_no_writer_makes_is_damage_even_under_a_valid_checksum(bad) -> None:
    chain = make_chain(namespace(), num_blocks=1, codec="int8")
    data = bytearray(chain.encoded[0])
    bits = struct.unpack("<I", struct.pack("<f", bad))[0] >> 16  # as bfloat16
    struct.pack_into("<H", data, read_header(data).header_bytes + 2 * 3, bits)  # the 4th scale
    with pytest.raises(EntryError) as info:
        chain.decode(0, with_checksum(data))
    assert info.value.reason == "format" and info.value.damaged


@pytest.mark.parametrize(("offset", "code"), [(8, 0), (8, 6), (7, 6), (7, 1)])
def test_a_header_whose_codec_and_stored_dtype_disagree_is_damage(offset, code) -> None:
    """codec none over int8 bytes; fp8's codec, or stored dtype, over int8's of the same
    size (only the codec and stored dtype rule catches those two); float32 stored int8."""
    chain = make_chain(namespace(), num_blocks=1, codec="int8")
    data = bytearray(chain.encoded[0])
    data[offset] = code
    with pytest.raises(EntryError) as info:
        chain.decode(0, with_checksum(data))
    assert info.value.reason == "format"


@pytest.mark.parametrize("codec", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_hot_path_reads_the_bits_decode_entry_reads(codec, dtype) -> None:
    """ExpectedEntry.dequantize_verified (a tier read into a pool block) against
    decode_entry, for every destination dtype, and both refuse the same damage."""
    ns = namespace(dtype)
    chain = make_chain(ns, num_blocks=2, codec=codec)
    e = chain.entries[1]
    template = ExpectedEntry(ns.root(), dtype, tuple(e.kv.shape), 1, e.key_id, codec)
    args = (e.key, e.digest, e.parent, e.token_ids.astype("<u4").tobytes())
    dst = torch.empty(e.kv.shape, dtype=dtype)
    assert template.dequantize_verified(chain.encoded[1], *args, dst)
    assert torch.equal(
        dst.view(torch.uint8), chain.decode(1, chain.encoded[1]).kv.view(torch.uint8)
    )
    assert torch.equal(dst, reference_dequantized(e.kv, codec))  # an independent round trip
    raw = torch.zeros_like(dst)  # a CPU pool block's raw bytes: the same values
    assert template.dequantize_verified(chain.encoded[1], *args, tensor_bytes(raw))
    assert torch.equal(raw, dst)
    bad = bytearray(chain.encoded[1])
    bad[read_header(bad).header_bytes] ^= 0xFF  # a scale byte
    assert not template.dequantize_verified(bytes(bad), *args, dst)
    assert not template.dequantize_verified(chain.encoded[0], *args, dst)  # another block


@pytest.mark.parametrize("codec", ["int8", "fp8"])
@pytest.mark.parametrize("damage", ["scale", "checksum", "other block"])
def test_a_batch_read_stops_at_the_first_bad_entry_and_writes_none_after_it(codec, damage) -> None:
    """ExpectedEntry.dequantize_many (a tier read of many blocks into pool blocks): the
    leading good entries land as an independent round trip has them; the bad third and the
    good fourth after it leave their destinations untouched."""
    ns = namespace()
    chain = make_chain(ns, num_blocks=4, codec=codec)
    e = chain.entries[0]
    template = ExpectedEntry(ns.root(), torch.float32, tuple(e.kv.shape), 1, e.key_id, codec)
    data = [bytes(d) for d in chain.encoded]
    bad = bytearray(data[2])
    if damage == "scale":  # a scale no writer makes, under a valid checksum
        struct.pack_into("<H", bad, read_header(bad).header_bytes, 0xFF80)  # -inf
        data[2] = with_checksum(bad)
    elif damage == "checksum":
        bad[-CHECKSUM_BYTES - 1] ^= 0x01  # the last value byte
        data[2] = bytes(bad)
    else:
        data[2] = data[1]  # block 1's entry where block 2's is expected
    raws = [torch.full(e.kv.shape, 7.0) for _ in data]
    dst = [tensor_bytes(raw) for raw in raws]  # a CPU pool's destinations: raw bytes
    entries = [(d, *entry_args(x)) for d, x in zip(data, chain.entries, strict=True)]
    assert template.dequantize_many(entries, dst) == 2
    for raw, x in zip(raws[:2], chain.entries, strict=False):
        assert torch.equal(raw, reference_dequantized(x.kv, codec))
    assert all(bool((raw == 7.0).all()) for raw in raws[2:])
    assert template.dequantize_many(entries[:2], dst[:1]) == 1  # never past its destinations
    assert template.dequantize_many(entries[2:], dst[2:]) == 0


@pytest.mark.parametrize("codec", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("into", ["raw bytes", "tensors"])
def test_a_batch_read_lands_every_block_as_an_independent_round_trip(codec, dtype, into) -> None:
    """Five entries read together into a pool of each dtype, through its raw bytes (a CPU
    pool) or its block tensors: each block holds the independent round trip's values (an
    int8 zero has no sign, so compared as values, not bits)."""
    ns = namespace(dtype)
    chain = make_chain(ns, num_blocks=5, codec=codec)
    e = chain.entries[0]
    template = ExpectedEntry(ns.root(), dtype, tuple(e.kv.shape), 1, e.key_id, codec)
    pool = torch.zeros(5, *e.kv.shape, dtype=dtype)
    dst = [tensor_bytes(block) if into == "raw bytes" else block for block in pool.unbind(0)]
    entries = [(d, *entry_args(x)) for d, x in zip(chain.encoded, chain.entries, strict=True)]
    assert template.dequantize_many(entries, dst) == 5
    for block, x in zip(pool, chain.entries, strict=True):
        assert torch.equal(block, reference_dequantized(x.kv, codec))


def entry_args(entry: BlockEntry) -> tuple[bytes, bytes, bytes, bytes]:
    """key, digest, parent and token bytes: what a reader expects of the entry."""
    return entry.key, entry.digest, entry.parent, entry.token_ids.astype("<u4").tobytes()


def test_tiny_values_get_the_smallest_scale_and_read_back_near_zero() -> None:
    chain = make_chain(namespace(), num_blocks=1)
    e = chain.entries[0]
    tiny = e._replace(kv=e.kv * 1e-39)  # amax / 127 is below bfloat16's smallest normal
    for codec in STORED:
        got = chain.decode(0, encode_entry(tiny, codec)).kv  # verifies: not a damaged scale
        assert float(got.abs().max()) <= 2.0**-126 * 448


def test_float16_kv_at_its_largest_reads_back_finite() -> None:
    chain = make_chain(namespace(torch.float16), num_blocks=1)
    e = chain.entries[0]
    kv = e.kv.clone()
    kv[..., 0] = 65504.0  # each token's largest: a scale rounded up carries it past 65504
    for codec in STORED:
        got = chain.decode(0, encode_entry(e._replace(kv=kv), codec)).kv
        assert bool(torch.isfinite(got).all())
        assert 65504.0 * (1 - 2**-7) <= float(got.abs().max()) <= 65504.0


def test_non_contiguous_kv_encodes_like_its_contiguous_copy() -> None:
    chain = make_chain(namespace(), num_blocks=1)
    e = chain.entries[0]
    strided = e.kv.transpose(3, 4).contiguous().transpose(3, 4)  # same values, other order
    assert not strided.is_contiguous()
    for codec in STORED:
        assert encode_entry(e._replace(kv=strided), codec) == encode_entry(e, codec)


def test_non_finite_kv_is_refused_by_a_quantized_codec() -> None:
    chain = make_chain(namespace(), num_blocks=1)
    e = chain.entries[0]
    kv = e.kv.clone()
    kv[0, 0, 0, 0, 0] = float("inf")
    with pytest.raises(EntryError, match="non-finite") as info:
        encode_entry(e._replace(kv=kv), "int8")
    assert info.value.reason == "input"


@pytest.mark.parametrize("codec", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_block_wider_than_one_serial_piece_reads_back_as_the_reference_on_its_own_thread(
    codec, dtype
) -> None:
    """A SmolLM2-sized block (368640 values) is dequantized in pieces that torch runs in the
    reading thread: the reference's values, and no thread team started for that thread."""
    import os
    import threading

    from kvstore.entry.quant import dequantize, quantize

    if not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2:
        pytest.skip("counts threads through /proc, where a thread team has 2 cores or more")
    kv = torch.randn((30, 2, 3, 16, 64), generator=torch.Generator().manual_seed(5)).to(dtype)
    bits, values = quantize(kv, STORED[codec])
    got, started = [], []

    def read() -> None:
        got.append(dequantize(bits, values, dtype))
        started.append(set(os.listdir("/proc/self/task")) - before)

    before = set(os.listdir("/proc/self/task"))
    reader = threading.Thread(target=read)
    reader.start()
    reader.join()
    assert torch.equal(got[0], reference_dequantized(kv, codec))
    assert started == [{str(reader.native_id)}]  # the reader alone, no team of its own


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_e4m3_byte_at_every_kind_of_scale_reads_as_torchs_float8_value_times_it(
    dtype,
) -> None:
    """All 254 finite e4m3 bytes (subnormals included) times scales from the smallest a writer
    makes (products below float32's normals) to the largest (products near float32's max):
    what torch's own float8 cast times the scale, in float32, rounded once, gives."""
    from kvstore.entry.quant import _LARGEST, dequantize

    finite = [b for b in range(256) if b & 0x7F != 0x7F]
    scale_bits = [0x0080, 0x0081, 0x3C00, 0x3F80, 0x4123, int(_LARGEST[torch.float8_e4m3fn])]
    bits = np.array(scale_bits, dtype=np.uint16).reshape(1, 1, 1, -1)  # a token per scale
    values = np.tile(np.array(finite, dtype=np.uint8), (len(scale_bits), 1))[None, None, None]
    got = dequantize(bits, values, dtype)
    scale = torch.from_numpy(bits.astype(np.int32) << 16).view(torch.float32)
    e4m3 = torch.from_numpy(values).view(torch.float8_e4m3fn).float()
    want = e4m3 * scale[..., None]
    magnitudes = want.abs()[want != 0]  # the ranges covered: float32 subnormals to its max
    assert magnitudes.min() < 2.0**-126 and magnitudes.max() > 2.0**127
    if dtype == torch.float16:
        want = want.clamp(-65504.0, 65504.0)
    assert torch.equal(got, want.to(dtype))


def test_the_bytes_no_e4m3_writer_makes_read_as_480_times_the_scale_not_nan() -> None:
    from kvstore.entry.quant import dequantize

    bits = np.array([0x3F80], dtype=np.uint16).reshape(1, 1, 1, 1)  # scale 1.0
    values = np.array([0x7F, 0xFF, 0x7E, 0xFE], dtype=np.uint8).reshape(1, 1, 1, 1, 4)
    got = dequantize(bits, values, torch.float32)
    assert got.flatten().tolist() == [480.0, -480.0, 448.0, -448.0]
