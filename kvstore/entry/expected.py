"""ExpectedEntry: the entries of one namespace, dtype, shape and fixed-size codec (`none`,
`int8`, `fp8`), encoded and verified on the hot paths with one comparison of the whole header
(see format.py)."""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Iterable, Sequence

import numpy as np
import torch
import xxhash

from hashing import DEFAULT_KEY_ID
from kvstore.entry.format import (
    CHECKSUM_BYTES,
    FIXED_HEADER_BYTES,
    ID_BYTES,
    STORED_CODES,
    BlockEntry,
    EntryError,
    assemble_entry,
    pack_header,
)
from kvstore.entry.quant import (
    QUANT_DTYPES,
    dequantize_into,
    leading_scales_ok,
    payload_size,
    payloads_into,
    scale_shape,
    scales_ok,
    split_payload,
    split_payload_rows,
    split_payloads,
)
from kvstore.layout import NP_DTYPES, frombuffer_le, tensor_bytes


class ExpectedEntry:
    """The entries of one namespace, dtype, KV shape and codec, for the hot paths.

    `kv()` verifies an entry the reader knows exactly (ids, parent, shape, token ids and
    lengths in one comparison of the whole header, then the checksum); on None the caller
    falls back to `decode_entry`, which says why (or accepts an entry of another codec).
    `encode()` writes such an entry from its parts, without per-field validation, and
    `copy_verified` copies its payload as it is: with a quantized `codec` ("int8", "fp8")
    that payload is a quantized pool's block (scales and values, checked that the scales
    are ones a writer makes); `dequantize_verified` reads one into K/V (`kv()` does not).
    """

    def __init__(
        self,
        namespace: bytes,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        num_blocks: int = 1,
        key_id: bytes = DEFAULT_KEY_ID,
        codec: str = "none",
    ):
        if codec != "none" and codec not in QUANT_DTYPES:
            raise EntryError("input", f"an expected entry's codec is none, int8 or fp8: {codec!r}")
        self.namespace, self.num_blocks, self.codec = namespace, num_blocks, codec
        self.dtype, self.shape = dtype, tuple(shape)
        self.numel = math.prod(shape)
        num_tokens = shape[3]
        zeros, tokens = bytes(ID_BYTES), np.zeros(num_tokens, np.uint32)
        like = torch.empty((), dtype=dtype).expand(shape)
        entry = BlockEntry(namespace, zeros, zeros, zeros, tokens, like, num_blocks, key_id)
        stored = QUANT_DTYPES.get(codec, dtype)
        nbytes = payload_size(self.shape, stored)
        header = pack_header(entry, entry.token_ids, STORED_CODES[stored], codec, 0, nbytes, nbytes)
        tokens_at = FIXED_HEADER_BYTES + 4 * len(shape)
        # everything up to key, digest and parent (key id and namespace included)
        self._head = header[: FIXED_HEADER_BYTES - 3 * ID_BYTES]
        self._shape = header[FIXED_HEADER_BYTES:tokens_at]
        self._pad = header[tokens_at + 4 * num_tokens :]
        self.header_bytes = len(header)
        self._part_sizes = (ID_BYTES, ID_BYTES, ID_BYTES, 4 * num_tokens, nbytes)
        little = sys.byteorder == "little"  # numpy has no bfloat16: torch.frombuffer for it
        self._np_dtype = NP_DTYPES.get(dtype) if little else None
        self.total_bytes = len(header) + nbytes + CHECKSUM_BYTES
        # quantized payloads on a little-endian host (read in batches): their scales
        lean = codec in QUANT_DTYPES and little
        self._scale_rows = math.prod(scale_shape(self.shape)) if lean else None

    def header(self, key: bytes, digest: bytes, parent: bytes, tokens: bytes) -> bytes:
        """The header of the entry; `tokens`: its token ids as little-endian uint32 bytes."""
        return b"".join((self._head, key, digest, parent, self._shape, tokens, self._pad))

    def encode(
        self,
        key: bytes,
        digest: bytes,
        parent: bytes,
        tokens: bytes,
        payload: memoryview,
        out: bytearray | memoryview | None = None,
    ) -> bytes | memoryview:
        """`encode_entry` of the expected entry, from its parts: `tokens` as little-endian
        uint32 bytes, `payload` the payload as stored: the raw KV bytes in C order (codec
        none), or a quantized pool's block as it is (as `encode_entry` with `out`)."""
        sizes = (len(key), len(digest), len(parent), len(tokens), payload.nbytes)
        if sizes != self._part_sizes:
            raise EntryError("input", f"parts have sizes {sizes}, the template {self._part_sizes}")
        header = self.header(key, digest, parent, tokens)
        return assemble_entry(header, payload, out)

    def leading_payloads_ok(self, payload: memoryview, n: int) -> int:
        """How many leading payloads of the `n` back to back in `payload` (a quantized pool's
        blocks, as they are) have only scales a writer makes: a block whose K/V held an inf
        or a NaN has one that is not, and every reader would count its entry damaged."""
        if self.codec == "none" or n == 0:
            return n
        return self._leading_ok(payload, n)[0]

    def encode_many(
        self,
        keys: Sequence[bytes],
        digests: Sequence[bytes],
        parents: Sequence[bytes],
        tokens: bytes,
        payload: memoryview,
    ) -> list[bytes]:
        """`encode()` of len(keys) consecutive entries as new bytes each; `tokens` and
        `payload` hold theirs back to back. Sizes are checked once, not per entry."""
        n = len(keys)
        step, size = 4 * self.shape[3], self._part_sizes[-1]
        if len(tokens) != n * step or payload.nbytes != n * size:
            raise EntryError("input", f"{n} entries need {n * step} token and {n * size} KV bytes")
        if {len(x) for x in (*keys, *digests, *parents)} != {ID_BYTES}:
            raise EntryError("input", f"keys, digests and parents must be {ID_BYTES} bytes")
        head, shape, pad, out = self._head, self._shape, self._pad, []
        for i in range(n):
            parts = (
                head,
                keys[i],
                digests[i],
                parents[i],
                shape,
                tokens[i * step : (i + 1) * step],
            )
            header = b"".join((*parts, pad))
            part = payload[i * size : (i + 1) * size]
            h = xxhash.xxh3_64(header)
            h.update(part)
            out.append(b"".join((header, part, h.intdigest().to_bytes(CHECKSUM_BYTES, "little"))))
        return out

    def copy_verified(
        self,
        data: bytes | memoryview,
        key: bytes,
        digest: bytes,
        parent: bytes,
        tokens: bytes,
        dst: torch.Tensor | memoryview,
    ) -> bool:
        """Copy the payload of the expected entry into `dst` (a contiguous CPU tensor of
        `shape` and `dtype`, or its raw bytes) and verify the checksum over the copy, which
        is then hot in cache: one pass over cold memory instead of two. False (dst then holds
        garbage) if `data` is anything else."""
        data = _as_bytes(data)
        header = self.header(key, digest, parent, tokens)
        if not self.has_header(data, header):
            return False
        out = dst if isinstance(dst, memoryview) else self._tensor_out(dst)
        n = self.header_bytes
        if out is None or out.nbytes != self.total_bytes - n - CHECKSUM_BYTES:
            return False
        out[:] = memoryview(data)[n:-CHECKSUM_BYTES]
        h = xxhash.xxh3_64(header)  # == the entry's header
        h.update(out)
        if h.intdigest() != _U64.unpack_from(data, self.total_bytes - CHECKSUM_BYTES)[0]:
            return False
        return self.codec == "none" or self._scaled(out) is not None  # a quantized row as it is

    def _tensor_out(self, dst: torch.Tensor) -> memoryview | None:
        """The raw bytes of `dst` if the payload can be copied into them as they are."""
        if dst.device.type != "cpu" or not dst.is_contiguous() or sys.byteorder != "little":
            return None
        if self.codec != "none":  # a quantized pool's row (a hybrid pool stages it): bytes
            return memoryview(dst.numpy()) if dst.dtype == torch.uint8 else None
        if dst.dtype != self.dtype or dst.numel() != self.numel:
            return None
        return memoryview(tensor_bytes(dst))

    def has_header(self, data: bytes | memoryview, header: bytes) -> bool:
        """Whether `data` is an entry of this template's size that starts with `header`
        (`header()` of the entry the reader expects). Its payload is not checked."""
        data = _as_bytes(data)
        return len(data) == self.total_bytes and _starts_with(data, header)

    def checksum_ok(self, data: bytes | memoryview) -> bool:
        """Whether the entry's checksum matches its header and payload (of this size)."""
        mv = memoryview(_as_bytes(data))
        checksum = int.from_bytes(mv[-CHECKSUM_BYTES:], "little")
        return xxhash.xxh3_64_intdigest(mv[:-CHECKSUM_BYTES]) == checksum

    def dequantize_verified(
        self,
        data: bytes | memoryview,
        key: bytes,
        digest: bytes,
        parent: bytes,
        tokens: bytes,
        dst: torch.Tensor | memoryview,
    ) -> bool:
        """A quantized entry: its KV into `dst` (a contiguous CPU tensor of `shape`, any float
        dtype, or the raw bytes of one of `dtype`) once header and checksum hold. False if
        `data` is anything else, or a scale is one no writer makes (`decode_entry` then says
        why); `dst` is untouched."""
        return self.dequantize_many([(data, key, digest, parent, tokens)], [dst]) == 1

    def dequantize_many(
        self,
        entries: Sequence[tuple[bytes | memoryview, bytes, bytes, bytes, bytes]],
        dst: Sequence[torch.Tensor | memoryview],
    ) -> int:
        """`dequantize_verified` of entries[i] (data, key, digest, parent, tokens) into dst[i]
        for the leading entries that verify: how many did. The next one, if any, is not
        written. On a little-endian host the scales of all are checked and widened at once."""
        payloads = self._leading_payloads(entries[: len(dst)])
        if not payloads:
            return 0
        if self._scale_rows is None:  # a big-endian host's: one at a time
            return _leading(
                self._dequantize_payload(p, out) for p, out in zip(payloads, dst, strict=False)
            )
        bits, values = split_payloads(payloads, self.shape, QUANT_DTYPES[self.codec])
        n = leading_scales_ok(bits, QUANT_DTYPES[self.codec])
        if n:
            payloads_into(bits[:n], values[:n], [self._rows_of(out) for out in dst[:n]])
        return n

    def _leading_ok(
        self, payloads: bytes | memoryview, n: int
    ) -> tuple[int, np.ndarray, np.ndarray]:
        """`n` quantized payloads back to back: how many leading ones have only scales a
        writer makes, and all of their (scale bits, values) (`split_payload_rows`)."""
        stored = QUANT_DTYPES[self.codec]
        rows = np.frombuffer(payloads, np.uint8).reshape(n, -1)  # an entry a row
        bits, values = split_payload_rows(rows, self.shape, stored)
        return leading_scales_ok(bits, stored), bits, values

    def _leading_payloads(
        self, entries: Sequence[tuple[bytes | memoryview, bytes, bytes, bytes, bytes]]
    ) -> list[memoryview]:
        """The payloads of the leading entries whose header and checksum are as expected."""
        payloads = []
        for data, *args in entries:
            mv = memoryview(_as_bytes(data))
            if not self.has_header(mv, self.header(*args)) or not self.checksum_ok(mv):
                break
            payloads.append(mv[self.header_bytes : -CHECKSUM_BYTES])
        return payloads

    def _dequantize_payload(self, payload: memoryview, dst: torch.Tensor | memoryview) -> bool:
        """A verified payload's KV into `dst`, if its scales are ones a writer makes."""
        scaled = self._scaled(payload)
        if scaled is None:
            return False
        out = dst if isinstance(dst, torch.Tensor) else self._tensor_of(dst).view(self.shape)
        dequantize_into(*scaled, out)
        return True

    def _rows_of(self, dst: torch.Tensor | memoryview) -> torch.Tensor:
        """`dst` as [scales, head_dim] (one row per token, layer, K/V and head)."""
        if not isinstance(dst, torch.Tensor):
            return self._tensor_of(dst).view(self._scale_rows, -1)  # type: ignore[arg-type]
        if dst.device.type != "cpu" or not dst.is_contiguous() or dst.numel() != self.numel:
            raise ValueError(f"dst must be contiguous CPU {self.shape}, got {tuple(dst.shape)}")
        return dst.view(self._scale_rows, -1)  # type: ignore[arg-type]

    def _tensor_of(self, raw: memoryview) -> torch.Tensor:
        """Raw bytes of KV of `dtype` and `shape`, viewed flat (ValueError for another size)."""
        if raw.nbytes != self.numel * self.dtype.itemsize:
            raise ValueError(f"dst holds {raw.nbytes} bytes, KV {self.shape} of {self.dtype}")
        return torch.frombuffer(raw, dtype=self.dtype)

    def _scaled(self, payload: memoryview) -> tuple[np.ndarray, np.ndarray] | None:
        """(scale bits, values) of a quantized payload whose every scale is one a writer
        makes, else None."""
        stored = QUANT_DTYPES[self.codec]
        bits, values = split_payload(payload, self.shape, stored)
        return (bits, values) if scales_ok(bits, stored) else None

    def kv(
        self, data: bytes | memoryview, key: bytes, digest: bytes, parent: bytes, tokens: bytes
    ) -> torch.Tensor | None:
        """The zero-copy KV view of `data` if it is exactly the expected entry, else None."""
        mv = memoryview(_as_bytes(data))
        n, header = self.header_bytes, self.header(key, digest, parent, tokens)
        if self.codec != "none" or not self.has_header(mv, header) or not self.checksum_ok(mv):
            return None
        if self._np_dtype is None:
            return frombuffer_le(mv[n:-CHECKSUM_BYTES], self.dtype, self.numel).view(self.shape)
        return torch.from_numpy(np.ndarray(self.shape, self._np_dtype, mv, n))  # zero-copy


_U64 = struct.Struct("<Q")


def _leading(results: Iterable[bool]) -> int:
    """How many leading results are true (stops at the first false)."""
    n = 0
    for ok in results:
        if not ok:
            break
        n += 1
    return n


def _as_bytes(data: bytes | memoryview) -> bytes | memoryview:
    """`data` itself if it is bytes, else a flat byte view of it (len() counts bytes)."""
    if isinstance(data, bytes):
        return data
    mv = memoryview(data)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _starts_with(data: bytes | memoryview, prefix: bytes) -> bool:
    if isinstance(data, bytes):
        return data.startswith(prefix)
    return bytes(data[: len(prefix)]) == prefix
