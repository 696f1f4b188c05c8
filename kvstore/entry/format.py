"""The entry format: the self-describing, verified byte layout of KV blocks in spill tiers.

One entry holds one block (or a chunk of `num_blocks` consecutive blocks): a fixed header,
the shape, the token ids, the payload and an xxh3_64 trailer over everything before it.
The byte layout is documented in docs/FORMAT.md. All integers are little-endian. This
module builds and parses headers; `kvstore.entry.codec` encodes and decodes whole entries.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from hashing import DEFAULT_KEY_ID, FORMAT_VERSION, KEY_ID_BYTES
from kvstore.entry.quant import QUANT_DTYPES, payload_size, scale_bytes

MAGIC = b"KVSB"
ID_BYTES = 16
# magic, version, kv dtype, stored dtype, codec, flags, ndim, reserved, num_blocks, reserved,
# num_tokens, header length, raw payload length, stored payload length,
# key id, namespace, key, digest, parent
_FIXED = struct.Struct(f"<4sHBBBBBBHHIIQQ{KEY_ID_BYTES}s16s16s16s16s")
FIXED_HEADER = _FIXED  # the fixed header's layout (kvstore.entry.stack packs it too)
FIXED_HEADER_BYTES = _FIXED.size  # 112
_MAGIC_VERSION = struct.Struct("<4sH")
CHECKSUM_BYTES = 8
HEADER_ALIGN = 16  # the payload starts at a 16-byte aligned offset

DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}  # KV dtypes
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
# stored dtypes: the KV dtypes, and the quantized ones (4 is a stack entry's raw bytes)
STORED_CODES = {**DTYPE_CODES, torch.int8: 5, torch.float8_e4m3fn: 6}
_CODE_STORED = {code: dtype for dtype, code in STORED_CODES.items()}
CODEC_CODES = {"none": 0, "fp16": 1, "bf16": 2, "lz4": 3, "zstd": 4, "int8": 5, "fp8": 6}
_CODE_CODECS = {code: name for name, code in CODEC_CODES.items()}
FLAG_SHUFFLED = 1  # payload bytes were byte-shuffled (grouped by significance) before compression
FLAG_STACK = 2  # a serving stack's block: raw bytes, no token ids (kvstore.entry.stack)
# Why an entry fails verification, in three kinds (docs/FORMAT.md, "Verification on read"):
# damaged bytes (deleted by the reader), an intact entry of another writer's configuration
# (foreign: kept), and an intact entry of another prefix or shape (kept).
DAMAGED = ("truncated", "magic", "checksum", "format")
FOREIGN = ("version", "kind", "namespace", "secret")
MISMATCHED = ("key", "digest", "dtype", "shape", "tokens")
REASONS = (*DAMAGED, *FOREIGN, *MISMATCHED, "input")


class EntryError(ValueError):
    """An entry failed to encode or verify. `reason` is one of `REASONS`."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason

    @property
    def damaged(self) -> bool:
        """The entry's own bytes are bad: the only failure a reader deletes."""
        return self.reason in DAMAGED

    @property
    def foreign(self) -> bool:
        """An intact entry written under another secret, namespace or format version."""
        return self.reason in FOREIGN


class BlockEntry(NamedTuple):
    """One stored entry. kv: [layers, 2, kv_heads, num_blocks * block_size, head_dim].

    `key` and `digest` are those of the last block of the entry (the digest covers the whole
    prefix); `parent` is the lookup key of the block before the first one.
    """

    namespace: bytes
    key: bytes
    digest: bytes
    parent: bytes
    token_ids: np.ndarray
    kv: torch.Tensor
    num_blocks: int = 1
    key_id: bytes = DEFAULT_KEY_ID  # `hashing.key_id` of the secret the digest was made with


class EntryHeader(NamedTuple):
    """The parsed fixed header of an entry (see docs/FORMAT.md)."""

    version: int
    dtype: torch.dtype
    stored_dtype: torch.dtype
    codec: str
    flags: int
    num_blocks: int
    num_tokens: int
    header_bytes: int
    raw_bytes: int
    stored_bytes: int
    key_id: bytes
    namespace: bytes
    key: bytes
    digest: bytes
    parent: bytes
    shape: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + self.stored_bytes + CHECKSUM_BYTES


