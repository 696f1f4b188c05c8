"""Faults in stored entries: corruption (2), forced key collisions (3), Redis maxmemory
eviction (7) and a full LMDB map or disk (5)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import redis
import xxhash

from bench.faults.common import (
    BS,
    KEY_ID_AT,
    NAMESPACE_AT,
    PROMPT_LEN,
    Context,
    FaultOutcome,
    cache_config,
    flush_redis,
    make_prompts,
    outcome,
    serve,
    tier_config,
)
from engine.loop.engine import Engine
from hashing import KEY_ID_BYTES
from kvstore.entry import CHECKSUM_BYTES, FIXED_HEADER_BYTES, ID_BYTES

# ----------------------------------------------------------------------------- 2. corruption


def corrupt(value: bytes, kind: str, rng: random.Random) -> bytes:
    """One changed copy of an entry. Damage: a flipped payload bit, a cut. Foreign (intact,
    re-checksummed, so only the header checks catch it): another format version, another
    namespace, another secret's key id."""
    data = bytearray(value)
    if kind == "bit flip":
        pos = rng.randrange(FIXED_HEADER_BYTES, len(data) - CHECKSUM_BYTES)
        data[pos] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == "truncation":
        return bytes(data[: rng.randrange(1, len(data))])
    if kind == "header version":
        data[4:6] = (99).to_bytes(2, "little")
    elif kind == "wrong namespace":
        data[NAMESPACE_AT : NAMESPACE_AT + ID_BYTES] = os.urandom(ID_BYTES)
    else:
        data[KEY_ID_AT : KEY_ID_AT + KEY_ID_BYTES] = os.urandom(KEY_ID_BYTES)
    body = bytes(data[:-CHECKSUM_BYTES])
    data[-CHECKSUM_BYTES:] = xxhash.xxh3_64_intdigest(body).to_bytes(CHECKSUM_BYTES, "little")
    return bytes(data)


DAMAGE = ("bit flip", "truncation")
FOREIGN = ("header version", "wrong namespace", "wrong secret")
CORRUPTIONS = DAMAGE + FOREIGN


