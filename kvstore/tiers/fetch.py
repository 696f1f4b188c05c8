"""The read path of the tiers: verified blocks copied straight into pool blocks.

A tier entry holds a chunk of `chunk_blocks` (N) consecutive blocks: chunk c covers blocks
[c*N, (c+1)*N) of a prompt, aligned from the root, and is keyed by the lookup key of its last
block (whose verification digest covers the whole prefix). A read may start inside a chunk
(the blocks the device pool already has are skipped) and never returns a block at or past
the caller's cap.

Each block is verified and copied while it is in cache (one pass over cold memory); a store
may hand out zero-copy views (LMDB's map) for that. With codec "none" one comparison of the
whole expected header (`ExpectedEntry`) and the checksum verify an entry; anything else
goes through `decode_entry`, which says why it fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from hashing import BlockHasher
from kvstore.entry import EntryError, decode_entry
from kvstore.layout import KVLayout, as_block, entry_to_blocks, token_bytes
from kvstore.metrics import CacheMetrics
from kvstore.scopes import Scope
from kvstore.stores import SpillStore
from kvstore.tiers.gate import ReadGate
from kvstore.tiers.layered import (
    LayerLoad,
    LayerLoader,
    LoadEntry,
    LoadPart,
    Segment,
    leading_headers,
)
from kvstore.tiers.rejects import Rejections
from kvstore.units import cdiv

Allocate = Callable[[int], list[torch.Tensor | memoryview]]  # up to n destination blocks


def _cut(entries: list[LoadEntry], stop: int) -> list[LoadEntry]:
    """The entries with blocks before `stop`, their copies ending there."""
    return [e._replace(hi=min(e.hi, stop)) for e in entries if e.lo < stop]


class _Read(NamedTuple):
    """What every chunk read of one fetch shares."""

    scope: Scope
    store: SpillStore
    keys: Sequence[bytes]
    digests: list[bytes]
    token_ids: np.ndarray
    token_bytes: bytes


class TierReader:
    """Fetches verified blocks from the stores, fastest first."""

    def __init__(
        self,
        stores: Sequence[SpillStore],
        layout: KVLayout,
        chunk_blocks: int,
        metrics: CacheMetrics,
        gate: ReadGate,
    ):
        """`gate`: whether a tier is worth reading now (kvstore/tiers/gate.py); it is told
        what each whole read took."""
        self.stores, self.layout, self.metrics = stores, layout, metrics
        self.chunk_blocks, self.gate = chunk_blocks, gate
        self.rejections = Rejections(metrics)

    def fetch_into(
        self,
        scope: Scope,
        keys: Sequence[bytes],
        token_ids: np.ndarray,
        start: int,
        allocate: Allocate,
        on_segment: Callable[[Segment], None] | None = None,
    ) -> list[Segment]:
        """Copy verified blocks keys[start:] into destinations, tier by tier; a tier is asked
        only for what faster ones missed. Returns how many blocks each tier gave, in order,
        each also told to `on_segment` once its tier is read (before the next tier is asked).

        `allocate(n)` returns up to n destination blocks (pool block tensors or their raw
        bytes; an upper bound: verification may stop early, the caller frees the rest).
        `keys` are the prompt's first block keys and cap what is returned; every chunk
        overlapping keys[start:] is read, the last one verified whole even past the cap.
        """
        limit, n = len(keys), self.chunk_blocks
        keys = self._through_chunk_end(scope.hasher, keys, token_ids)
        ends = range((start // n + 1) * n, len(keys) + 1, n)  # end block of each chunk
        digests: list[bytes] | None = None
        segments, pos, dst = [], start, []  # pos: the next block to return
        for store in self.stores:
            todo = [end for end in ends if end > pos]
            if pos >= limit or not todo:
                break
            wanted = [keys[end - 1] for end in todo]
            if not self.gate.allows(store.name, min(limit, todo[-1]) - pos):
                self._skip(store, wanted, todo, pos, limit)
                continue
            began = time.perf_counter()
            with store.read_prefix(wanted) as values:
                if not values:
                    continue
                if digests is None:
                    digests = scope.hasher.digest_blocks(token_ids, num_blocks=len(keys))
                dst += allocate(min(limit, todo[len(values) - 1]) - pos - len(dst))
                read = _Read(scope, store, keys, digests, token_ids, token_bytes(token_ids))
                got = self._read(read, values, todo, pos, dst)
            self.gate.observe_read(store.name, len(values) * n, time.perf_counter() - began)
            if got:
                segments.append(Segment(store.name, got))
                pos, dst = pos + got, dst[got:]
                if on_segment is not None:
                    on_segment(segments[-1])
        return segments

    def _skip(
        self, store: SpillStore, wanted: list[bytes], ends: list[int], pos: int, limit: int
    ) -> None:
        """The gate kept the lookup from reading `store`: count the blocks of [pos, limit)
        it held (its leading entries `wanted`, of the chunks ending at `ends`; one count)."""
        held = store.count_prefix(wanted)
        if held:
            self.gate.skipped(store.name, min(limit, ends[held - 1]) - pos)

    def start_layered(
        self,
        scope: Scope,
        keys: Sequence[bytes],
        token_ids: np.ndarray,
        start: int,
        allocate: Allocate,
        loader: LayerLoader,
    ) -> LayerLoad:
        """`fetch_into`, layer by layer (kvstore/tiers/layered.py): promise blocks keys[start:]
        tier by tier, allocate their destinations and start the loader on them. The load's
        `num_blocks` is the promise; its `result()` what verified. Needs `scope.expected`."""
        expected, n = scope.expected, self.chunk_blocks
        if expected is None:
            raise ValueError("layer-by-layer loads need entries of codec 'none'")
        limit = len(keys)
        keys = self._through_chunk_end(scope.hasher, keys, token_ids)
        ends = range((start // n + 1) * n, len(keys) + 1, n)  # end block of each chunk
        load = LayerLoad(self.layout.num_layers)
        try:
            self._promise(load, scope, keys, token_ids, start, limit, ends, allocate)
        except BaseException:
            load.close()  # the reads it opened (an LMDB read transaction)
            raise
        loader.start(load, expected)
        return load

    def _promise(
        self,
        load: LayerLoad,
        scope: Scope,
        keys: Sequence[bytes],
        token_ids: np.ndarray,
        start: int,
        limit: int,
        ends: range,
        allocate: Allocate,
    ) -> None:
        """The parts of `load`: tier by tier, what each promises of blocks [start, limit)."""
        pos, digests, tokens = start, None, token_bytes(token_ids)
        for store in self.stores:
            todo = [end for end in ends if end > pos]
            if pos >= limit or not todo:
                break
            wanted = [keys[end - 1] for end in todo]
            if not self.gate.allows(store.name, min(limit, todo[-1]) - pos):
                self._skip(store, wanted, todo, pos, limit)
                continue
            values = load.enter(store.read_prefix(wanted)) if store.reads_in_place else None
            count = len(values) if values is not None else store.count_prefix(wanted)
            if not count:
                continue
            if digests is None:  # only once some tier has blocks (as `fetch_into`)
                digests = scope.hasher.digest_blocks(token_ids, num_blocks=len(keys))
            read = _Read(scope, store, keys, digests, token_ids, tokens)
            part = self._part(read, todo[:count], values, pos)
            if part is None:
                continue
            part.dst = allocate(min(limit, part.entries[-1].hi) - pos)
            if not part.dst:
                break
            part.entries = _cut(part.entries, pos + len(part.dst))
            part.num_ok = min(part.num_ok, len(part.entries))
            load.parts.append(part)
            pos += len(part.dst)

    def _part(self, read: _Read, ends: list[int], values: list | None, pos: int) -> LoadPart | None:
        """The entries of `ends` (chunk ends) the store promises, None if none: all of them
        (a key count), or with `values` (read in place) the leading ones whose headers are
        the expected ones; the first that is not is decoded, which records why."""
        n, entries = self.chunk_blocks, []
        for end in ends:
            args = self._entry_args(read, end - n, end)
            header = read.scope.expected.header(*args)  # type: ignore[union-attr]
            entries.append(LoadEntry(args[0], header, end - n, max(end - n, pos), end))
        part = LoadPart(read.store, entries, [], pos, values)
        if values is not None:
            part.num_ok = leading_headers(part, read.scope.expected)  # type: ignore[arg-type]
            if part.num_ok < len(values):
                entry = entries[part.num_ok]
                self._verified_kv(read, values[part.num_ok], entry.first, entry.first + n)
            part.entries = entries[: part.num_ok]
        return part if part.entries else None

    def _through_chunk_end(
        self, hasher: BlockHasher, keys: Sequence[bytes], token_ids: np.ndarray
    ) -> Sequence[bytes]:
        """`keys`, extended to the end of their last chunk when the prompt has those blocks."""
        n, bs = self.chunk_blocks, hasher.block_size
        end = cdiv(len(keys), n) * n
        if end == len(keys) or len(token_ids) < end * bs:
            return keys
        more = hasher.hash_blocks(token_ids[: end * bs], parent=keys[-1], start_block=len(keys))
        return [*keys, *more]

    def _read(
        self,
        read: _Read,
        values: Sequence[bytes | memoryview],
        ends: list[int],
        pos: int,
        dst: list[torch.Tensor | memoryview],
    ) -> int:
        """Copy blocks [pos, pos + len(dst)) of the leading chunks that verify (chunk i ends
        at ends[i]) into dst; returns how many were copied."""
        n, done = self.chunk_blocks, 0
        if n == 1 and read.scope.dequantized is not None:
            done = self._dequantize_leading(read, values, ends, dst)
        for value, end in zip(values[done:], ends[done:], strict=False):  # values: a prefix
            if done == len(dst):
                break
            first = end - n
            if n == 1 and self._copy_verified(read, value, end, dst[done]):
                done += 1  # copied, then verified from the hot copy
                continue
            if self.layout.quant is not None:  # a row as it is, or nothing: say why, stop
                self._verified_kv(read, value, first, end)
                break
            kv = self._verified_kv(read, value, first, end)
            if kv is None:
                break  # a miss from this chunk on
            blocks = entry_to_blocks(kv, n)[max(pos + done, first) - first :]
            for block in blocks[: len(dst) - done]:
                as_block(dst[done], self.layout).copy_(block)  # bytes still hot
                done += 1
        return done

    def _dequantize_leading(
        self,
        read: _Read,
        values: Sequence[bytes | memoryview],
        ends: list[int],
        dst: list[torch.Tensor | memoryview],
    ) -> int:
        """Blocks of quantized entries (a chunk a block) into an unquantized pool: the leading
        ones that verify, checked and dequantized together; how many."""
        count = min(len(values), len(dst))
        entries = [(values[i], *self._entry_args(read, ends[i] - 1, ends[i])) for i in range(count)]
        return read.scope.dequantized.dequantize_many(entries, dst[:count])  # type: ignore[union-attr]

    def _entry_args(self, read: _Read, first: int, end: int) -> tuple[bytes, ...]:
        """key, digest, parent and token bytes of the chunk of blocks [first, end)."""
        bs4 = read.scope.hasher.block_size * 4
        parent = read.keys[first - 1] if first else read.scope.hasher.root
        chunk_tokens = read.token_bytes[first * bs4 : end * bs4]
        return read.keys[end - 1], read.digests[end - 1], parent, chunk_tokens

    def _copy_verified(
        self, read: _Read, value: bytes | memoryview, end: int, dst: torch.Tensor | memoryview
    ) -> bool:
        args = self._entry_args(read, end - 1, end)
        quantized = read.scope.dequantized  # an unquantized pool reading int8 / fp8 entries
        if quantized is not None:
            return quantized.dequantize_verified(value, *args, dst)
        expected = read.scope.expected
        return expected is not None and expected.copy_verified(value, *args, dst)

    def _verified_kv(
        self, read: _Read, value: bytes | memoryview, first: int, end: int
    ) -> torch.Tensor | None:
        """The KV of the chunk's entry if it verifies; else None (deleted if damaged)."""
        args = self._entry_args(read, first, end)
        if read.scope.expected is not None:
            kv = read.scope.expected.kv(value, *args)
            if kv is not None:
                return kv
        quantized = read.scope.dequantized
        if quantized is not None:
            kv = torch.empty(quantized.shape, dtype=self.layout.dtype)
            if quantized.dequantize_verified(value, *args, kv):
                return kv
        bs = read.scope.hasher.block_size  # not the expected bytes: the full decode says why
        chunk_ids = read.token_ids[first * bs : end * bs]
        return self._decode(read, value, args[0], args[1], chunk_ids)

    def _decode(
        self,
        read: _Read,
        value: bytes | memoryview,
        key: bytes,
        digest: bytes,
        tokens: np.ndarray,
    ) -> torch.Tensor | None:
        """KV of a verified entry, or None after recording why not (`Rejections`)."""
        try:
            return decode_entry(
                value,
                namespace=read.scope.root,
                key=key,
                digest=digest,
                dtype=self.layout.dtype,
                token_ids=tokens,
                shape=self.layout.entry_shape(self.chunk_blocks),
                key_id=read.scope.hasher.key_id,
            ).kv
        except EntryError as e:
            self.rejections.record(read.store, [(key, e)])
            return None
