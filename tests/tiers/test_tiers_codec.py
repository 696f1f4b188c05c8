"""Block entry codec: bit-exact round trips, lossy tolerance, and every corruption detected."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from tier_helpers import assert_same_entry, make_chain, namespace

from hashing import FORMAT_VERSION, BlockHasher, key_id
from kvstore.entry import (
    CHECKSUM_BYTES,
    DAMAGED,
    FIXED_HEADER_BYTES,
    FOREIGN,
    MISMATCHED,
    REASONS,
    BlockEntry,
    EntryError,
    ExpectedEntry,
    decode_entry,
    encode_entry,
    read_header,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LOSSLESS = ["none", "lz4", "zstd"]


def decode_as(chain, i: int, data: bytes, **overrides) -> BlockEntry:
    e = chain.entries[i]
    kwargs = dict(namespace=chain.ns.root(), key=e.key, digest=e.digest, dtype=chain.dtype)
    return decode_entry(data, **{**kwargs, **overrides})


def reason_of(chain, data: bytes, **overrides) -> str:
    with pytest.raises(EntryError) as info:
        decode_as(chain, 0, data, **overrides)
    return info.value.reason


@pytest.mark.parametrize("codec", LOSSLESS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lossless_codecs_round_trip_bit_exact(dtype: torch.dtype, codec: str) -> None:
    chain = make_chain(namespace(dtype), num_blocks=3, codec=codec)
    for i, data in enumerate(chain.encoded):
        assert_same_entry(chain.decode(i, data), chain.entries[i])


@pytest.mark.parametrize("codec", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_downcast_codecs_store_16_bit_kv_unchanged(dtype: torch.dtype, codec: str) -> None:
    chain = make_chain(namespace(dtype), num_blocks=2, codec=codec)
    assert read_header(chain.encoded[0]).codec == "none"
    for i, data in enumerate(chain.encoded):
        assert_same_entry(chain.decode(i, data), chain.entries[i])


@pytest.mark.parametrize(("codec", "rel_tol"), [("fp16", 2**-11), ("bf16", 2**-8)])
def test_downcast_codecs_halve_float32_within_their_precision(codec: str, rel_tol: float) -> None:
    chain = make_chain(namespace(torch.float32), num_blocks=2, codec=codec)
    raw = make_chain(namespace(torch.float32), num_blocks=2, codec="none")
    for i, data in enumerate(chain.encoded):
        assert read_header(data).stored_bytes * 2 == read_header(raw.encoded[i]).stored_bytes
        got, want = chain.decode(i, data).kv, chain.entries[i].kv
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=rel_tol, atol=1e-6)
        assert not torch.equal(got, want)


def test_chunk_entry_of_several_blocks_round_trips() -> None:
    ns = namespace(torch.bfloat16)
    chain = make_chain(ns, num_blocks=4)
    tokens = np.concatenate([e.token_ids for e in chain.entries])
    kv = torch.cat([e.kv for e in chain.entries], dim=3)  # tokens axis
    last = chain.entries[-1]
    chunk = BlockEntry(ns.root(), last.key, last.digest, chain.entries[0].parent, tokens, kv, 4)
    data = encode_entry(chunk, "zstd")
    got = decode_entry(
        data, namespace=ns.root(), key=last.key, digest=last.digest, dtype=torch.bfloat16
    )
    assert got.num_blocks == 4 and got.parent == chain.entries[0].parent
    assert_same_entry(got, chunk)


def test_decoded_kv_is_a_zero_copy_view_for_codec_none() -> None:
    chain = make_chain(namespace(torch.float32), num_blocks=1)
    data = chain.encoded[0]
    kv = chain.decode(0, data).kv
    header = read_header(data)
    assert kv.data_ptr() - np.frombuffer(data, np.uint8).ctypes.data == header.header_bytes
    assert kv.data_ptr() % 16 == np.frombuffer(data, np.uint8).ctypes.data % 16


def test_header_describes_the_entry() -> None:
    chain = make_chain(namespace(torch.float16, layers=3, kv_heads=2, head_dim=8), num_blocks=1)
    e, h = chain.entries[0], read_header(chain.encoded[0])
    assert (h.version, h.dtype, h.codec, h.num_blocks, h.num_tokens) == (
        FORMAT_VERSION, torch.float16, "none", 1, 4
    )  # fmt: skip
    assert h.shape == (3, 2, 2, 4, 8)
    assert (h.namespace, h.key, h.digest, h.parent) == (e.namespace, e.key, e.digest, e.parent)
    assert h.raw_bytes == h.stored_bytes == 3 * 2 * 2 * 4 * 8 * 2
    assert h.total_bytes == len(chain.encoded[0])
    assert h.header_bytes % 16 == 0


def test_flipped_bit_in_payload_is_a_checksum_error() -> None:
    chain = make_chain(namespace(), num_blocks=1)
    data = bytearray(chain.encoded[0])
    data[read_header(data).header_bytes + 5] ^= 0x10
    assert reason_of(chain, bytes(data)) == "checksum"


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_every_single_bit_flip_is_detected(codec: str) -> None:
    chain = make_chain(namespace(), num_blocks=1, codec=codec)
    original = chain.encoded[0]
    positions = list(range(len(original) - CHECKSUM_BYTES - 1, len(original)))
    positions += list(range(0, 200)) + list(range(200, len(original), 37))
    reasons = {}
    for pos in positions:
        data = bytearray(original)
        data[pos] ^= 1 << (pos % 8)
        with pytest.raises(EntryError) as info:
            decode_as(chain, 0, bytes(data))
        reasons[pos] = info.value.reason
    assert {reasons[p] for p in range(4)} == {"magic"}
    assert {reasons[p] for p in range(4, 6)} == {"version"}
    # a flip in the length fields (header length, stored length) may look like a truncation
    lengths = set(range(20, 24)) | set(range(32, 40))
    assert {reasons[p] for p in positions if p >= 6 and p not in lengths} == {"checksum"}
    assert {reasons[p] for p in lengths} <= {"checksum", "truncated"}


@pytest.mark.parametrize("keep", [0, 10, FIXED_HEADER_BYTES + 8, -1, -9, -100])
def test_truncated_value_is_detected(keep: int) -> None:
    chain = make_chain(namespace(), num_blocks=1)
    assert reason_of(chain, chain.encoded[0][:keep]) == "truncated"


def test_future_format_version_is_rejected() -> None:
    chain = make_chain(namespace(), num_blocks=1)
    data = bytearray(chain.encoded[0])
    struct.pack_into("<H", data, 4, FORMAT_VERSION + 1)
    assert reason_of(chain, bytes(data)) == "version"


def test_an_entry_of_another_secret_is_foreign_not_damaged() -> None:
    chain = make_chain(namespace(), num_blocks=1)
    other = key_id(b"another deployment secret")
    with pytest.raises(EntryError, match=other.hex()) as info:
        decode_as(chain, 0, chain.encoded[0], key_id=other)
    assert info.value.reason == "secret"
    assert info.value.foreign and not info.value.damaged


def test_every_reason_is_of_one_kind() -> None:
    assert set(REASONS) == {*DAMAGED, *FOREIGN, *MISMATCHED, "input"}
    assert len(REASONS) == len(set(REASONS))
    assert [EntryError(r, "").damaged for r in ("checksum", "truncated", "magic", "format")] == [
        True
    ] * 4
    assert not any(EntryError(r, "").damaged for r in (*FOREIGN, *MISMATCHED))


def test_foreign_bytes_are_rejected_as_bad_magic() -> None:
    chain = make_chain(namespace(), num_blocks=1)
    assert reason_of(chain, b"\x00" * 300) == "magic"


def test_entry_from_another_namespace_is_rejected() -> None:
    chain = make_chain(namespace(salt="tenant-a"), num_blocks=1)
    other = namespace(salt="tenant-b").root()
    assert reason_of(chain, chain.encoded[0], namespace=other) == "namespace"


def test_lookup_key_collision_is_caught_by_the_digest() -> None:
    # Truncated lookup keys (1 byte) collide quickly; the BLAKE2b digests still differ.
    ns = namespace()
    hasher = BlockHasher(ns, key_bytes=1)
    seen: dict[bytes, list[int]] = {}
    for t in range(1000):
        key = hasher.hash_blocks([t] * ns.block_size)[0]
        if key in seen:
            break
        seen[key] = [t] * ns.block_size
    tokens_a, tokens_b = seen[key], [t] * ns.block_size
    digest_a, digest_b = hasher.digest_blocks(tokens_a)[0], hasher.digest_blocks(tokens_b)[0]
    assert digest_a != digest_b
    kv = torch.zeros(ns.num_layers, 2, ns.num_kv_heads, ns.block_size, ns.head_dim)
    stored = encode_entry(BlockEntry(ns.root(), key, digest_a, hasher.root, tokens_a, kv))
    with pytest.raises(EntryError) as info:
        decode_entry(stored, namespace=ns.root(), key=key, digest=digest_b, dtype=torch.float32)
    assert info.value.reason == "digest"


def test_wrong_key_dtype_shape_and_tokens_are_rejected() -> None:
    chain = make_chain(namespace(), num_blocks=2)
    data = chain.encoded[0]
    assert reason_of(chain, data, key=chain.entries[1].key) == "key"
    assert reason_of(chain, data, dtype=torch.float16) == "dtype"
    assert reason_of(chain, data, shape=(2, 2, 2, 4, 4)) == "shape"
    assert reason_of(chain, data, token_ids=chain.entries[1].token_ids) == "tokens"
    ok = decode_as(chain, 0, data, token_ids=chain.entries[0].token_ids, shape=(2, 2, 2, 4, 8))
    assert_same_entry(ok, chain.entries[0])


def test_encode_rejects_malformed_entries() -> None:
    e = make_chain(namespace(), num_blocks=1).entries[0]
    bad = [
        e._replace(key=b"short"),
        e._replace(kv=e.kv.double()),
        e._replace(kv=e.kv[:, :, :, :3]),
        e._replace(num_blocks=3),
    ]
    for entry in bad:
        with pytest.raises(EntryError) as info:
            encode_entry(entry)
        assert info.value.reason == "input"
    with pytest.raises(EntryError):
        encode_entry(e, codec="gzip")


@pytest.mark.parametrize("view", ["bytes", "byte view", "uint16 view"])
def test_template_verifies_an_entry_however_its_buffer_is_typed(view: str) -> None:
    ns = namespace()
    chain = make_chain(ns, num_blocks=1)
    e, value = chain.entries[0], chain.encoded[0]
    views = {"bytes": value, "byte view": memoryview(value)}
    data = views.get(view) or memoryview(value).cast("H")
    template = ExpectedEntry(ns.root(), torch.float32, tuple(e.kv.shape))
    tokens = e.token_ids.astype("<u4").tobytes()
    out = torch.empty_like(e.kv)
    assert template.copy_verified(data, e.key, e.digest, e.parent, tokens, out)
    assert torch.equal(out, e.kv)
    assert torch.equal(template.kv(data, e.key, e.digest, e.parent, tokens), e.kv)
    # the control: one flipped payload bit fails both
    damaged = bytearray(value)
    damaged[-CHECKSUM_BYTES - 1] ^= 1
    assert not template.copy_verified(bytes(damaged), e.key, e.digest, e.parent, tokens, out)
    assert template.kv(bytes(damaged), e.key, e.digest, e.parent, tokens) is None
