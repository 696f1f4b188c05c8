"""The operations `bench io` times, each with the baseline moving the same bytes (see io.py)."""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import lmdb
import numpy as np
import redis
import torch

from hashing import BlockHasher, Namespace
from kvstore.config import CacheConfig
from kvstore.device.pool import BlockPool
from kvstore.entry import CHECKSUM_BYTES, BlockEntry, encode_entry
from kvstore.metrics import CacheMetrics
from kvstore.scopes import Scope, Scopes
from kvstore.stores import LmdbStore, MemoryStore, RedisStore, SpillStore
from kvstore.tiers import PendingWrite, Tiers

LAYERS, KV_HEADS, BLOCK_SIZE, HEAD_DIM = 8, 2, 16, 64  # the pinned tiny model
BATCH_BLOCKS = 112  # a 1792-token prefix
TARGET_RATIO = 0.5
DEADLINE_MS = 10_000.0  # generous: a slow round must not turn into a miss
GIB = 2**30


def namespace() -> Namespace:
    return Namespace("bench-io", "float32", LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE)


class Batch:
    """One prefix: tokens, keys, digests, KV blocks, and its entries (chunk_blocks per entry)."""

    def __init__(self, chunk_blocks: int = 1, seed: int = 0):
        ns = namespace()
        self.hasher = BlockHasher(ns)
        rng = np.random.default_rng(seed)
        self.tokens = rng.integers(0, 32_000, BATCH_BLOCKS * BLOCK_SIZE, dtype=np.uint32)
        self.keys = self.hasher.hash_blocks(self.tokens)
        self.digests = self.hasher.digest_blocks(self.tokens)
        g = torch.Generator().manual_seed(seed)
        # [blocks, layers, 2, kv_heads, block_size, head_dim], like BlockPool.read_blocks
        self.kv = torch.randn(BATCH_BLOCKS, LAYERS, 2, KV_HEADS, BLOCK_SIZE, HEAD_DIM, generator=g)
        self.block_bytes = self.kv[0].numel() * self.kv.element_size()
        self.nbytes = self.block_bytes * BATCH_BLOCKS
        self.chunk_blocks = chunk_blocks
        last = range(chunk_blocks - 1, BATCH_BLOCKS, chunk_blocks)  # the last block of each entry
        self.entry_keys = [self.keys[i] for i in last]
        self.entry_digests = [self.digests[i] for i in last]
        self.items = self.encode()

    def pending(self, scope: Scope) -> PendingWrite:
        """The queued write of the whole batch, as write-through submits it."""
        keys, digests = self.entry_keys, self.entry_digests
        return PendingWrite(keys, digests, self.hasher.root, self.tokens, self.kv, (0,), scope)

    def encode(self) -> list[tuple[bytes, bytes]]:
        """(key, entry) per entry, encoded once (the `put` operation stores these)."""
        n, root, items, parent = self.chunk_blocks, namespace().root(), [], self.hasher.root
        for i, (key, digest) in enumerate(zip(self.entry_keys, self.entry_digests, strict=True)):
            blocks = self.kv[i * n : (i + 1) * n]  # -> [layers, 2, kv_heads, n * bs, head_dim]
            kv = blocks.permute(1, 2, 3, 0, 4, 5).reshape(LAYERS, 2, KV_HEADS, -1, HEAD_DIM)
            tokens = self.tokens[i * n * BLOCK_SIZE : (i + 1) * n * BLOCK_SIZE]
            items.append((key, encode_entry(BlockEntry(root, key, digest, parent, tokens, kv, n))))
            parent = key
        return items


def _nothing() -> None:
    return None


@dataclass
class Case:
    """One operation on one tier and its baseline; `reset*` run untimed before each call."""

    tier: str
    op: str
    run: Callable[[], object]
    baseline: str
    base: Callable[[], object]
    reset: Callable[[], object] = _nothing
    reset_base: Callable[[], object] = _nothing
    times: list[float] = field(default_factory=list)
    base_times: list[float] = field(default_factory=list)

    def measure(self, base_first: bool) -> None:
        pairs = [(self.reset, self.run, self.times), (self.reset_base, self.base, self.base_times)]
        for reset, fn, out in pairs[::-1] if base_first else pairs:
            reset()
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)

    def result(self, nbytes: int) -> dict:
        ratios = [b / t for t, b in zip(self.times, self.base_times, strict=True)]
        return {
            "tier": self.tier,
            "op": self.op,
            "gbps": round(nbytes / statistics.median(self.times) / 1e9, 3),
            "baseline": self.baseline,
            "baseline_gbps": round(nbytes / statistics.median(self.base_times) / 1e9, 3),
            "ratio": round(statistics.median(ratios), 3),
        }


