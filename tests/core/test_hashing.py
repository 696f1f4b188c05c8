import dataclasses

import numpy as np
import pytest
import xxhash

from hashing import (
    FORMAT_VERSION,
    HASH_BYTES,
    BlockHasher,
    InvalidNamespace,
    InvalidTokens,
    Namespace,
    as_token_array,
    validate_salt,
)

BS = 4
BASE = Namespace("model@rev1", "float16", 2, 2, 8, BS)
TOKENS = np.arange(3 * BS + 1, dtype=np.uint32)  # 3 full blocks and a partial one

FIELD_CHANGES = {
    "model_fingerprint": "model@rev2",
    "kv_dtype": "bfloat16",
    "num_layers": 3,
    "num_kv_heads": 4,
    "head_dim": 16,
    "block_size": 8,
    "codec": "fp16",
    "adapter_id": "lora-a",
    "salt": "tenant-1",
}


@pytest.mark.parametrize("field", sorted(FIELD_CHANGES))
def test_changing_any_namespace_field_gives_disjoint_roots_and_block_hashes(field):
    other = dataclasses.replace(BASE, **{field: FIELD_CHANGES[field]})
    assert other.root() != BASE.root()
    tokens = np.arange(8 * 2, dtype=np.uint32)  # whole blocks for block_size 4 and 8
    ours, theirs = BlockHasher(BASE).hash_blocks(tokens), BlockHasher(other).hash_blocks(tokens)
    assert not set(ours) & set(theirs)
    assert other.verify_root(b"k") != BASE.verify_root(b"k")


def test_format_version_is_part_of_the_namespace():
    assert dataclasses.replace(BASE, format_version=FORMAT_VERSION + 1).root() != BASE.root()


def test_adapter_and_salt_fields_are_framed_so_shifting_characters_changes_the_root():
    a = dataclasses.replace(BASE, adapter_id="org_1", salt="2345")
    b = dataclasses.replace(BASE, adapter_id="org_12345", salt="")
    assert a.root() != b.root()
    assert a.framed() != b.framed()
    assert BlockHasher(a).hash_blocks(TOKENS) != BlockHasher(b).hash_blocks(TOKENS)


def test_namespace_root_and_id_are_deterministic():
    twin = Namespace("model@rev1", "float16", 2, 2, 8, BS)
    assert twin.root() == BASE.root()
    assert len(BASE.root()) == HASH_BYTES
    assert BASE.id == BASE.root().hex()[:16]
    assert BASE.with_salt("x") == dataclasses.replace(BASE, salt="x")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"model_fingerprint": ""}, "model_fingerprint"),
        ({"kv_dtype": "int8"}, "kv_dtype"),
        ({"num_layers": 0}, "num_layers"),
        ({"head_dim": -1}, "head_dim"),
        ({"block_size": 0}, "block_size"),
        ({"num_kv_heads": 1.5}, "num_kv_heads"),
    ],
)
def test_invalid_namespace_fields_raise_naming_the_field(kwargs, field):
    with pytest.raises(InvalidNamespace, match=field):
        dataclasses.replace(BASE, **kwargs)


def test_salt_validation_accepts_up_to_256_printable_characters():
    assert validate_salt("") == ""
    assert validate_salt("a" * 256) == "a" * 256
    with pytest.raises(InvalidNamespace, match="at most 256"):
        validate_salt("a" * 257)
    with pytest.raises(InvalidNamespace, match="printable"):
        validate_salt("tenant\n1")
    with pytest.raises(InvalidNamespace, match="must be a str"):
        validate_salt(42)  # type: ignore[arg-type]
    with pytest.raises(InvalidNamespace, match="printable"):
        dataclasses.replace(BASE, salt="bad\x00salt")


def test_block_hash_is_xxh3_128_of_parent_and_little_endian_uint32_tokens():
    keys = BlockHasher(BASE).hash_blocks(TOKENS)
    assert len(keys) == 3  # the partial block is never hashed
    parent = BASE.root()
    for i, key in enumerate(keys):
        block = TOKENS[i * BS : (i + 1) * BS].astype("<u4").tobytes()
        parent = xxhash.xxh3_128_digest(parent + block)
        assert key == parent