def _align(n: int) -> int:
    return (n + HEADER_ALIGN - 1) // HEADER_ALIGN * HEADER_ALIGN


def pack_header(
    entry: BlockEntry,
    tokens: np.ndarray,
    stored_code: int,
    codec: str,
    flags: int,
    raw_bytes: int,
    stored_bytes: int,
) -> bytes:
    """Fixed header, shape, token ids and padding up to the 16-byte aligned payload."""
    shape = struct.pack(f"<{entry.kv.dim()}I", *entry.kv.shape)
    header_len = _align(FIXED_HEADER_BYTES + len(shape) + tokens.nbytes)
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, DTYPE_CODES[entry.kv.dtype], stored_code,
        CODEC_CODES[codec], flags, entry.kv.dim(), 0, entry.num_blocks, 0,
        len(tokens), header_len, raw_bytes, stored_bytes,
        entry.key_id, entry.namespace, entry.key, entry.digest, entry.parent,
    )  # fmt: skip
    pad = bytes(header_len - FIXED_HEADER_BYTES - len(shape) - tokens.nbytes)
    return b"".join((fixed, shape, tokens.astype("<u4", copy=False).data, pad))


def max_entry_bytes(entry: BlockEntry) -> int:
    """An upper bound of `len(encode_entry(entry, codec))`, whatever the codec."""
    header = _align(FIXED_HEADER_BYTES + 4 * entry.kv.dim() + 4 * len(entry.token_ids))
    scales = scale_bytes(tuple(entry.kv.shape))  # a quantized payload's
    return header + entry.kv.numel() * entry.kv.element_size() + scales + CHECKSUM_BYTES


def fixed_entry_bytes(shape: tuple[int, ...], dtype: torch.dtype, codec: str) -> int | None:
    """The exact size of an entry of KV `shape` and `dtype` in `codec`; None for the
    compressing codecs, whose size depends on the values."""
    if codec in ("lz4", "zstd"):
        return None
    header = _align(FIXED_HEADER_BYTES + 4 * len(shape) + 4 * shape[3])
    narrow = {"fp16": torch.float16, "bf16": torch.bfloat16}  # of float32 KV
    stored = QUANT_DTYPES.get(codec, narrow.get(codec, dtype) if dtype == torch.float32 else dtype)
    return header + payload_size(shape, stored) + CHECKSUM_BYTES


def assemble_entry(
    header: bytes, payload: bytes | memoryview, out: bytearray | memoryview | None
) -> bytes | memoryview:
    """header + payload + xxh3_64 of both: into `out` when given, else a new bytes."""
    if out is not None:
        return _encode_into(out, header, payload)
    h = xxhash.xxh3_64(header)
    h.update(payload)
    return b"".join((header, payload, h.intdigest().to_bytes(CHECKSUM_BYTES, "little")))


def _encode_into(
    out: bytearray | memoryview, header: bytes, payload: bytes | memoryview
) -> memoryview:
    n, end = len(header), len(header) + len(payload)
    if len(out) < end + CHECKSUM_BYTES:
        raise EntryError("input", f"out has {len(out)} bytes, the entry needs {end + 8}")
    view = memoryview(out).cast("B")[: end + CHECKSUM_BYTES]
    view[:n] = header
    view[n:end] = payload
    # hash what was just written: it is still in cache
    view[end:] = xxhash.xxh3_64_intdigest(view[:end]).to_bytes(CHECKSUM_BYTES, "little")
    return view