class Paths:
    """The real read and write paths of the cache, over one store."""

    def __init__(self, batch: Batch, store: SpillStore):
        self.batch, self.store = batch, store
        config = CacheConfig(
            block_size=BLOCK_SIZE, lookup_deadline_ms=DEADLINE_MS, chunk_blocks=batch.chunk_blocks
        )
        self.metrics = CacheMetrics()
        self.pool = BlockPool(BATCH_BLOCKS, namespace(), torch.device("cpu"))
        self.tiers = Tiers(config, [store], self.pool, self.metrics)
        self.scope = Scopes(config, namespace(), with_entries=True).default
        self.block_ids = list(range(BATCH_BLOCKS))

    def read(self) -> None:
        """PrefixCache.lookup for a device miss: fetch + verify, promote into the pool."""
        segments = self.tiers.reader.fetch_into(
            self.scope,
            self.batch.keys,
            self.batch.tokens,
            0,
            lambda n: self.pool.destinations(self.block_ids[:n]),  # as PrefixCache allocates
        )
        _check_count(self.store, sum(s.num_blocks for s in segments), BATCH_BLOCKS)

    def get(self) -> None:
        """The store's read on the lookup path alone (zero-copy where the store can)."""
        with self.store.read_prefix(self.batch.entry_keys) as values:
            _check_count(self.store, len(values), len(self.batch.entry_keys))

    def write(self) -> None:
        """The tier writer's work for one queued write: encode every entry + put_many."""
        before = self.metrics.get("tier_writes_blocks_total", tier=self.store.name)
        self.tiers.writer.write(self.batch.pending(self.scope))
        after = self.metrics.get("tier_writes_blocks_total", tier=self.store.name)
        _check_count(self.store, after - before, BATCH_BLOCKS)

    def put(self) -> None:
        _check_count(self.store, self.store.put_many(self.batch.items), len(self.batch.items))

    def clear(self) -> None:
        self.store.delete(self.batch.entry_keys)

    def close(self) -> None:
        self.tiers.close()


def _check_count(store: SpillStore, n: int, expected: int) -> None:
    if n != expected:
        raise RuntimeError(f"{store.name}: {n} of {expected} went through")


def _path_cases(tier: str, reader: Paths, writer: Paths) -> list[Case]:
    """read/get on a filled store, write/put on a store emptied before each call."""
    reader.put()
    reader.read()
    if not torch.equal(reader.pool.kv, reader.batch.kv):
        raise RuntimeError(f"{tier}: blocks read back differ from the blocks written")
    return [
        Case(tier, "read", reader.read, "", _nothing),
        Case(tier, "get", reader.get, "", _nothing),
        Case(tier, "write", writer.write, "", _nothing, reset=writer.clear),
        Case(tier, "put", writer.put, "", _nothing, reset=writer.clear),
    ]


def _memcpy(batch: Batch) -> Callable[[], None]:
    """A plain copy of the batch's bytes, block by block, into a preallocated buffer."""
    src = [memoryview(block.numpy()).cast("B") for block in batch.kv.clone()]
    dst = memoryview(bytearray(batch.nbytes))
    size = batch.block_bytes

    def copy() -> None:
        for i, block in enumerate(src):
            dst[i * size : (i + 1) * size] = block

    return copy


