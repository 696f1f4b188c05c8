"""Stack entries: a serving stack's block as a verified entry (docs/FORMAT.md, "Stack entries").

vLLM, LMCache and SGLang hand their store a block as bytes keyed by their own hash, without
token ids. Such a block is stored in the entry format with flag `FLAG_STACK`: the payload
is the block's raw bytes (dtype code 4, shape `[payload bytes]`), the token-id area holds
the stack's own metadata instead (`meta_bytes` long, in the u16 at offset 14), and the
namespace, lookup key, digest and checksum are verified as for every entry. The parent
field holds the namespace root: the stacks chain their keys themselves.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import lz4.block
import zstandard

from hashing import DEFAULT_KEY_ID, KEY_ID_BYTES
from kvstore.entry.format import (
    CHECKSUM_BYTES,
    CODEC_CODES,
    FIXED_HEADER,
    FIXED_HEADER_BYTES,
    FLAG_STACK,
    FORMAT_VERSION,
    ID_BYTES,
    MAGIC,
    EntryError,
    assemble_entry,
    check_identity,
    verified_fixed,
)

BYTES_CODE = 4  # dtype code of a stack entry's payload: raw bytes
STACK_CODECS = ("none", "lz4", "zstd")
MAX_META_BYTES = 0xFFFF
_CODEC_NAMES = {code: name for name, code in CODEC_CODES.items()}
_U32 = struct.Struct("<I")


class StackEntry(NamedTuple):
    """A verified stack entry: `payload` is a read-only view of the entry (codec "none") or
    the inflated bytes; `meta` is the stack's own metadata."""

    key: bytes
    num_tokens: int
    meta: bytes
    payload: memoryview


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def _compress(raw: memoryview, codec: str) -> bytes | memoryview:
    if codec == "lz4":
        return lz4.block.compress(raw, store_size=False)
    if codec == "zstd":
        return zstandard.ZstdCompressor(level=1).compress(raw)
    return raw


def _check_parts(
    namespace: bytes, key: bytes, digest: bytes, key_id: bytes, meta: bytes, codec: str
) -> None:
    if {len(namespace), len(key), len(digest)} != {ID_BYTES}:
        raise EntryError("input", f"namespace, key and digest must be {ID_BYTES} bytes")
    if len(key_id) != KEY_ID_BYTES:
        raise EntryError("input", f"key_id must be {KEY_ID_BYTES} bytes (hashing.key_id)")
    if len(meta) > MAX_META_BYTES:
        raise EntryError("input", f"stack metadata is {len(meta)} bytes, at most {MAX_META_BYTES}")
    if codec not in STACK_CODECS:
        raise EntryError("input", f"a stack entry's codec must be one of {STACK_CODECS}")


def encode_stack_entry(
    namespace: bytes,
    key: bytes,
    digest: bytes,
    payload: bytes | memoryview,
    *,
    num_tokens: int = 0,
    meta: bytes = b"",
    codec: str = "none",
    key_id: bytes = DEFAULT_KEY_ID,
) -> bytes:
    """The entry of one stack block: `payload` its raw bytes, `meta` the stack's metadata,
    `key_id` the `hashing.key_id` of the secret `digest` was made with."""
    _check_parts(namespace, key, digest, key_id, meta, codec)
    raw = memoryview(payload).cast("B")
    stored = _compress(raw, codec)
    if len(stored) >= raw.nbytes:
        stored, codec = raw, "none"
    header_len = _align16(FIXED_HEADER_BYTES + 4 + len(meta))
    fixed = FIXED_HEADER.pack(
        MAGIC, FORMAT_VERSION, BYTES_CODE, BYTES_CODE, CODEC_CODES[codec], FLAG_STACK, 1, 0,
        1, len(meta), num_tokens, header_len, raw.nbytes, len(stored),
        key_id, namespace, key, digest, namespace,
    )  # fmt: skip
    pad = bytes(header_len - FIXED_HEADER_BYTES - 4 - len(meta))
    header = b"".join((fixed, _U32.pack(raw.nbytes), meta, pad))
    return bytes(assemble_entry(header, stored, None))


def decode_stack_entry(
    data: bytes | memoryview,
    *,
    namespace: bytes,
    key: bytes,
    digest: bytes,
    payload_bytes: int | None = None,
    key_id: bytes = DEFAULT_KEY_ID,
) -> StackEntry:
    """Verify a stack entry and return its parts; raises `EntryError` (with `reason`).

    Checks, in order: magic, version, length, checksum, that it is a stack entry with a
    consistent header, namespace, secret (key id), key, digest, and the payload size when
    given."""
    mv = memoryview(data).cast("B")
    f = verified_fixed(mv)
    codec, meta_len, header_len, raw_len, stored_len = _layout(f, len(mv))
    check_identity(_Identity(f[14], f[15], f[16], f[17]), namespace, key, digest, key_id)
    if payload_bytes is not None and raw_len != payload_bytes:
        raise EntryError("shape", f"entry holds {raw_len} bytes, expected {payload_bytes}")
    meta_at = FIXED_HEADER_BYTES + 4
    meta = bytes(mv[meta_at : meta_at + meta_len])
    stored = mv[header_len : header_len + stored_len]
    return StackEntry(f[16], f[10], meta, _inflate(stored, codec, raw_len))


class _Identity(NamedTuple):
    key_id: bytes
    namespace: bytes
    key: bytes
    digest: bytes


def _layout(f: tuple, total: int) -> tuple[str, int, int, int, int]:
    """codec, meta, header, raw and stored lengths of a stack entry; else EntryError."""
    if not f[5] & FLAG_STACK:
        raise EntryError("kind", "not a stack block entry (a model entry: decode_entry)")
    if f[2] != BYTES_CODE or f[3] != BYTES_CODE or f[6] != 1:
        raise EntryError("format", "a stack entry must hold raw bytes of one dimension")
    codec = _CODEC_NAMES.get(f[4])
    meta_len, header_len, raw_len, stored_len = f[9], f[11], f[12], f[13]
    ok = (
        codec in STACK_CODECS
        and FIXED_HEADER_BYTES + 4 + meta_len <= header_len
        and header_len + stored_len + CHECKSUM_BYTES == total
        and (codec != "none" or raw_len == stored_len)
    )
    if not ok:
        raise EntryError("format", f"inconsistent stack entry header ({raw_len} bytes)")
    return codec, meta_len, header_len, raw_len, stored_len


def _inflate(stored: memoryview, codec: str, raw_len: int) -> memoryview:
    if codec == "none":
        return stored.toreadonly()
    try:
        if codec == "lz4":
            raw = lz4.block.decompress(stored, uncompressed_size=raw_len)
        else:
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_len)
    except (lz4.block.LZ4BlockError, zstandard.ZstdError) as e:
        raise EntryError("format", f"payload does not inflate: {e}") from None
    if len(raw) != raw_len:
        raise EntryError("format", f"payload inflates to {len(raw)} bytes, header says {raw_len}")
    return memoryview(raw)