def _unpack_fixed(data: memoryview) -> tuple:
    """The fixed header fields, after checking magic, version and size only. The version
    comes before the size: another version's header may be laid out differently."""
    if len(data) < _MAGIC_VERSION.size:
        raise EntryError("truncated", f"entry is {len(data)} bytes, shorter than a header")
    magic, version = _MAGIC_VERSION.unpack_from(data, 0)
    if magic != MAGIC:
        raise EntryError("magic", f"magic is {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise EntryError("version", f"format version {version}, this reader knows {FORMAT_VERSION}")
    if len(data) < FIXED_HEADER_BYTES + CHECKSUM_BYTES:
        raise EntryError("truncated", f"entry is {len(data)} bytes, shorter than a header")
    return _FIXED.unpack_from(data, 0)


def _verify_checksum(mv: memoryview, f: tuple) -> None:
    """Checksum first, so that a damaged field is reported as damage, not misread."""
    expected = int.from_bytes(mv[-CHECKSUM_BYTES:], "little")
    if xxhash.xxh3_64_intdigest(mv[:-CHECKSUM_BYTES]) == expected:
        return
    declared = f[11] + f[13] + CHECKSUM_BYTES  # header length + stored payload + trailer
    if len(mv) < declared:
        raise EntryError("truncated", f"entry is {len(mv)} bytes, header says {declared}")
    raise EntryError("checksum", "xxh3_64 checksum mismatch (corrupted entry)")


def _parse_header(data: memoryview, f: tuple) -> EntryHeader:
    dtype, stored, codec = _CODE_DTYPES.get(f[2]), _CODE_STORED.get(f[3]), _CODE_CODECS.get(f[4])
    ndim, header_len = f[6], f[11]
    if max(header_len, FIXED_HEADER_BYTES + 4 * ndim) > len(data):
        raise EntryError("truncated", f"entry is {len(data)} bytes, header needs {header_len}")
    if dtype is None or stored is None or codec is None:
        raise EntryError("format", f"unknown dtype or codec code in {f[2:5]}")
    shape = struct.unpack_from(f"<{ndim}I", data, FIXED_HEADER_BYTES)
    return EntryHeader(
        f[1], dtype, stored, codec, f[5], f[8], f[10], header_len, f[12], f[13],
        f[14], f[15], f[16], f[17], f[18], shape,
    )  # fmt: skip


def verified_fixed(data: memoryview) -> tuple:
    """The fixed header fields of an entry whose checksum holds; raises `EntryError`."""
    fixed = _unpack_fixed(data)
    _verify_checksum(data, fixed)
    return fixed


def verified_header(data: memoryview) -> EntryHeader:
    """The header of a model entry whose checksum and layout hold; raises `EntryError`."""
    fixed = verified_fixed(data)
    if fixed[5] & FLAG_STACK:
        raise EntryError("kind", "a stack block entry (no token ids): see kvstore.entry.stack")
    h = _parse_header(data, fixed)
    _check_layout(h, len(data))
    return h


def read_header(data: bytes | memoryview) -> EntryHeader:
    """Parse the header without verifying the checksum (inspection, tools)."""
    mv = memoryview(data).cast("B")
    return _parse_header(mv, _unpack_fixed(mv))


def raw_payload_bytes(h: EntryHeader) -> int:
    """The payload size before compression that the header's shape, codec and dtype imply."""
    return payload_size(h.shape, h.stored_dtype)


def _check_layout(h: EntryHeader, total_bytes: int) -> None:
    tokens_end = FIXED_HEADER_BYTES + 4 * len(h.shape) + 4 * h.num_tokens
    quantized = h.stored_dtype not in DTYPE_CODES
    ok = (
        h.total_bytes == total_bytes
        and len(h.shape) == 5
        and h.shape[3] == h.num_tokens
        and h.num_blocks >= 1
        and h.num_tokens % h.num_blocks == 0
        and quantized == (h.codec in QUANT_DTYPES)
        and (not quantized or QUANT_DTYPES[h.codec] == h.stored_dtype)
        and raw_payload_bytes(h) == h.raw_bytes
        and tokens_end <= h.header_bytes
        and (h.codec in ("lz4", "zstd") or h.raw_bytes == h.stored_bytes)
    )
    if not ok:
        raise EntryError("format", f"inconsistent header: shape {h.shape}, {h.raw_bytes} bytes")


def check_identity(
    h: EntryHeader, namespace: bytes, key: bytes, digest: bytes, key_id: bytes
) -> None:
    """Namespace, secret, lookup key and digest, in this order: a digest that differs under
    the same key id is a lookup-key collision, under another key id another secret's."""
    if h.namespace != namespace:
        raise EntryError("namespace", f"entry is from namespace {h.namespace.hex()}")
    if h.key_id != key_id:
        raise EntryError(
            "secret",
            f"entry was written under secret key id {h.key_id.hex()}, this reader's is "
            f"{key_id.hex()}",
        )
    if h.key != key:
        raise EntryError("key", f"entry has lookup key {h.key.hex()}, expected {key.hex()}")
    if h.digest != digest:
        raise EntryError("digest", "verification digest differs: another prefix (key collision)")
