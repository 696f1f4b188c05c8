"""Block entry codec: the self-describing, verified byte format of a KV block in spill tiers.

One entry holds one block (or a chunk of `num_blocks` consecutive blocks): a fixed header,
the shape, the token ids, the payload and an xxh3_64 trailer over everything before it.
The byte layout is documented in docs/FORMAT.md. All integers are little-endian.

`decode_entry` never trusts a stored entry: it checks magic, version, length, checksum, and
that namespace, lookup key, verification digest, dtype (and optionally tokens and shape)
are the ones the caller expects. Any mismatch raises `EntryError` with a `reason`.
"""

from __future__ import annotations

import math
import struct
import sys
import threading
import warnings
from typing import NamedTuple

import lz4.block
import numpy as np
import torch
import xxhash
import zstandard

from hashing import as_token_array

MAGIC = b"KVSB"
FORMAT_VERSION = 1
ID_BYTES = 16
# magic, version, kv dtype, stored dtype, codec, flags, ndim, reserved, num_blocks, reserved,
# num_tokens, header length, raw payload length, stored payload length,
# namespace, key, digest, parent
_FIXED = struct.Struct("<4sHBBBBBBHHIIQQ16s16s16s16s")
FIXED_HEADER_BYTES = _FIXED.size  # 104
CHECKSUM_BYTES = 8
HEADER_ALIGN = 16  # the payload starts at a 16-byte aligned offset

DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
CODEC_CODES = {"none": 0, "fp16": 1, "bf16": 2, "lz4": 3, "zstd": 4}
_CODE_CODECS = {code: name for name, code in CODEC_CODES.items()}
_DOWNCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}
FLAG_SHUFFLED = 1  # payload bytes were byte-shuffled (grouped by significance) before compression
ZSTD_LEVEL = 1
REASONS = (
    "truncated",
    "magic",
    "version",
    "checksum",
    "format",
    "namespace",
    "key",
    "digest",
    "dtype",
    "shape",
    "tokens",
    "input",
)