def _map_copy(batch: Batch, env: lmdb.Environment) -> Callable[[], None]:
    """A plain copy of the batch's KV bytes out of a raw LMDB map (one read transaction, no
    verification) into a preallocated buffer: the same bytes from where LMDB keeps them."""
    with env.begin(write=True) as txn:
        for key, value in batch.items:
            txn.put(key, value)
    keys, size = [key for key, _ in batch.items], batch.nbytes // len(batch.items)
    start = len(batch.items[0][1]) - CHECKSUM_BYTES - size  # the payload, after the header
    dst = memoryview(bytearray(batch.nbytes))

    def copy() -> None:
        with env.begin(buffers=True) as txn:
            for i, key in enumerate(keys):
                dst[i * size : (i + 1) * size] = txn.get(key)[start : start + size]

    return copy


def _clone(batch: Batch) -> tuple[Callable[[], None], Callable[[], None]]:
    """A plain copy of the batch's bytes into new bytes objects (what a store that keeps its
    values must allocate), and the untimed release of the previous copies."""
    src = [memoryview(block.numpy()).cast("B") for block in batch.kv.clone()]
    kept: list[bytes] = []

    def clone() -> None:
        kept.extend(bytes(block) for block in src)

    return clone, kept.clear


def memory_cases(batch: Batch, stack: contextlib.ExitStack) -> list[Case]:
    reader = Paths(batch, MemoryStore(GIB))
    writer = Paths(batch, MemoryStore(GIB))
    stack.callback(reader.close)
    stack.callback(writer.close)
    cases = _path_cases("memory", reader, writer)
    copy = _memcpy(batch)
    clone, drop = _clone(batch)
    for case in cases:
        if case.op in ("read", "get"):
            case.baseline, case.base = "memcpy", copy
        else:
            case.baseline, case.base, case.reset_base = "bytes clone", clone, drop
    return cases


def lmdb_cases(batch: Batch, stack: contextlib.ExitStack) -> list[Case]:
    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-io-"))
    reader = Paths(batch, LmdbStore(f"{tmp}/read", GIB))
    writer = Paths(batch, LmdbStore(f"{tmp}/write", GIB))
    stack.callback(reader.close)
    stack.callback(writer.close)
    env = lmdb.open(f"{tmp}/raw", map_size=GIB, sync=False, metasync=False, readahead=False)
    stack.callback(env.close)

    def raw_put() -> None:
        with env.begin(write=True) as txn:
            for key, value in batch.items:
                txn.put(key, value)

    def raw_clear() -> None:
        with env.begin(write=True) as txn:
            txn.drop(env.open_db(), delete=False)

    cases = _path_cases("lmdb", reader, writer)
    read_env = lmdb.open(f"{tmp}/raw-read", map_size=GIB, sync=False, readahead=False)
    stack.callback(read_env.close)
    copy = _map_copy(batch, read_env)
    for case in cases:
        if case.op in ("read", "get"):
            case.baseline, case.base = "memcpy from the map", copy
        else:
            case.baseline, case.base, case.reset_base = "lmdb txn.put", raw_put, raw_clear
    return cases


def redis_cases(batch: Batch, url: str, stack: contextlib.ExitStack) -> list[Case]:
    def store(role: str) -> RedisStore:
        return RedisStore(url, f"bench-io-{role}", deadline_ms=DEADLINE_MS)

    reader, writer = Paths(batch, store("read")), Paths(batch, store("write"))
    stack.callback(reader.close)
    stack.callback(writer.close)
    client = redis.Redis.from_url(url, socket_timeout=DEADLINE_MS / 1000)
    stack.callback(client.close)
    raw_keys = [b"bench-io-raw:" + key.hex().encode() for key in batch.entry_keys]
    stack.callback(lambda: client.delete(*raw_keys))

    def raw_set() -> None:
        pipe = client.pipeline(transaction=False)
        for key, (_, value) in zip(raw_keys, batch.items, strict=True):
            pipe.set(key, value)
        pipe.execute()

    def raw_mget() -> None:
        if sum(v is not None for v in client.mget(raw_keys)) != len(raw_keys):
            raise RuntimeError("redis: raw MGET missed keys")

    raw_set()
    cases = _path_cases("redis", reader, writer)
    for case in cases:
        if case.op in ("read", "get"):
            case.baseline, case.base = "redis MGET", raw_mget
        else:
            case.baseline, case.base = "redis pipelined SET", raw_set
            case.reset_base = lambda: client.delete(*raw_keys)
    stack.callback(reader.clear)
    stack.callback(writer.clear)
    return cases
