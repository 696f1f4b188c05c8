"""Fault injection: corrupt tier entries, forced key collisions, Redis eviction and outages,
a full LMDB, tenant salts and leaks, each counted against an independent no-cache reference.

`python -m bench faults [--json] [--scale ci|full] [--out docs/RELIABILITY.md]`. Every
scenario runs requests through a real `Engine` on a micro Llama (2 layers, hidden 64), with
real LMDB directories and a private redis-server, and returns one `FaultOutcome` per fault.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import redis
import torch
import xxhash
from transformers import LlamaConfig

from bench.io import _free_port, _wait_ready
from engine.engine import Engine, GenerateResult, SamplingParams
from engine.model import BYTE_VOCAB_SIZE, LoadedModel, byte_tokenizer, random_model, wrap_model
from kvstore.codec import CHECKSUM_BYTES, FIXED_HEADER_BYTES, ID_BYTES, EntryError, decode_entry
from kvstore.config import CacheConfig

BS = 4
TOL = 1e-4  # fp32 contract: logits within 1e-4 absolute
PARAMS = SamplingParams(max_new_tokens=4)
PROMPT_LEN = 10 * BS + 1  # 10 whole blocks can hit, the last token is always computed
NAMESPACE_AT = FIXED_HEADER_BYTES - 4 * ID_BYTES  # namespace, key, digest, parent end the header


@dataclass(frozen=True)
class Scale:
    requests: int  # per load scenario
    collision_trials: int
    leak_requests: int
    outage_s: float  # length of each Redis pause / downtime
    kill_rounds: int = 5  # writer processes SIGKILLed


SCALES = {
    "ci": Scale(requests=24, collision_trials=300, leak_requests=300, outage_s=0.6),
    "full": Scale(
        requests=120, collision_trials=10_000, leak_requests=10_000, outage_s=2.0, kill_rounds=100
    ),
}


@dataclass
class FaultOutcome:
    name: str
    injected: str  # how the fault was injected
    requests: int
    succeeded: int
    wrong_outputs: int  # vs the no-cache reference, beyond the contract's tolerance
    lost_entries: int  # acknowledged writes missing with no eviction/verification to explain
    corrupt_injected: int
    corrupt_detected: int
    recovery_s: float | None = None
    note: str = ""
    figures: dict[str, float] = field(default_factory=dict)  # scenario-specific counts


class RedisControl(Protocol):
    """A private redis-server the scenarios may kill, pause and restart."""

    url: str

    def kill(self) -> None: ...
    def restart(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...


class Context(NamedTuple):
    model: LoadedModel
    redis: RedisControl
    workdir: Path
    scale: Scale


# ----------------------------------------------------------------------------- the model


def micro_model(seed: int = 1) -> LoadedModel:
    config = LlamaConfig(
        vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=256, eos_token_id=257, pad_token_id=258,
    )  # fmt: skip
    return wrap_model(random_model(config, seed), byte_tokenizer(), f"micro-{seed}")


def matches_reference(model: LoadedModel, prompt: list[int], output: list[int]) -> bool:
    """Greedy output equals a full no-cache forward's argmax wherever its top-2 gap > TOL."""
    with torch.inference_mode():
        ids = torch.tensor([prompt + output[:-1]], device=model.device)
        ref = model.model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 :].float()
    top2 = torch.topk(ref, 2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > TOL
    return bool(((ref.argmax(-1).cpu() == torch.tensor(output)) | ~decisive.cpu()).all())


def cache_config(**overrides: object) -> CacheConfig:
    values = {"block_size": BS, "device": "cpu", "device_blocks": 256, **overrides}
    values.setdefault("lookup_deadline_ms", 100.0)
    return CacheConfig(**values)


def make_prompts(n: int, seed: int, length: int = PROMPT_LEN) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length).tolist() for _ in range(n)]