def corruption(ctx: Context, tier: str) -> FaultOutcome:
    """Change one entry of each prompt in the tier. A fresh engine must detect each (hit =
    the blocks before it) and recompute; damaged entries are deleted (a third engine hits
    in full), foreign ones are kept (still there, still a miss: never deleted)."""
    flush_redis(ctx.redis.url)
    n, rng = 2 * len(CORRUPTIONS) * max(1, ctx.scale.requests // 8), random.Random(2)
    prompts, config = make_prompts(n, seed=20), tier_config(ctx, tier, "corrupt")
    kinds = [CORRUPTIONS[i % len(CORRUPTIONS)] for i in range(n)]
    with Engine(ctx.model, config) as writer:
        serve(writer, prompts)
        writer.cache.flush(30)
        store, hasher = writer.cache.tiers.stores[0], writer.cache.hasher
        keys = [hasher.hash_blocks(p[: PROMPT_LEN - 1]) for p in prompts]
        acked = sum(store.count_prefix(k) for k in keys)
        at = [rng.randrange(len(k)) for k in keys]
        for k, j, kind in zip(keys, at, kinds, strict=True):
            (value,) = store.get_many([k[j]])
            store.delete([k[j]])
            store.put_many([(k[j], corrupt(value, kind, rng))])
    with Engine(ctx.model, config) as reader:
        results = serve(reader, prompts)
        reader.cache.flush(30)
        detected = reader.cache.tiers.stores[0].stats().verify_failures
    short = sum(r is None or r.cached_tokens != j * BS for r, j in zip(results, at, strict=True))
    with Engine(ctx.model, config) as checker:
        again = serve(checker, prompts)
        present = sum(sum(checker.cache.tiers.stores[0].contains_many(k)) for k in keys)
    full = [bool(r and r.cached_tokens == PROMPT_LEN - 1) for r in again]
    cut = [bool(r and r.cached_tokens == j * BS) for r, j in zip(again, at, strict=True)]
    repaired = sum(f for f, kind in zip(full, kinds, strict=True) if kind in DAMAGE)
    kept = sum(c for c, kind in zip(cut, kinds, strict=True) if kind in FOREIGN)
    return outcome(
        ctx,
        name=f"corrupt and foreign entries ({tier})",
        injected=f"1 entry per prompt rewritten in {tier}: " + ", ".join(CORRUPTIONS) + " in turn",
        prompts=prompts + prompts,
        results=results + again,
        lost_entries=acked - present,
        corrupt_injected=n,
        corrupt_detected=detected,
        figures={
            "hits_cut_at_damage": len(prompts) - short,
            "repaired": repaired,
            "foreign_kept": kept,
        },
        note=f"{len(prompts) - short}/{len(prompts)} hits stopped exactly at the changed block; "
        f"a fresh engine then hit {repaired}/{2 * n // 5} damaged prompts in full (deleted, "
        f"rewritten) and {kept}/{3 * n // 5} foreign ones up to the kept foreign entry "
        f"(never deleted)",
    )


# ----------------------------------------------------------------------------- 3. collisions


def collisions(ctx: Context) -> FaultOutcome:
    """key_bytes=1 (256 lookup keys) on a shared Redis: colliding keys must read as misses."""
    flush_redis(ctx.redis.url)
    trials = ctx.scale.collision_trials
    config = cache_config(ctx, redis_url=ctx.redis.url, key_bytes=1, device_blocks=16)
    stored = make_prompts(64, seed=30, length=3 * BS + 1)
    with Engine(ctx.model, config) as writer:
        serve(writer, stored)
        writer.cache.flush(30)
    rng = np.random.default_rng(31)
    fresh = make_prompts(trials, seed=32, length=3 * BS + 1)
    prompts = [stored[rng.integers(64)] if i % 2 else fresh[i] for i in range(trials)]
    with Engine(ctx.model, config) as reader:
        results = serve(reader, prompts)
        rejected = reader.cache.tiers.stores[0].stats().verify_failures
    hits = sum(bool(r and r.cached_tokens) for r in results)
    return outcome(
        ctx,
        name="lookup-key collisions (redis)",
        injected="CacheConfig(key_bytes=1): 256 distinct lookup keys; half the trials new prompts",
        prompts=prompts,
        results=results,
        figures={"collisions_rejected": rejected, "verified_hits": hits},
        note=f"{rejected} colliding entries rejected by the digest; {hits} verified hits",
    )


# ----------------------------------------------------------------------------- 7. maxmemory


def leading_present(client: redis.Redis, prefix: bytes, keys: list[bytes]) -> tuple[int, bool]:
    """(present blocks before the first gap, whether any block after a gap is present)."""
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.exists(prefix + k.hex().encode())
    present = [bool(x) for x in pipe.execute()]
    lead = next((i for i, p in enumerate(present) if not p), len(present))
    return lead, sum(present) > lead


def redis_eviction(ctx: Context) -> FaultOutcome:
    """maxmemory allkeys-lru evicts random blocks: a hit stops at the first gap."""
    flush_redis(ctx.redis.url)
    client = redis.Redis.from_url(ctx.redis.url, socket_timeout=5)
    base = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory", base + 300_000)
    evicted0 = int(client.info("stats")["evicted_keys"])
    config = cache_config(ctx, redis_url=ctx.redis.url)
    prompts = make_prompts(max(40, ctx.scale.requests), seed=70)
    try:
        with Engine(ctx.model, config) as writer:
            serve(writer, prompts)
            writer.cache.flush(30)
            acked = writer.cache.tiers.stores[0].stats().writes
            hasher = writer.cache.hasher
        results, gaps, beyond, hits, short = [], 0, 0, 0, 0
        reader_config = cache_config(ctx, redis_url=ctx.redis.url, redis_write_policy="off")
        with Engine(ctx.model, reader_config) as reader:  # reads only: the snapshot holds
            store = reader.cache.tiers.stores[0]
            for p in reversed(prompts):
                lead, gap = leading_present(client, store.prefix, hasher.hash_blocks(p[:-1]))
                (r,) = serve(reader, [p])
                gaps += gap
                beyond += r is not None and r.cached_tokens > lead * BS
                results.append(r)
                hits += r is not None and r.cached_tokens == lead * BS
                short += r is not None and r.cached_tokens < lead * BS  # evicted meanwhile
            reader.cache.flush(30)
            stats = store.stats()
        evicted = int(client.info("stats")["evicted_keys"]) - evicted0
        lost = max(0, acked + stats.writes - client.dbsize() - evicted - stats.verify_failures)
    finally:
        client.config_set("maxmemory", 0)
        client.close()
    prompts = prompts[::-1]
    return outcome(
        ctx,
        name="redis maxmemory eviction",
        injected="CONFIG SET maxmemory (used + 300 kB), allkeys-lru; prompts of 10 blocks read "
        "newest first",
        prompts=prompts,
        results=results,
        lost_entries=lost,
        wrong_outputs_extra=beyond,
        figures={
            "evicted": evicted,
            "gap_prompts": gaps,
            "hits_at_gap": hits,
            "past_gap": beyond,
            "short_of_gap": short,
        },
        note=f"{evicted} keys evicted; {gaps} prompts had a gap with later blocks present; "
        f"{hits}/{len(prompts)} hits stopped exactly at the first gap, {beyond} went past it",
    )


# ----------------------------------------------------------------------------- 5. full LMDB


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "1m") -> Iterator[bool]:
    """A size-limited tmpfs at `path` (needs root); yields False where it cannot mount."""
    path.mkdir(parents=True, exist_ok=True)
    mount = shutil.which("mount")
    ok = mount is not None and os.geteuid() == 0
    if ok:
        args = [mount, "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
        ok = subprocess.run(args, capture_output=True, timeout=10).returncode == 0
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", str(path)], capture_output=True, timeout=10)


def lmdb_full(ctx: Context, disk: bool) -> FaultOutcome | None:
    """A 256 KiB map (evicts ahead of MapFull), or a 4 MiB map on a 1 MiB tmpfs (ENOSPC)."""
    path = ctx.workdir / ("lmdb-disk" if disk else "lmdb-full")
    with small_tmpfs(path) if disk else contextlib.nullcontext(True) as ready:
        if not ready:
            return None
        map_gb = (4 if disk else 0.25) * 2**20 / 2**30
        config = cache_config(ctx, lmdb_dir=str(path), lmdb_map_size_gb=map_gb, device_blocks=24)
        prompts = make_prompts(max(60, 3 * ctx.scale.requests), seed=50)
        with Engine(ctx.model, config) as engine:
            results = serve(engine, prompts)
            engine.cache.flush(30)
            s = engine.cache.tiers.stores[0].stats()
        with Engine(ctx.model, config) as fresh:  # the newest entries still serve
            again = serve(fresh, prompts[-3:])
    lost = max(0, s.writes - s.entries - s.evictions - s.verify_failures)
    hits = sum(bool(r and r.cached_by_tier.get("lmdb")) for r in again)
    how = "LMDB map 4 MiB on a 1 MiB tmpfs" if disk else "LMDB map 256 KiB (the minimum)"
    return outcome(
        ctx,
        name="disk full (lmdb)" if disk else "lmdb map full",
        injected=how + f", {len(prompts)} prompts",
        prompts=prompts + prompts[-3:],
        results=results + again,
        lost_entries=lost,
        figures={
            "writes": s.writes,
            "evictions": s.evictions,
            "dropped": s.dropped_writes,
            "errors": s.errors,
            "hits_after_reopen": hits,
        },
        note=f"{s.writes} written, {s.evictions} evicted, {s.dropped_writes} dropped, "
        f"{s.errors} errors; {hits}/3 newest prompts hit after reopen",
    )
