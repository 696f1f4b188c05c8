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
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bench.io.cases import (
    BATCH_BLOCKS,
    TARGET_RATIO,
    Batch,
    Case,
    lmdb_cases,
    memory_cases,
    redis_cases,
)
from bench.launch import RedisServer, find_redis_server

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def steady_malloc() -> bool:
    """glibc only: stop returning freed heap memory to the OS (and fix the mmap threshold), as
    a warmed-up server's allocator would; otherwise every batch refaults its pages, at random
    (it depends on the order of frees), in both the paths and the baselines."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_TRIM_THRESHOLD, 2**30) and libc.mallopt(M_MMAP_THRESHOLD, 2**26))
    except (OSError, AttributeError):
        return False


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


def private_redis(stack: contextlib.ExitStack) -> str:
    """The URL of a redis-server on a free loopback port, without persistence, in a temporary
    directory; `stack` stops it and removes the directory."""
    binary = find_redis_server(": install it or pass --redis-url")
    workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-io-redis-"))
    return stack.enter_context(RedisServer(Path(workdir), binary=binary)).url


def run(redis_url: str | None, rounds: int, chunk_blocks: int = 1, cold: bool = True) -> dict:
    batch = Batch(chunk_blocks)
    with contextlib.ExitStack() as stack:
        url = redis_url or private_redis(stack)
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