def serve(engine: Engine, prompts: list[list[int]], salt: str = "") -> list[GenerateResult | None]:
    """One request per prompt; a failed request is None (counted, never raised)."""
    results: list[GenerateResult | None] = []
    for prompt in prompts:
        try:
            results.append(engine.generate([prompt], PARAMS, cache_salt=salt)[0])
        except Exception:
            results.append(None)
    return results


def count_wrong(model: LoadedModel, prompts: list[list[int]], results: list) -> int:
    return sum(
        r is not None and not matches_reference(model, p, r.output_token_ids)
        for p, r in zip(prompts, results, strict=True)
    )


def outcome(
    ctx: Context, name: str, injected: str, prompts: list, results: list, **kw: object
) -> FaultOutcome:
    values = {"lost_entries": 0, "corrupt_injected": 0, "corrupt_detected": 0, **kw}
    ok = sum(r is not None for r in results)
    wrong = count_wrong(ctx.model, prompts, results) + int(values.pop("wrong_outputs_extra", 0))
    return FaultOutcome(name, injected, len(prompts), ok, wrong, **values)  # type: ignore[arg-type]


def flush_redis(url: str) -> None:
    with redis.Redis.from_url(url, socket_timeout=5) as client:
        client.flushall()


def tier_config(ctx: Context, tier: str, tag: str, **kw: object) -> CacheConfig:
    if tier == "lmdb":
        return cache_config(lmdb_dir=str(ctx.workdir / f"lmdb-{tag}"), **kw)
    return cache_config(redis_url=ctx.redis.url, **kw)


# ----------------------------------------------------------------------------- 2. corruption


def corrupt(value: bytes, kind: str, rng: random.Random) -> bytes:
    """One damaged copy of an entry: a flipped payload bit, a cut, another version or
    another namespace (re-checksummed, so only the namespace check can catch it)."""
    data = bytearray(value)
    if kind == "bit flip":
        pos = rng.randrange(FIXED_HEADER_BYTES, len(data) - CHECKSUM_BYTES)
        data[pos] ^= 1 << rng.randrange(8)
    elif kind == "truncation":
        del data[rng.randrange(1, len(data)) :]
    elif kind == "header version":
        data[4:6] = (99).to_bytes(2, "little")
    else:
        data[NAMESPACE_AT : NAMESPACE_AT + ID_BYTES] = os.urandom(ID_BYTES)
        body = bytes(data[:-CHECKSUM_BYTES])
        data[-CHECKSUM_BYTES:] = xxhash.xxh3_64_intdigest(body).to_bytes(CHECKSUM_BYTES, "little")
    return bytes(data)


CORRUPTIONS = ("bit flip", "truncation", "header version", "wrong namespace")


