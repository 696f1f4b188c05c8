"""The spill tiers below the device pool: verified fetches on lookup, and write policies.

A tier entry holds a chunk of `chunk_blocks` (N) consecutive blocks: chunk c covers blocks
[c*N, (c+1)*N) of a prompt, aligned from the root, and is keyed by the lookup key of its last
block (whose verification digest covers the whole prefix). Only whole chunks are written; a
read may start inside a chunk (the blocks the device pool already has are skipped) and never
returns a block at or past the caller's cap. N = 1 is one entry per block.

Reads (`fetch_into`) verify each block and copy it straight into its destination (a pool
block) while it is in cache; a store may hand out zero-copy views (LMDB's map) for that.
With codec "none" one comparison of the whole expected header (EntryTemplate) and the
checksum verify an entry; anything else goes through `decode_entry`, which says why it fails.

Writes never run on the caller's thread: a queued write holds an independent copy of its
blocks (taken while they are still owned), so a block id reused after eviction can never be
written under another block's key. A background `TierWriter` encodes and writes (into a reused
buffer for stores that copy values); its queue is bounded in blocks and a write that does not
fit is dropped and counted.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import NamedTuple

import numpy as np
import torch

from hashing import BlockHasher
from kvstore.codec import (
    EntryError,
    decode_entry,
)
from kvstore.config import CacheConfig
from kvstore.metrics import CacheMetrics
from kvstore.pool import DTYPES, BlockPool
from kvstore.stores import SpillStore
from kvstore.template import EntryTemplate
from kvstore.writer import PendingWrite, Scope, TierWriter

MAX_SCOPES = 4096  # namespaces (tenant salts) whose entry templates are kept
log = logging.getLogger("kvstore.tiers")


class Segment(NamedTuple):
    """Verified blocks fetched from one tier, consecutive in the prompt."""

    tier: str
    num_blocks: int


Allocate = Callable[[int], list[torch.Tensor | memoryview]]  # up to n destination blocks


def _split_blocks(kv: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """[layers, 2, kv_heads, n * bs, head_dim] -> n views [layers, 2, kv_heads, bs, head_dim]."""
    if n == 1:
        return (kv,)
    layers, _, heads, tokens, dim = kv.shape
    return kv.view(layers, 2, heads, n, tokens // n, dim).unbind(3)


class Tiers:
    """Spill stores fastest first, with their write policies and one background writer."""

    def __init__(
        self,
        config: CacheConfig,
        hasher: BlockHasher,
        metrics: CacheMetrics,
        stores: Sequence[SpillStore],
    ):
        self.config, self.metrics = config, metrics
        ns = hasher.namespace
        self.stores = list(stores)
        self.chunk_blocks = config.chunk_blocks
        tokens = config.chunk_blocks * ns.block_size  # per entry
        self._shape = (ns.num_layers, 2, ns.num_kv_heads, tokens, ns.head_dim)
        self._dtype = {"float32": torch.float32, "float16": torch.float16}.get(
            ns.kv_dtype, torch.bfloat16
        )
        self._scopes: OrderedDict[bytes, Scope] = OrderedDict()  # by namespace root, bounded
        self._policy = [
            getattr(config, f"{s.name}_write_policy", "write-through") for s in self.stores
        ]
        self._hits: OrderedDict[bytes, int] = OrderedDict()  # selective write-through counts
        self.writer = TierWriter(self.stores, config.codec, config.write_queue_blocks, metrics)
        _flush_at_exit(self)
        warn_unreachable(self.stores)

    def __bool__(self) -> bool:
        return bool(self.stores)

    def targets(self, policy: str) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(self._policy) if p == policy)

    def faster_write_through(self, tier: str) -> tuple[int, ...]:
        """Write-through stores faster than `tier`: a hit there fills them (like a store)."""
        names = [store.name for store in self.stores]
        return tuple(i for i in self.targets("write-through") if i < names.index(tier))

    def scope(self, hasher: BlockHasher) -> Scope:
        """The view of one namespace (one per tenant salt), made once and kept (LRU, bounded)."""
        root = hasher.namespace.root()
        scope = self._scopes.pop(root, None)
        if scope is None:
            template = None
            if self.config.codec == "none":
                template = EntryTemplate(root, self._dtype, self._shape, self.chunk_blocks)
            scope = Scope(hasher, root, template)
        self._scopes[root] = scope
        if len(self._scopes) > MAX_SCOPES:
            self._scopes.popitem(last=False)
        return scope

    # --- reads -----------------------------------------------------------------------------
    def fetch_into(
        self,
        scope: Scope,
        keys: Sequence[bytes],
        token_ids: np.ndarray,
        start: int,
        allocate: Allocate,
    ) -> list[Segment]:
        """Copy verified blocks keys[start:] into destinations, tier by tier; a tier is asked
        only for what faster ones missed. Returns how many blocks each tier gave, in order.

        `allocate(n)` returns up to n destination tensors [layers, 2, kv_heads, block_size,
        head_dim] (an upper bound: verification may stop early; the caller frees the rest).
        Each block is verified and copied while it is in cache (one pass over cold memory).
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
            with store.read_prefix([keys[end - 1] for end in todo]) as values:
                if not values:
                    continue
                if digests is None:
                    digests = scope.hasher.digest_blocks(token_ids, num_blocks=len(keys))
                dst += allocate(min(limit, todo[len(values) - 1]) - pos - len(dst))
                got = self._read(scope, store, values, keys, digests, token_ids, todo, pos, dst)
            if got:
                segments.append(Segment(store.name, got))
                pos, dst = pos + got, dst[got:]
        return segments

    def _through_chunk_end(
        self, hasher: BlockHasher, keys: Sequence[bytes], token_ids: np.ndarray
    ) -> Sequence[bytes]:
        """`keys`, extended to the end of their last chunk when the prompt has those blocks."""
        n, bs = self.chunk_blocks, hasher.block_size
        end = -(-len(keys) // n) * n
        if end == len(keys) or len(token_ids) < end * bs:
            return keys
        more = hasher.hash_blocks(token_ids[: end * bs], parent=keys[-1], start_block=len(keys))
        return [*keys, *more]

    def _read(
        self,
        scope: Scope,
        store: SpillStore,
        values: Sequence[bytes | memoryview],
        keys: Sequence[bytes],
        digests: list[bytes],
        token_ids: np.ndarray,
        ends: list[int],
        pos: int,
        dst: list[torch.Tensor | memoryview],
    ) -> int:
        """Copy blocks [pos, pos + len(dst)) of the leading chunks that verify (chunk i ends
        at ends[i]) into dst; returns how many were copied."""
        n, bs, template, done = self.chunk_blocks, scope.hasher.block_size, scope.template, 0
        pool_dtype = DTYPES[scope.hasher.namespace.kv_dtype]
        token_bytes = token_ids.astype("<u4", copy=False).tobytes()
        for value, end in zip(values, ends, strict=False):  # values: a prefix
            if done == len(dst):
                break
            first, key, digest = end - n, keys[end - 1], digests[end - 1]
            parent = keys[first - 1] if first else scope.hasher.root
            chunk_tokens = token_bytes[first * bs * 4 : end * bs * 4]
            fast = n == 1 and template is not None
            if fast and template.copy_verified(value, key, digest, parent, chunk_tokens, dst[done]):
                done += 1  # copied, then verified from the hot copy
                continue
            kv = template.kv(value, key, digest, parent, chunk_tokens) if template else None
            if kv is None:  # not the expected bytes: the full decode says why, or accepts
                chunk_ids = token_ids[first * bs : end * bs]
                kv = self._decode(scope.root, store, value, key, digest, chunk_ids)
                if kv is None:
                    break  # a miss from this chunk on
            blocks = _split_blocks(kv, n)[max(pos + done, first) - first :]
            for block in blocks[: len(dst) - done]:
                _as_tensor(dst[done], block.shape, pool_dtype).copy_(block)  # bytes still hot
                done += 1
        return done

    def _decode(
        self,
        root: bytes,
        store: SpillStore,
        value: bytes | memoryview,
        key: bytes,
        digest: bytes,
        tokens: np.ndarray,
    ) -> torch.Tensor | None:
        """KV of a verified entry, or None after rejecting (deleting and counting) it."""
        try:
            return decode_entry(
                value,
                namespace=root,
                key=key,
                digest=digest,
                dtype=self._dtype,
                token_ids=tokens,
                shape=self._shape,
            ).kv
        except EntryError as e:
            store.reject([key])
            self.metrics.inc("verify_failures_total", tier=store.name, reason=e.reason)
            return None

    # --- writes ----------------------------------------------------------------------------
    def submit_from_pool(
        self,
        scope: Scope,
        targets: tuple[int, ...],
        keys: list[bytes],
        token_ids: np.ndarray,
        start: int,
        block_ids: Sequence[int],
        pool: BlockPool,
    ) -> None:
        """Queue the whole chunks of keys that hold blocks keys[start:], for `targets`.

        block_ids[i] is the pool block of keys[i]; the caller owns them until this returns
        (the chunks are copied out of `pool` now, so a reused block id cannot be written).
        """
        n = self.chunk_blocks
        first, end = start // n * n, len(keys) // n * n
        if targets and end > start:
            kv = pool.read_blocks(block_ids[first:end])
            self._queue(scope, targets, keys, token_ids, first, end, kv)

    def _queue(
        self,
        scope: Scope,
        targets: tuple[int, ...],
        keys: list[bytes],
        token_ids: np.ndarray,
        first: int,
        end: int,
        kv: torch.Tensor,
    ) -> None:
        """Queue the chunks of blocks [first, end) (both chunk-aligned); kv holds those blocks."""
        n, bs = self.chunk_blocks, scope.hasher.block_size
        digests = scope.hasher.digest_blocks(token_ids, num_blocks=end)
        parent = keys[first - 1] if first else scope.hasher.root
        last = range(first + n - 1, end, n)  # the last block of each chunk
        write = PendingWrite(
            [keys[i] for i in last],
            [digests[i] for i in last],
            parent,
            token_ids[first * bs : end * bs],
            kv,
            targets,
            scope,
        )
        self.writer.submit(write)

    def count_hits(self, keys: Sequence[bytes]) -> int:
        """Count a device hit on each key; returns how many leading keys just reached the
        selective write-through threshold (those are the ones to write)."""
        threshold, reached = self.config.selective_min_hits, 0
        for i, key in enumerate(keys):
            count = self._hits.pop(key, 0) + 1
            self._hits[key] = count
            if count == threshold:
                reached = i + 1
        while len(self._hits) > 1_000_000:
            self._hits.popitem(last=False)
        return reached

    def stats(self) -> dict[str, dict]:
        return {store.name: asdict(store.stats()) for store in self.stores}

    def close(self) -> None:
        self.writer.close(self.config.flush_timeout_s)
        for store in self.stores:
            store.close()


def warn_unreachable(stores: Sequence[SpillStore]) -> None:
    """A warning for each store that cannot be reached now: the cache still serves, but
    everything it would have read from that tier is recomputed."""
    for store in stores:
        reason = store.probe()
        if reason is not None:
            log.warning(
                "%s tier unreachable at start (%s): lookups miss it and writes to it are "
                "dropped until it answers",
                store.name,
                reason,
            )


def _flush_at_exit(tiers: Tiers) -> None:
    ref = weakref.ref(tiers)

    def flush() -> None:
        live = ref()
        if live is not None:
            live.writer.flush(live.config.flush_timeout_s)

    atexit.register(flush)


def _as_tensor(
    dst: torch.Tensor | memoryview, shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    """A destination block as a tensor (raw bytes of a CPU pool block are viewed, no copy)."""
    if isinstance(dst, torch.Tensor):
        return dst
    return torch.frombuffer(dst, dtype=torch.uint8).view(dtype).view(shape)
