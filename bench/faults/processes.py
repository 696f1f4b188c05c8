"""Faults across processes and over time: leaks under eviction (11), four writer
processes (6) and writers SIGKILLed mid-write (4)."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from typing import NamedTuple

import numpy as np
import torch

from bench.faults.common import (
    BS,
    PROMPT_LEN,
    Context,
    FaultOutcome,
    cache_config,
    flush_redis,
    make_prompts,
    outcome,
    serve,
)
from engine.loop.engine import Engine
from kvstore.config import CacheConfig
from kvstore.entry import EntryError, decode_entry

# ----------------------------------------------------------------------------- 11. leaks


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def leaks(ctx: Context) -> FaultOutcome:
    """Many requests with eviction in the device pool and a small memory tier: RSS and pool
    use over the last 90% of the run (every 20th output is checked)."""
    n = ctx.scale.leak_requests
    config = cache_config(ctx, device_blocks=48, memory_cache_gb=0.0005)  # ~ 400 entries
    bases = make_prompts(64, seed=110, length=6 * BS)
    rng = np.random.default_rng(111)
    prompts = [bases[rng.integers(64)] + rng.integers(0, 256, 17).tolist() for _ in range(n)]
    results, marks = [], {}
    with Engine(ctx.model, config) as engine:
        for i, prompt in enumerate(prompts):
            results += serve(engine, [prompt])
            if i + 1 in (max(1, n // 10), n):
                d = engine.stats()["device"]
                marks[i + 1] = (rss_bytes(), d["blocks_total"] - d["blocks_free"])
        evicted = engine.cache.metrics.get("evicted_blocks_total")
    (r0, u0), (r1, u1) = marks[max(1, n // 10)], marks[n]
    checked = list(range(0, n, 20))
    out = outcome(
        ctx,
        name="leaks under eviction",
        injected=f"{n} requests, device pool 48 blocks, 0.5 MB memory tier",
        prompts=[prompts[i] for i in checked],
        results=[results[i] for i in checked],
        figures={
            "rss_growth_pct": 100 * (r1 - r0) / r0,
            "pool_used_start": u0,
            "pool_used_end": u1,
            "evicted": evicted,
        },
        note=f"RSS {r0 / 2**20:.1f} -> {r1 / 2**20:.1f} MiB ({100 * (r1 - r0) / r0:+.1f}%); "
        f"pool blocks used {u0} -> {u1}; {evicted} blocks evicted",
    )
    out.requests, out.succeeded = n, sum(r is not None for r in results)
    return out


# ----------------------------------------------------------------------------- 6. 4 writers

FORK = multiprocessing.get_context("fork")  # children inherit the model: no reload


def both_tiers(ctx: Context, tag: str) -> CacheConfig:
    return cache_config(ctx, lmdb_dir=str(ctx.workdir / f"lmdb-{tag}"), redis_url=ctx.redis.url)


def _writer(
    ctx: Context, config: CacheConfig, index: int, prompts: list, barrier: object, out: object
) -> None:
    """Child process: serve `prompts` (after every writer is ready), report the outputs."""
    with Engine(ctx.model, config, cache_generated=False) as engine:
        barrier.wait(30)  # type: ignore[attr-defined]
        results = serve(engine, prompts)
        engine.cache.flush(30)
        writes = {s.name: s.stats().writes for s in engine.cache.tiers.stores}
    outputs = [r.output_token_ids if r else None for r in results]
    out.put((index, outputs, writes))  # type: ignore[attr-defined]


def concurrent_writers(ctx: Context, n: int = 4) -> FaultOutcome:
    """4 processes store overlapping prefixes into one LMDB dir and one Redis at once: each
    entry is written exactly once, all of them verify, and every prompt then hits in full."""
    flush_redis(ctx.redis.url)
    config, per = both_tiers(ctx, "writers"), max(4, ctx.scale.requests // 2)
    bases = make_prompts(4, seed=60, length=6 * BS)
    tails = make_prompts(n * per, seed=61, length=4 * BS + 1)
    lists = [[bases[j % 4] + tails[i * per + j] for j in range(per)] for i in range(n)]
    barrier, queue = FORK.Barrier(n), FORK.Queue()
    procs = [
        FORK.Process(target=_writer, args=(ctx, config, i, p, barrier, queue))
        for i, p in enumerate(lists)
    ]
    for p in procs:
        p.start()
    reports = sorted(queue.get(timeout=120) for _ in procs)  # by process index
    for p in procs:
        p.join(30)
    prompts = [p for ps in lists for p in ps]
    results = [_Out(o) if o else None for r in reports for o in r[1]]
    with Engine(ctx.model, config) as fresh:
        hasher = fresh.cache.hasher
        distinct = len({k for p in prompts for k in hasher.hash_blocks(p[:-1])})
        stores = fresh.cache.tiers.stores
        lmdb_entries, redis_entries = stores[0].stats().entries, stores[1].count_entries()
        again = serve(fresh, prompts)
        failures = sum(s.stats().verify_failures for s in stores)
    written = {t: sum(r[2][t] for r in reports) for t in ("lmdb", "redis")}
    full = sum(bool(r and r.cached_tokens == PROMPT_LEN - 1) for r in again)
    return outcome(
        ctx,
        name="4 writer processes",
        injected=f"{n} forked processes, {per} prompts each, 4 shared 6-block prefixes, one "
        "LMDB dir and one Redis, released by one barrier",
        prompts=prompts + prompts,
        results=results + again,
        corrupt_detected=failures,
        lost_entries=2 * distinct - lmdb_entries - (redis_entries or 0),
        figures={
            "distinct_blocks": distinct,
            "lmdb_writes": written["lmdb"],
            "redis_writes": written["redis"],
            "lmdb_entries": lmdb_entries,
            "redis_entries": redis_entries,
            "full_hits": full,
        },
        note=f"{distinct} distinct blocks; writes summed over processes: lmdb "
        f"{written['lmdb']}, redis {written['redis']}; {full}/{len(prompts)} full hits after",
    )


class _Out(NamedTuple):
    """A child's result, enough for the reference check."""

    output_token_ids: list[int]