class EntryError(ValueError):
    """An entry failed to encode or verify. `reason` is one of `REASONS`."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


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


# ----------------------------------------------------------------------------- payload


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    view = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    arr = view.numpy()
    if sys.byteorder != "little":
        arr = arr.byteswap()
    return memoryview(arr).cast("B")


_WORDS = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def _shuffle(raw: memoryview, itemsize: int) -> bytes:
    """Byte planes: all least significant bytes first, then the next ones (compresses better)."""
    words = np.frombuffer(raw, dtype=_WORDS[itemsize])
    planes = [(words >> (8 * i)).astype(np.uint8) for i in range(itemsize)]
    return b"".join(p.data for p in planes)


def _unshuffle(buf: bytes, itemsize: int) -> np.ndarray:
    planes = np.frombuffer(buf, dtype=np.uint8).reshape(itemsize, -1)
    words = planes[0].astype(_WORDS[itemsize])
    for i in range(1, itemsize):
        words |= planes[i].astype(_WORDS[itemsize]) << (8 * i)
    return words


_tls = threading.local()  # zstd (de)compressor objects are not thread-safe


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    pair = getattr(_tls, "zstd", None)
    if pair is None:
        pair = _tls.zstd = (
            zstandard.ZstdCompressor(level=ZSTD_LEVEL),
            zstandard.ZstdDecompressor(),
        )
    return pair


def _compress(raw: memoryview, codec: str, itemsize: int) -> tuple[bytes | memoryview, int]:
    if codec not in ("lz4", "zstd"):
        return raw, 0
    shuffled = _shuffle(raw, itemsize) if itemsize > 1 else raw
    if codec == "lz4":
        return lz4.block.compress(shuffled, store_size=False), FLAG_SHUFFLED
    return _zstd()[0].compress(shuffled), FLAG_SHUFFLED


def _decompress(stored: memoryview, h: EntryHeader) -> bytes | memoryview | np.ndarray:
    if h.codec == "lz4":
        buf = lz4.block.decompress(stored, uncompressed_size=h.raw_bytes)
    elif h.codec == "zstd":
        buf = _zstd()[1].decompress(stored, max_output_size=h.raw_bytes)
    else:
        return stored
    if len(buf) != h.raw_bytes:
        raise EntryError(
            "format", f"payload inflates to {len(buf)} bytes, header says {h.raw_bytes}"
        )
    itemsize = h.stored_dtype.itemsize
    return _unshuffle(buf, itemsize) if h.flags & FLAG_SHUFFLED and itemsize > 1 else buf


def _silence_readonly_warning() -> None:
    # Decoded KV is a zero-copy view of immutable bytes. torch warns once per process that
    # such a buffer is read-only; spend those warnings here, at import, in one thread.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(bytes(4), dtype=torch.uint8)
        torch.from_numpy(np.frombuffer(bytes(4), dtype=np.uint8))


NP_DTYPES = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16)}


_silence_readonly_warning()


def frombuffer_le(
    buf: bytes | memoryview | np.ndarray, dtype: torch.dtype, count: int
) -> torch.Tensor:
    t = torch.frombuffer(buf, dtype=dtype, count=count)
    if sys.byteorder != "little":
        t = torch.from_numpy(t.numpy().byteswap())
    return t


# ----------------------------------------------------------------------------- encode


def _check_entry(entry: BlockEntry, tokens: np.ndarray) -> None:
    for name in ("namespace", "key", "digest", "parent"):
        value = getattr(entry, name)
        if not isinstance(value, bytes) or len(value) != ID_BYTES:
            raise EntryError("input", f"{name} must be {ID_BYTES} bytes, got {value!r:.40}")
    kv = entry.kv
    if kv.dtype not in DTYPE_CODES:
        raise EntryError("input", f"kv dtype must be float32, float16 or bfloat16, not {kv.dtype}")
    if kv.dim() != 5 or kv.shape[1] != 2 or kv.shape[3] != len(tokens):
        raise EntryError(
            "input",
            f"kv must be [layers, 2, kv_heads, {len(tokens)} tokens, head_dim], "
            f"got {tuple(kv.shape)}",
        )
    if not 1 <= entry.num_blocks <= 0xFFFF or len(tokens) % entry.num_blocks:
        raise EntryError(
            "input", f"{len(tokens)} tokens do not split into {entry.num_blocks} blocks"
        )


def _stored_tensor(kv: torch.Tensor, codec: str) -> torch.Tensor:
    """The tensor whose bytes are stored: downcast for fp16/bf16 codecs when kv is float32."""
    target = _DOWNCAST.get(codec)
    if target is not None and kv.dtype == torch.float32:
        kv = kv.to(target)
    return kv.detach().to("cpu").contiguous()


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
        entry.namespace, entry.key, entry.digest, entry.parent,
    )  # fmt: skip
    pad = bytes(header_len - FIXED_HEADER_BYTES - len(shape) - tokens.nbytes)
    return b"".join((fixed, shape, tokens.astype("<u4", copy=False).data, pad))


def payload_bytes(kv: torch.Tensor) -> memoryview:
    """The payload bytes `encode_entry` stores for `kv` with codec "none" (C order, LE)."""
    return tensor_bytes(kv.detach().to("cpu").contiguous())


def max_entry_bytes(entry: BlockEntry) -> int:
    """An upper bound of `len(encode_entry(entry, codec))`, whatever the codec."""
    header = _align(FIXED_HEADER_BYTES + 4 * entry.kv.dim() + 4 * len(entry.token_ids))
    return header + entry.kv.numel() * entry.kv.element_size() + CHECKSUM_BYTES


def encode_entry(
    entry: BlockEntry, codec: str = "none", out: bytearray | memoryview | None = None
) -> bytes | memoryview:
    """Serialize `entry` with the payload `codec` ("none", "fp16", "bf16", "lz4", "zstd").

    "fp16"/"bf16" downcast float32 KV (lossy); on 16-bit KV they store it unchanged.
    "lz4"/"zstd" byte-shuffle and compress (lossless).
    With `out` (writable, at least `max_entry_bytes(entry)` long) the entry is written at
    its start and a memoryview of it is returned: a reused buffer spares an allocation.
    """
    if codec not in CODEC_CODES:
        raise EntryError("input", f"codec must be one of {tuple(CODEC_CODES)}, got {codec!r}")
    tokens = as_token_array(entry.token_ids)
    _check_entry(entry, tokens)
    stored_t = _stored_tensor(entry.kv, codec)
    if codec in _DOWNCAST and stored_t.dtype == entry.kv.dtype:
        codec = "none"  # no downcast happened: record what is really stored
    raw = tensor_bytes(stored_t)
    payload, flags = _compress(raw, codec, stored_t.element_size())
    if flags and len(payload) >= raw.nbytes:  # incompressible: store raw, say so in the header
        payload, flags, codec = raw, 0, "none"
    header = pack_header(
        entry, tokens, DTYPE_CODES[stored_t.dtype], codec, flags, raw.nbytes, len(payload)
    )
    return assemble_entry(header, payload, out)


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


# ----------------------------------------------------------------------------- decode


def _unpack_fixed(data: memoryview) -> tuple:
    """The fixed header fields, after checking size, magic and version only."""
    if len(data) < FIXED_HEADER_BYTES + CHECKSUM_BYTES:
        raise EntryError("truncated", f"entry is {len(data)} bytes, shorter than a header")
    f = _FIXED.unpack_from(data, 0)
    if f[0] != MAGIC:
        raise EntryError("magic", f"magic is {f[0]!r}, expected {MAGIC!r}")
    if f[1] != FORMAT_VERSION:
        raise EntryError("version", f"format version {f[1]}, this reader knows {FORMAT_VERSION}")
    return f


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
    dtype, stored, codec = _CODE_DTYPES.get(f[2]), _CODE_DTYPES.get(f[3]), _CODE_CODECS.get(f[4])
    ndim, header_len = f[6], f[11]
    if max(header_len, FIXED_HEADER_BYTES + 4 * ndim) > len(data):
        raise EntryError("truncated", f"entry is {len(data)} bytes, header needs {header_len}")
    if dtype is None or stored is None or codec is None:
        raise EntryError("format", f"unknown dtype or codec code in {f[2:5]}")
    shape = struct.unpack_from(f"<{ndim}I", data, FIXED_HEADER_BYTES)
    return EntryHeader(
        f[1], dtype, stored, codec, f[5], f[8], f[10], header_len, f[12], f[13],
        f[14], f[15], f[16], f[17], shape,
    )  # fmt: skip


def read_header(data: bytes | memoryview) -> EntryHeader:
    """Parse the header without verifying the checksum (inspection, tools)."""
    mv = memoryview(data).cast("B")
    return _parse_header(mv, _unpack_fixed(mv))


def _check_layout(h: EntryHeader, total_bytes: int) -> None:
    numel = math.prod(h.shape)
    tokens_end = FIXED_HEADER_BYTES + 4 * len(h.shape) + 4 * h.num_tokens
    ok = (
        h.total_bytes == total_bytes
        and len(h.shape) == 5
        and h.shape[3] == h.num_tokens
        and numel * h.stored_dtype.itemsize == h.raw_bytes
        and tokens_end <= h.header_bytes
        and (h.codec in ("lz4", "zstd") or h.raw_bytes == h.stored_bytes)
    )
    if not ok:
        raise EntryError("format", f"inconsistent header: shape {h.shape}, {h.raw_bytes} bytes")


def _check_identity(h: EntryHeader, namespace: bytes, key: bytes, digest: bytes) -> None:
    if h.namespace != namespace:
        raise EntryError("namespace", f"entry is from namespace {h.namespace.hex()}")
    if h.key != key:
        raise EntryError("key", f"entry has lookup key {h.key.hex()}, expected {key.hex()}")
    if h.digest != digest:
        raise EntryError("digest", "verification digest differs: another prefix (key collision)")


def decode_entry(
    data: bytes | memoryview,
    *,
    namespace: bytes,
    key: bytes,
    digest: bytes,
    dtype: torch.dtype,
    token_ids: np.ndarray | None = None,
    shape: tuple[int, ...] | None = None,
) -> BlockEntry:
    """Verify and decode an entry; raises `EntryError` (with `reason`) on any mismatch.

    The returned `kv` has `dtype`; with codec "none" it is a zero-copy view of `data`
    (read-only: copy it into the pool, never write into it).
    """
    mv = memoryview(data).cast("B")
    fixed = _unpack_fixed(mv)
    _verify_checksum(mv, fixed)
    h = _parse_header(mv, fixed)
    _check_layout(h, len(mv))
    _check_identity(h, namespace, key, digest)
    if h.dtype != dtype:
        raise EntryError("dtype", f"entry holds {h.dtype}, expected {dtype}")
    if shape is not None and tuple(shape) != h.shape:
        raise EntryError("shape", f"entry has shape {h.shape}, expected {tuple(shape)}")
    tokens_at = FIXED_HEADER_BYTES + 4 * len(h.shape)
    tokens = np.frombuffer(mv, dtype="<u4", count=h.num_tokens, offset=tokens_at)
    if token_ids is not None and not np.array_equal(tokens, as_token_array(token_ids)):
        raise EntryError("tokens", "entry token ids differ from the prompt's")
    payload = _decompress(mv[h.header_bytes : h.header_bytes + h.stored_bytes], h)
    numel = h.raw_bytes // h.stored_dtype.itemsize
    kv = frombuffer_le(payload, h.stored_dtype, numel).view(h.shape)
    if kv.dtype != dtype:
        kv = kv.to(dtype)
    return BlockEntry(h.namespace, h.key, h.digest, h.parent, tokens, kv, h.num_blocks)