def corruption(ctx: Context, tier: str) -> FaultOutcome:
    """Corrupt one entry of each prompt in the tier; a fresh engine must detect, delete and
    recompute it (hit = the blocks before it), and a third engine must find it repaired."""
    flush_redis(ctx.redis.url)
    n, rng = 2 * len(CORRUPTIONS) * max(1, ctx.scale.requests // 8), random.Random(2)
    prompts, config = make_prompts(n, seed=20), tier_config(ctx, tier, "corrupt")
    with Engine(ctx.model, config) as writer:
        serve(writer, prompts)
        writer.cache.flush(30)
        store, hasher = writer.cache.tiers.stores[0], writer.cache.hasher
        keys = [hasher.hash_blocks(p[: PROMPT_LEN - 1]) for p in prompts]
        acked = sum(store.count_prefix(k) for k in keys)
        at = [rng.randrange(len(k)) for k in keys]
        for i, (k, j) in enumerate(zip(keys, at, strict=True)):
            (value,) = store.get_many([k[j]])
            store.delete([k[j]])
            store.put_many([(k[j], corrupt(value, CORRUPTIONS[i % len(CORRUPTIONS)], rng))])
    with Engine(ctx.model, config) as reader:
        results = serve(reader, prompts)
        reader.cache.flush(30)
        detected = reader.cache.tiers.stores[0].stats().verify_failures
    short = sum(r is None or r.cached_tokens != j * BS for r, j in zip(results, at, strict=True))
    with Engine(ctx.model, config) as checker:
        again = serve(checker, prompts)
    lost = acked - sum((r.cached_tokens if r else 0) // BS for r in again)
    repaired = sum(bool(r and r.cached_tokens == PROMPT_LEN - 1) for r in again)
    return outcome(
        ctx, f"corrupt entries ({tier})",
        f"1 entry per prompt rewritten in {tier}: " + ", ".join(CORRUPTIONS) + " in turn",
        prompts + prompts, results + again, lost_entries=lost, corrupt_injected=n,
        corrupt_detected=detected,
        figures={"hits_cut_at_damage": len(prompts) - short, "repaired": repaired},
        note=f"{len(prompts) - short}/{len(prompts)} hits stopped exactly at the damaged block; "
        f"a fresh engine then hit {repaired}/{len(prompts)} prompts in full (repaired)",
    )  # fmt: skip


# ----------------------------------------------------------------------------- 3. collisions


def collisions(ctx: Context) -> FaultOutcome:
    """key_bytes=1 (256 lookup keys) on a shared Redis: colliding keys must read as misses."""
    flush_redis(ctx.redis.url)
    trials = ctx.scale.collision_trials
    config = cache_config(redis_url=ctx.redis.url, key_bytes=1, device_blocks=16)
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
        ctx, "lookup-key collisions (redis)",
        "CacheConfig(key_bytes=1): 256 distinct lookup keys; half the trials new prompts",
        prompts, results,
        figures={"collisions_rejected": rejected, "verified_hits": hits},
        note=f"{rejected} colliding entries rejected by the digest; {hits} verified hits",
    )  # fmt: skip


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
    config = cache_config(redis_url=ctx.redis.url)
    prompts = make_prompts(max(40, ctx.scale.requests), seed=70)
    try:
        with Engine(ctx.model, config) as writer:
            serve(writer, prompts)
            writer.cache.flush(30)
            acked = writer.cache.tiers.stores[0].stats().writes
            hasher = writer.cache.hasher
        results, gaps, beyond, hits, short = [], 0, 0, 0, 0
        reader_config = cache_config(redis_url=ctx.redis.url, redis_write_policy="off")
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
        ctx, "redis maxmemory eviction",
        "CONFIG SET maxmemory (used + 300 kB), allkeys-lru; prompts of 10 blocks read newest first",
        prompts, results, lost_entries=lost, wrong_outputs_extra=beyond,
        figures={"evicted": evicted, "gap_prompts": gaps, "hits_at_gap": hits,
                 "past_gap": beyond, "short_of_gap": short},
        note=f"{evicted} keys evicted; {gaps} prompts had a gap with later blocks present; "
        f"{hits}/{len(prompts)} hits stopped exactly at the first gap, {beyond} went past it",
    )  # fmt: skip


# ----------------------------------------------------------------------------- 1. outages


class Timed(NamedTuple):
    done_at: float  # perf_counter when the request finished
    prompt: list[int]
    result: GenerateResult | None