def test_hashing_resumes_from_a_parent_key():
    hasher = BlockHasher(BASE)
    keys = hasher.hash_blocks(TOKENS)
    assert hasher.hash_blocks(TOKENS, parent=keys[0], start_block=1) == keys[1:]


def test_a_changed_token_changes_its_block_hash_and_every_later_one():
    hasher = BlockHasher(BASE)
    changed = TOKENS.copy()
    changed[BS + 2] += 1
    a, b = hasher.hash_blocks(TOKENS), hasher.hash_blocks(changed)
    assert a[0] == b[0]
    assert [x != y for x, y in zip(a[1:], b[1:], strict=True)] == [True, True]


def test_extra_keys_change_the_hash_of_their_block_and_the_rest_of_the_chain():
    hasher = BlockHasher(BASE)
    plain = hasher.hash_blocks(TOKENS)
    with_extra = hasher.hash_blocks(TOKENS, extra_keys=[None, b"image-1"])
    assert with_extra[0] == plain[0]
    assert with_extra[1] != plain[1] and with_extra[2] != plain[2]
    other_extra = hasher.hash_blocks(TOKENS, extra_keys=[None, b"image-2"])
    assert other_extra[1] != with_extra[1]
    assert hasher.hash_blocks(TOKENS, extra_keys=[b""])[0] != plain[0]  # empty != absent
    assert hasher.hash_blocks(TOKENS, extra_keys=[None, None, None]) == plain


def test_extra_keys_change_verification_digests_too():
    hasher = BlockHasher(BASE)
    assert hasher.digest_blocks(TOKENS, [b"x"])[0] != hasher.digest_blocks(TOKENS)[0]


def test_truncation_hook_keeps_16_byte_keys_with_only_the_first_bytes_set():
    full, short = BlockHasher(BASE), BlockHasher(BASE, key_bytes=1)
    keys = short.hash_blocks(TOKENS)
    assert [len(k) for k in keys] == [HASH_BYTES] * 3
    assert all(k[1:] == bytes(HASH_BYTES - 1) for k in keys)
    assert short.root == BASE.root()[:1] + bytes(HASH_BYTES - 1)
    assert keys != full.hash_blocks(TOKENS)
    assert short.digest_blocks(TOKENS) == full.digest_blocks(TOKENS)  # never truncated


def test_truncated_keys_collide_where_full_keys_do_not():
    short, full = BlockHasher(BASE, key_bytes=1), BlockHasher(BASE)
    first_seen: dict[bytes, np.ndarray] = {}
    for t in range(257):  # 257 distinct first blocks, only 256 one-byte keys: a collision
        block = np.full(BS, t, dtype=np.uint32)
        key = short.hash_blocks(block)[0]
        if key in first_seen:
            break
        first_seen[key] = block
    other = first_seen[key]
    assert short.hash_blocks(other) == short.hash_blocks(block)
    assert full.hash_blocks(other) != full.hash_blocks(block)


@pytest.mark.parametrize("key_bytes", [0, 17])
def test_key_bytes_outside_1_to_16_is_rejected(key_bytes):
    with pytest.raises(ValueError, match="key_bytes"):
        BlockHasher(BASE, key_bytes=key_bytes)


def test_verification_digests_depend_on_the_secret_and_chain_like_keys():
    a, b = BlockHasher(BASE, secret=b"one"), BlockHasher(BASE, secret=b"two")
    assert a.digest_blocks(TOKENS) != b.digest_blocks(TOKENS)
    assert a.digest_blocks(TOKENS, num_blocks=2) == a.digest_blocks(TOKENS)[:2]
    assert set(a.digest_blocks(TOKENS)).isdisjoint(a.hash_blocks(TOKENS))


def test_token_arrays_are_validated():
    assert as_token_array([1, 2, 3]).dtype == np.dtype("<u4")
    assert as_token_array(np.array([2**32 - 1], dtype=np.int64)).tolist() == [2**32 - 1]
    for bad in ([-1], [2**32], [1.5], [[1, 2]], ["a"]):
        with pytest.raises(InvalidTokens):
            as_token_array(bad)