# ----------------------------------------------------------------------------- 4. SIGKILL


def _endless_writer(ctx: Context, config: CacheConfig, prompts: list) -> None:
    with Engine(ctx.model, config, cache_generated=False) as engine:
        while True:
            serve(engine, prompts)


def killed_writers(ctx: Context, rounds: int) -> FaultOutcome:
    """A writer process SIGKILLed at a random moment, `rounds` times: the stores reopen and
    every entry it committed verifies (lookup key, digest, tokens, checksum)."""
    flush_redis(ctx.redis.url)
    config, rng = both_tiers(ctx, "killed"), random.Random(40)
    sent, results, checked, torn = [], [], 0, 0
    for i in range(rounds):
        prompts = make_prompts(30, seed=400 + i)
        proc = FORK.Process(target=_endless_writer, args=(ctx, config, prompts), daemon=True)
        proc.start()
        time.sleep(rng.uniform(0.3, 0.8))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        with Engine(ctx.model, config, cache_generated=False) as fresh:
            n, bad = verify_committed(fresh, prompts)
            checked, torn = checked + n, torn + bad
            sent, results = sent + prompts[:5], results + serve(fresh, prompts[:5])
    return outcome(
        ctx,
        name="writer SIGKILLed mid-write",
        injected=f"SIGKILL a writer process after 0.3-0.8 s, {rounds} times, writing to one "
        "LMDB dir and one Redis",
        prompts=sent,
        results=results,
        corrupt_detected=torn,
        figures={"committed_checked": checked},
        note=f"{checked} committed entries decoded and verified, {torn} torn",
    )


def verify_committed(engine: Engine, prompts: list[list[int]]) -> tuple[int, int]:
    """(entries present in the engine's tiers for these prompts, how many fail to decode)."""
    hasher = engine.cache.hasher
    checked = bad = 0
    for p in prompts:
        tokens = np.asarray(p[:-1], dtype=np.uint32)
        keys, digests = hasher.hash_blocks(tokens), hasher.digest_blocks(tokens)
        for store in engine.cache.tiers.stores:
            for j, value in enumerate(store.get_many(keys)):
                if value is None:
                    continue
                checked += 1
                try:
                    decode_entry(
                        value,
                        namespace=hasher.namespace.root(),
                        key=keys[j],
                        digest=digests[j],
                        dtype=torch.float32,
                        token_ids=tokens[j * BS : (j + 1) * BS],
                    )
                except EntryError:
                    bad += 1
    return checked, bad