def load_threads(
    engine: Engine,
    prompts: list[list[int]],
    stop: threading.Event,
    out: list[Timed],
    errors: list[str],
    n: int = 4,
) -> list[threading.Thread]:
    """`n` client threads submitting random prompts to one engine until `stop`."""

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            prompt = rng.choice(prompts)
            try:
                result = engine.submit(prompt, PARAMS).result()
            except Exception as e:
                result = None
                errors.append(f"{type(e).__name__}: {e}")
            out.append(Timed(time.perf_counter(), prompt, result))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def redis_outage(ctx: Context) -> FaultOutcome:
    """Redis SIGSTOPped, resumed, SIGKILLed and restarted empty under 4 client threads."""
    flush_redis(ctx.redis.url)
    deadline_ms, down = 50.0, ctx.scale.outage_s
    config = cache_config(
        redis_url=ctx.redis.url, device_blocks=24, lookup_deadline_ms=deadline_ms,
        breaker_failures=2, breaker_cooldown_s=0.3,
    )  # fmt: skip
    prompts = make_prompts(20, seed=10)
    with Engine(ctx.model, config) as writer:
        serve(writer, prompts)
        writer.cache.flush(30)
    done: list[Timed] = []
    errors: list[str] = []
    stop, marks = threading.Event(), {}
    with Engine(ctx.model, config) as engine:
        threads = load_threads(engine, prompts, stop, done, errors)
        for name, action in (("pause", ctx.redis.pause), ("resume", ctx.redis.resume),
                             ("kill", ctx.redis.kill), ("restart", ctx.redis.restart)):  # fmt: skip
            time.sleep(down)
            marks[name] = time.perf_counter()
            action()
        recovered = wait_for(lambda: any(redis_hit(t, marks["restart"]) for t in done), 20)
        time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join()
    healthy = [t.result.ttft_s for t in done if t.result and t.done_at < marks["pause"]]
    base = float(np.median(healthy)) if healthy else 0.0
    faulted = [t for t in done if t.result and marks["pause"] <= t.done_at < marks["restart"]]
    added = [1e3 * (t.result.ttft_s - base) for t in faulted]
    p99 = float(np.percentile(added, 99)) if added else 0.0
    first = min((t.done_at for t in done if redis_hit(t, marks["restart"])), default=None)
    return outcome(
        ctx, "redis paused / killed under load",
        f"4 client threads; SIGSTOP {down:g} s, SIGCONT, SIGKILL, {down:g} s down, restart empty",
        [t.prompt for t in done], [t.result for t in done],
        recovery_s=None if first is None or not recovered else first - marks["restart"],
        figures={"p99_added_ttft_ms": p99, "deadline_ms": deadline_ms, "faulted": len(added)},
        note=("errors: " + "; ".join(sorted(set(errors))) + "; " if errors else "")
        + f"p99 added TTFT during faults {p99:.1f} ms ({len(added)} requests; lookup "
        f"deadline {deadline_ms:g} ms); recovery = restart to first Redis hit",
    )  # fmt: skip


def redis_hit(t: Timed, since: float) -> bool:
    return t.done_at > since and t.result is not None and "redis" in t.result.cached_by_tier


def wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# ----------------------------------------------------------------------------- 9. tenants


