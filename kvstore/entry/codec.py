"""Encode and decode whole entries (format in `kvstore.entry.format`, docs/FORMAT.md).

`decode_entry` never trusts a stored entry: it checks magic, version, length, checksum, and
that namespace, secret (key id), lookup key, verification digest, dtype (and optionally
tokens and shape) are the ones the caller expects. Any mismatch raises `EntryError` with a
`reason` (whose kind says whether the entry is damaged, foreign or another prefix's).
"""

from __future__ import annotations

import threading

import lz4.block
import numpy as np
import torch
import zstandard

from hashing import DEFAULT_KEY_ID, KEY_ID_BYTES, as_token_array
from kvstore.entry.format import (
    CODEC_CODES,
    DTYPE_CODES,
    FIXED_HEADER_BYTES,
    FLAG_SHUFFLED,
    ID_BYTES,
    STORED_CODES,
    BlockEntry,
    EntryError,
    EntryHeader,
    assemble_entry,
    check_identity,
    pack_header,
    verified_header,
)
from kvstore.entry.quant import (
    QUANT_DTYPES,
    QuantError,
    dequantize,
    pack_payload,
    quantize,
    scales_ok,
    split_payload,
)
from kvstore.layout import frombuffer_le, tensor_bytes

_DOWNCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}
ZSTD_LEVEL = 1

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


def _check_entry(entry: BlockEntry, tokens: np.ndarray) -> None:
    for name in ("namespace", "key", "digest", "parent"):
        value = getattr(entry, name)
        if not isinstance(value, bytes) or len(value) != ID_BYTES:
            raise EntryError("input", f"{name} must be {ID_BYTES} bytes, got {value!r:.40}")
    if not isinstance(entry.key_id, bytes) or len(entry.key_id) != KEY_ID_BYTES:
        raise EntryError("input", f"key_id must be {KEY_ID_BYTES} bytes (hashing.key_id)")
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


def payload_bytes(kv: torch.Tensor) -> memoryview:
    """The payload bytes `encode_entry` stores for `kv` with codec "none" (C order, LE)."""
    return tensor_bytes(kv.detach().to("cpu").contiguous())


def encode_entry(
    entry: BlockEntry, codec: str = "none", out: bytearray | memoryview | None = None
) -> bytes | memoryview:
    """Serialize `entry` with the payload `codec` (`CODEC_CODES`: "none", "fp16", "bf16",
    "lz4", "zstd", "int8", "fp8").

    "fp16"/"bf16" downcast float32 KV (lossy); on 16-bit KV they store it unchanged.
    "lz4"/"zstd" byte-shuffle and compress (lossless). "int8"/"fp8" quantize (lossy, a
    scale per token, layer, K/V and head: `kvstore.entry.quant`).
    With `out` (writable, at least `max_entry_bytes(entry)` long) the entry is written at
    its start and a memoryview of it is returned: a reused buffer spares an allocation.
    """
    if codec not in CODEC_CODES:
        raise EntryError("input", f"codec must be one of {tuple(CODEC_CODES)}, got {codec!r}")
    tokens = as_token_array(entry.token_ids)
    _check_entry(entry, tokens)
    if codec in QUANT_DTYPES:
        return _encode_quantized(entry, tokens, codec, out)
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


def _encode_quantized(
    entry: BlockEntry, tokens: np.ndarray, codec: str, out: bytearray | memoryview | None
) -> bytes | memoryview:
    """Scales, padding, then values (kvstore/entry/quant.py): one payload, never compressed."""
    stored = QUANT_DTYPES[codec]
    try:
        payload = pack_payload(*quantize(entry.kv, stored))
    except QuantError as e:
        raise EntryError("input", str(e)) from None
    header = pack_header(entry, tokens, STORED_CODES[stored], codec, 0, len(payload), len(payload))
    return assemble_entry(header, payload, out)


def _dequantized(payload: memoryview, h: EntryHeader, dtype: torch.dtype) -> torch.Tensor:
    """The KV of a quantized payload as `dtype`; a scale no writer makes is damage."""
    bits, values = split_payload(payload, h.shape, h.stored_dtype)
    if not scales_ok(bits, h.stored_dtype):
        raise EntryError("format", "a scale is outside [2**-126, float32 max / QMAX]")
    return dequantize(bits, values, dtype)


def decode_entry(
    data: bytes | memoryview,
    *,
    namespace: bytes,
    key: bytes,
    digest: bytes,
    dtype: torch.dtype,
    token_ids: np.ndarray | None = None,
    shape: tuple[int, ...] | None = None,
    key_id: bytes = DEFAULT_KEY_ID,
) -> BlockEntry:
    """Verify and decode an entry; raises `EntryError` (with `reason`) on any mismatch.

    The returned `kv` has `dtype`; with codec "none" it is a zero-copy view of `data`
    (read-only: copy it into the pool, never write into it).
    """
    mv = memoryview(data).cast("B")
    h = verified_header(mv)
    check_identity(h, namespace, key, digest, key_id)
    if h.dtype != dtype:
        raise EntryError("dtype", f"entry holds {h.dtype}, expected {dtype}")
    if shape is not None and tuple(shape) != h.shape:
        raise EntryError("shape", f"entry has shape {h.shape}, expected {tuple(shape)}")
    tokens_at = FIXED_HEADER_BYTES + 4 * len(h.shape)
    tokens = np.frombuffer(mv, dtype="<u4", count=h.num_tokens, offset=tokens_at)
    if token_ids is not None and not np.array_equal(tokens, as_token_array(token_ids)):
        raise EntryError("tokens", "entry token ids differ from the prompt's")
    if h.codec in QUANT_DTYPES:
        kv = _dequantized(mv[h.header_bytes : h.header_bytes + h.stored_bytes], h, dtype)
        return BlockEntry(
            h.namespace, h.key, h.digest, h.parent, tokens, kv, h.num_blocks, h.key_id
        )
    payload = _decompress(mv[h.header_bytes : h.header_bytes + h.stored_bytes], h)
    numel = h.raw_bytes // h.stored_dtype.itemsize
    kv = frombuffer_le(payload, h.stored_dtype, numel).view(h.shape)
    if kv.dtype != dtype:
        kv = kv.to(dtype)
    return BlockEntry(h.namespace, h.key, h.digest, h.parent, tokens, kv, h.num_blocks, h.key_id)
