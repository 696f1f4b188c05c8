"""Tier bandwidth (GB/s) per tier and operation, as a ratio to a baseline moving the same bytes.

A batch is a 1792-token prefix of the pinned `tiny` model: 112 blocks of [8 layers, K/V,
2 kv heads, 16 tokens, 64 head dim] fp32 (128 KiB each). Operations, through the real paths:
- read:  what a lookup does for the blocks the device missed: `Tiers.fetch_into` (the store's
         read_prefix, every entry copied into its pool block and verified there);
- get:   the store's read_prefix alone (zero-copy views for LMDB, bytes for the others);
- write: what the background writer does with a queued write: `TierWriter.write` (encode
         every entry, put_many);
- put:   the store's put_many of already encoded entries.
Baselines, moving the same bytes: reads against a plain copy (memcpy) of the KV bytes from
where the tier keeps them into a preallocated buffer (like the pool): for memory from heap
buffers, for LMDB out of a raw LMDB map in one read transaction; memory writes against a
copy into new bytes objects (what a store that keeps its values must allocate); LMDB writes
against raw `txn.put` of the same values in one transaction of another environment; Redis
reads against a raw redis-py MGET, Redis writes against a raw pipelined SET. An operation and
its baseline run back to back, every case once per round, rounds interleaved; GB/s are
medians over rounds and `ratio` is the median of the per-round ratios (load from other
processes on the machine cancels).

Reads are measured from DRAM: before every read and its baseline alike the CPU caches are
flushed (untimed), since a spilled block is read back long after it was written;
--warm-reads skips that (the 14.7 MB batch then fits many last-level caches, which makes the
plain-copy baselines look faster than any tier read can be). By default torch runs one
thread (the baselines copy on one) and glibc's malloc is told to keep freed memory
(`steady_malloc`): otherwise each batch refaults its pages at random, depending on the order
of frees, in paths and baselines alike. --default-malloc keeps glibc's defaults. Without
--redis-url a private redis-server (no persistence) is started on a free loopback port and
stopped at the end.

    python -m bench io [--json] [--redis-url URL] [--rounds N] [--chunk-blocks N]
                       [--threads N] [--default-malloc] [--warm-reads]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import lmdb
import numpy as np
import redis
import torch
from tqdm import tqdm

from hashing import BlockHasher, Namespace
from kvstore.codec import CHECKSUM_BYTES, BlockEntry, encode_entry
from kvstore.config import CacheConfig
from kvstore.metrics import CacheMetrics
from kvstore.pool import BlockPool
from kvstore.stores import LmdbStore, MemoryStore, RedisStore, SpillStore
from kvstore.tiers import Tiers
from kvstore.writer import PendingWrite, Scope

LAYERS, KV_HEADS, BLOCK_SIZE, HEAD_DIM = 8, 2, 16, 64  # the pinned tiny model
BATCH_BLOCKS = 112  # a 1792-token prefix
TARGET_RATIO = 0.5
DEADLINE_MS = 10_000.0  # generous: a slow round must not turn into a miss
GIB = 2**30
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


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
        self.tiers = Tiers(config, batch.hasher, self.metrics, [store])
        self.pool = BlockPool(BATCH_BLOCKS, namespace(), torch.device("cpu"))
        self.block_ids = list(range(BATCH_BLOCKS))

    def read(self) -> None:
        """PrefixCache.lookup for a device miss: fetch + verify, promote into the pool."""
        scope = self.tiers.scope(self.batch.hasher)
        segments = self.tiers.fetch_into(
            scope,
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
        self.tiers.writer.write(self.batch.pending(self.tiers.scope(self.batch.hasher)))
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


def steady_malloc() -> bool:
    """glibc only: stop returning freed heap memory to the OS (and fix the mmap threshold), as
    a warmed-up server's allocator would; otherwise every batch refaults its pages, at random
    (it depends on the order of frees), in both the paths and the baselines."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_TRIM_THRESHOLD, 2**30) and libc.mallopt(M_MMAP_THRESHOLD, 2**26))
    except (OSError, AttributeError):
        return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A redis-server on a free loopback port, without persistence, stopped on exit."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed: install it or pass --redis-url")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="bench-io-redis-") as workdir:
        args = [binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", workdir]
        args += ["--save", "", "--appendonly", "no"]  # no persistence
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"redis://127.0.0.1:{port}/0"
            _wait_ready(url, proc)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and proc.poll() is None:
        with (
            contextlib.suppress(redis.ConnectionError, redis.TimeoutError, OSError),
            redis.Redis.from_url(url, socket_connect_timeout=0.5) as client,
        ):
            if client.ping():
                return
        time.sleep(0.05)
    raise RuntimeError(f"redis-server at {url} did not start")


def last_level_cache_bytes(default: int = 32 * 2**20) -> int:
    """The largest CPU cache of cpu0 (sysfs), or `default` where it cannot be read."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with contextlib.suppress(OSError, ValueError), open(path) as f:
            text = f.read().strip().upper()
            sizes.append(int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}[text[-1]])
    return max(sizes, default=default)


def cache_evicter(nbytes: int) -> Callable[[], None]:
    """A call that writes `nbytes` of unrelated memory, pushing a batch out of the CPU caches
    (untimed, before each read and its baseline alike): a tier's blocks were spilled long
    before they are read back, so they come from DRAM, not from the last-level cache."""
    junk = np.zeros(nbytes // 8)

    def evict() -> None:
        junk.__iadd__(1.0)

    return evict


def measure(cases: list[Case], rounds: int, warmup: int = 1) -> None:
    """Interleaved rounds: every case (and its baseline, order alternating) once per round."""
    with tqdm(total=(rounds + warmup) * len(cases), desc="io", unit="case") as bar:
        for r in range(rounds + warmup):
            for case in cases:
                bar.set_postfix_str(f"{case.tier} {case.op}")
                case.measure(base_first=bool(r % 2))
                bar.update()
            if r < warmup:
                for case in cases:
                    case.times.clear()
                    case.base_times.clear()


def run(redis_url: str | None, rounds: int, chunk_blocks: int = 1, cold: bool = True) -> dict:
    batch = Batch(chunk_blocks)
    with contextlib.ExitStack() as stack:
        url = redis_url or stack.enter_context(private_redis())
        cases = memory_cases(batch, stack) + lmdb_cases(batch, stack)
        cases += redis_cases(batch, url, stack)
        if cold:
            evict = cache_evicter(2 * last_level_cache_bytes())
            for case in (c for c in cases if c.op in ("read", "get")):
                case.reset = case.reset_base = evict
        measure(cases, rounds)
    return {
        "block_bytes": batch.block_bytes,
        "batch_blocks": BATCH_BLOCKS,
        "chunk_blocks": chunk_blocks,
        "torch_threads": torch.get_num_threads(),
        "rounds": rounds,
        "cold_reads": cold,
        "target_ratio": TARGET_RATIO,
        "results": [case.result(batch.nbytes) for case in cases],
    }


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (
        f"tier bandwidth: {report['batch_blocks']} blocks of {report['block_bytes'] // 1024} KiB "
        f"per call, {report['chunk_blocks']} per entry, {report['torch_threads']} torch "
        f"thread(s), median of {report['rounds']} rounds"
        + (", steady malloc" if report["steady_malloc"] else "")
        + (", reads from DRAM (caches flushed)" if report["cold_reads"] else ", warm reads")
    )
    table = Table(title=title)
    for col in ("tier", "op", "GB/s", "baseline", "baseline GB/s", "ratio"):
        table.add_column(col, justify="left" if col in ("tier", "op", "baseline") else "right")
    for r in report["results"]:
        style = "green" if r["ratio"] >= report["target_ratio"] else "red"
        table.add_row(
            r["tier"],
            r["op"],
            f"{r['gbps']:.2f}",
            r["baseline"],
            f"{r['baseline_gbps']:.2f}",
            f"[{style}]{r['ratio']:.2f}[/{style}]",
        )
    console = Console()
    console.print(table)
    console.print(f"target: ratio >= {report['target_ratio']} for every row")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench io", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--redis-url", default=None, help="default: a private redis-server")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (median)")
    parser.add_argument("--chunk-blocks", type=int, default=1, help="blocks per tier entry")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (the baselines copy on one)"
    )
    parser.add_argument(
        "--default-malloc", action="store_true", help="keep glibc's trimming (see steady_malloc)"
    )
    parser.add_argument(
        "--warm-reads", action="store_true", help="do not flush the CPU caches before reads"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.chunk_blocks < 1 or BATCH_BLOCKS % args.chunk_blocks:
        parser.error(f"--chunk-blocks must divide {BATCH_BLOCKS}")
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    steady = not args.default_malloc and steady_malloc()
    report = {
        **run(args.redis_url, args.rounds, args.chunk_blocks, cold=not args.warm_reads),
        "steady_malloc": steady,
    }
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(report)
    return 0