def tenant_isolation(ctx: Context) -> FaultOutcome:
    """The same prompts under another cache salt: 0 cached tokens in the device pool, LMDB
    and Redis, while the owner still hits its own entries in each."""
    flush_redis(ctx.redis.url)
    prompts = make_prompts(max(4, ctx.scale.requests // 4), seed=90)
    both = {"lmdb_dir": str(ctx.workdir / "lmdb-tenant"), "redis_url": ctx.redis.url}
    sent, results, cross, own = [], [], 0, 0
    with Engine(ctx.model, cache_config(**both)) as engine:
        for salt in ("owner", "other-device"):
            results += serve(engine, prompts, salt)
        engine.cache.flush(30)
    cross += sum(r.cached_tokens for r in results[len(prompts) :] if r)
    sent += prompts + prompts
    for tier, salt in (("lmdb", "other-lmdb"), ("redis", "other-redis")):
        with Engine(ctx.model, cache_config(**{k: v for k, v in both.items() if tier in k})) as e:
            other, mine = serve(e, prompts, salt), serve(e, prompts, "owner")
        cross += sum(r.cached_tokens for r in other if r)
        own += sum(bool(r and r.cached_by_tier.get(tier) == PROMPT_LEN - 1) for r in mine)
        sent, results = sent + prompts + prompts, results + other + mine
    return outcome(
        ctx, "tenant isolation (cache_salt)",
        "same prompts under 3 other salts, one per tier (device, lmdb, redis)",
        sent, results, wrong_outputs_extra=cross,
        figures={"cross_tenant_tokens": cross, "owner_full_hits": own},
        note=f"{cross} cross-tenant cached tokens; owner full hits {own}/{2 * len(prompts)} "
        "from lmdb and redis",
    )  # fmt: skip


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
        config = cache_config(lmdb_dir=str(path), lmdb_map_size_gb=map_gb, device_blocks=24)
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
        ctx, "disk full (lmdb)" if disk else "lmdb map full", how + f", {len(prompts)} prompts",
        prompts + prompts[-3:], results + again, lost_entries=lost,
        figures={"writes": s.writes, "evictions": s.evictions, "dropped": s.dropped_writes,
                 "errors": s.errors, "hits_after_reopen": hits},
        note=f"{s.writes} written, {s.evictions} evicted, {s.dropped_writes} dropped, "
        f"{s.errors} errors; {hits}/3 newest prompts hit after reopen",
    )  # fmt: skip


# ----------------------------------------------------------------------------- 11. leaks


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def leaks(ctx: Context) -> FaultOutcome:
    """Many requests with eviction in the device pool and a small memory tier: RSS and pool
    use over the last 90% of the run (every 20th output is checked)."""
    n = ctx.scale.leak_requests
    config = cache_config(device_blocks=48, memory_cache_gb=0.0005)  # ~ 400 entries
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
        ctx, "leaks under eviction", f"{n} requests, device pool 48 blocks, 0.5 MB memory tier",
        [prompts[i] for i in checked], [results[i] for i in checked],
        figures={"rss_growth_pct": 100 * (r1 - r0) / r0, "pool_used_start": u0,
                 "pool_used_end": u1, "evicted": evicted},
        note=f"RSS {r0 / 2**20:.1f} -> {r1 / 2**20:.1f} MiB ({100 * (r1 - r0) / r0:+.1f}%); "
        f"pool blocks used {u0} -> {u1}; {evicted} blocks evicted",
    )  # fmt: skip
    out.requests, out.succeeded = n, sum(r is not None for r in results)
    return out


# ----------------------------------------------------------------------------- 6. 4 writers

FORK = multiprocessing.get_context("fork")  # children inherit the model: no reload


def both_tiers(ctx: Context, tag: str) -> CacheConfig:
    return cache_config(lmdb_dir=str(ctx.workdir / f"lmdb-{tag}"), redis_url=ctx.redis.url)


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
        ctx, "4 writer processes", f"{n} forked processes, {per} prompts each, 4 shared "
        "6-block prefixes, one LMDB dir and one Redis, released by one barrier",
        prompts + prompts, results + again, corrupt_detected=failures,
        lost_entries=2 * distinct - lmdb_entries - (redis_entries or 0),
        figures={"distinct_blocks": distinct, "lmdb_writes": written["lmdb"],
                 "redis_writes": written["redis"], "lmdb_entries": lmdb_entries,
                 "redis_entries": redis_entries,
                 "full_hits": full},
        note=f"{distinct} distinct blocks; writes summed over processes: lmdb "
        f"{written['lmdb']}, redis {written['redis']}; {full}/{len(prompts)} full hits after",
    )  # fmt: skip


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
        ctx, "writer SIGKILLed mid-write", f"SIGKILL a writer process after 0.3-0.8 s, "
        f"{rounds} times, writing to one LMDB dir and one Redis",
        sent, results, corrupt_detected=torn, figures={"committed_checked": checked},
        note=f"{checked} committed entries decoded and verified, {torn} torn",
    )  # fmt: skip


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
                    decode_entry(value, namespace=hasher.namespace.root(), key=keys[j],
                                 digest=digests[j], dtype=torch.float32,
                                 token_ids=tokens[j * BS : (j + 1) * BS])  # fmt: skip
                except EntryError:
                    bad += 1
    return checked, bad


# ----------------------------------------------------------------------------- the bench


class RedisProcess:
    """A private redis-server on a free loopback port, no persistence."""

    def __init__(self, workdir: Path):
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed")
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._args = [binary, "--bind", "127.0.0.1", "--port", str(self.port),
                      "--dir", str(workdir), "--save", "", "--appendonly", "no"]  # fmt: skip
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self._args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        _wait_ready(self.url, self.proc)

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        self.resume()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        self.kill()
        self.start()


SCENARIOS: dict[str, Callable[[Context], FaultOutcome | None]] = {
    "corrupt-lmdb": lambda ctx: corruption(ctx, "lmdb"),
    "corrupt-redis": lambda ctx: corruption(ctx, "redis"),
    "collisions": collisions,
    "redis-eviction": redis_eviction,
    "redis-outage": redis_outage,
    "writers": concurrent_writers,
    "sigkill": lambda ctx: killed_writers(ctx, ctx.scale.kill_rounds),
    "lmdb-full": lambda ctx: lmdb_full(ctx, disk=False),
    "disk-full": lambda ctx: lmdb_full(ctx, disk=True),
    "tenants": tenant_isolation,
    "leaks": leaks,
}


def run(scale: str, names: list[str] | None = None) -> list[FaultOutcome]:
    """Run the scenarios (all by default) with a private redis-server and temp dirs."""
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a micro model: thread hand-offs cost more than they give
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        server = RedisProcess(Path(tmp))
        server.start()
        ctx = Context(micro_model(), server, Path(tmp), SCALES[scale])
        try:
            found = [SCENARIOS[name](ctx) for name in names or SCENARIOS]
        finally:
            server.kill()
    return [o for o in found if o is not None]


def _cell(value: object) -> str:
    return "n/a" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def markdown(outcomes: list[FaultOutcome], scale: str, elapsed_s: float) -> str:
    lines = [
        "# Reliability: fault injection",
        "",
        f"Generated by `python -m bench faults --scale {scale}` ({elapsed_s:.0f} s). Every request",
        "runs through the engine on a micro Llama (2 layers, hidden 64, fp32) with real LMDB and",
        "a private redis-server. *Wrong outputs*: greedy tokens that differ from an independent",
        "no-cache forward where its top-2 logit gap exceeds 1e-4, plus any cross-tenant or",
        "past-a-gap cached token. *Lost entries*: acknowledged writes later missing with no",
        "eviction, TTL or verification failure to explain them. Must-haves: wrong outputs 0,",
        "lost entries 0, every request succeeds, every injected corruption detected.",
        "",
        "| Fault | Injected | Requests sent / succeeded | Wrong outputs | Lost entries "
        "| Corrupt detected / injected | Recovery (s) | Notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        lines.append(
            f"| {o.name} | {o.injected} | {o.requests} / {o.succeeded} | {o.wrong_outputs} "
            f"| {o.lost_entries} | {o.corrupt_detected} / {o.corrupt_injected} "
            f"| {_cell(o.recovery_s)} | {o.note} |"
        )
    return "\n".join(lines) + "\n" + NOT_YET


NOT_YET = """
Not covered yet: HTTP fuzzing and timing side channels of the OpenAI-compatible server.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench faults", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--scale", choices=tuple(SCALES), default="ci")
    parser.add_argument("--out", default="docs/RELIABILITY.md", help="markdown report ('' = none)")
    parser.add_argument("--only", nargs="*", choices=tuple(SCENARIOS), help="run these only")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    outcomes = run(args.scale, args.only)
    report = markdown(outcomes, args.scale, time.perf_counter() - start)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)
    if args.json:
        print(json.dumps({"faults": [asdict(o) for o in outcomes]}))
    else:
        print(report)
    bad = [o.name for o in outcomes if not must_haves_hold(o)]
    return 1 if bad else 0


def must_haves_hold(o: FaultOutcome) -> bool:
    return (
        o.wrong_outputs == 0
        and o.lost_entries == 0
        and o.succeeded == o.requests
        and o.corrupt_detected == o.corrupt_injected
    )
