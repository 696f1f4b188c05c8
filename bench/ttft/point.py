"""One TTFT point of `bench ttft`: a prompt, a cached prefix in one tier, and the three
variants (no cache, ideal, kvstore) timed in interleaved rounds (see bench/ttft/__init__.py)."""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from engine.loop.sequential import forward_on
from engine.model.loading import with_cache

TIERS = ("device", "memory", "lmdb", "redis")  # a spill tier as "memory:layers" or ":whole"


def full_kv(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) of a full prefill: [1, kv_heads, len(ids), head_dim]."""
    past = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids], device=model.device), **with_cache(model, past))
    return [(layer.keys, layer.values) for layer in past.layers]


def clone_prefix(model, kv: list, cached: int) -> DynamicCache:
    past = DynamicCache(config=model.config)
    for layer, (k, v) in zip(past.layers, kv, strict=True):
        k, v = k[:, :, :cached].clone(), v[:, :, :cached].clone()
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return past


def suffix_first_token(model, ids: list[int], past: DynamicCache) -> int:
    """Greedy first token of `ids` with `past` holding its first tokens."""
    return int(torch.argmax(forward_on(model, ids[past.get_seq_length() :], past)))


def cache_config_for(
    tier: str, args: argparse.Namespace, num_blocks: int, tmp: str, codec: str = "none"
):
    """Only `tier` besides the device pool (room for the whole prompt, whose suffix the paged
    prefill writes in place); write-through so a store reaches it at once; its entries in
    `codec`."""
    from kvstore.config import CacheConfig

    base = {"block_size": args.block_size, "device": args.device, "device_blocks": num_blocks + 8,
            "tier_read_gate": args.read_gate == "on", "codec": codec,
            "kv_cache_dtype": args.kv_cache_dtype}  # fmt: skip
    tier, _, how = tier.partition(":")  # "memory:layers" / "memory:whole": layer_loads
    if how:  # on / off; plain: the default
        base["layer_loads"] = how == "layers"
    if tier == "memory":
        base.update(memory_cache_gb=1.0, memory_write_policy="write-through")
    elif tier == "lmdb":
        base.update(lmdb_dir=args.lmdb_dir or tmp, lmdb_write_policy="write-through")
    elif tier == "redis":
        if not args.redis_url:
            raise SystemExit("tier 'redis' needs --redis-url (e.g. redis://127.0.0.1:6379/0)")
        # a deadline that times the load, not a timeout: SmolLM2's 1792 cached tokens are
        # 82 MB, and torch's threads still spin for a while after a prefill on 2 cores
        base.update(redis_url=args.redis_url, redis_write_policy="write-through",
                    lookup_deadline_ms=2000.0)  # fmt: skip
    return CacheConfig(**base)


def hold_only_in_tier(cache, tier: str) -> None:
    """Drop the device copy so the next lookup must fetch from `tier` (outside timing)."""
    if tier != "device":
        cache.flush()
        cache.evict_device()
        cache.flush()


def round_order(round_: int, device: bool = False) -> list[str]:
    """ideal and kvstore run back to back (their order alternates); nocache goes around them.
    With `device` (a spill tier's point), a device-tier hit of the same prompt runs on
    ideal's other side, so that kvstore and device are paired in every round too: after
    kvstore, whose lookup left the prefix in the pool, or first in the next round."""
    if device:
        pair = ["kvstore", "ideal", "device"] if round_ % 2 == 0 else ["device", "ideal", "kvstore"]
    else:
        pair = ["ideal", "kvstore"] if round_ % 2 == 0 else ["kvstore", "ideal"]
    return ["nocache", *pair] if round_ % 4 < 2 else [*pair, "nocache"]


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    gc.collect()
    start = time.perf_counter()
    token = fn()
    return time.perf_counter() - start, token


def measure_point(
    lm, ids: list[int], kv: list, tier: str, cached: int, args, codec: str = "none",
    paired_device: bool = True,
) -> dict:  # fmt: skip
    """One point; `paired_device`: a spill tier's rounds also time the device tier's hit."""
    from engine.loop.engine import Engine

    with tempfile.TemporaryDirectory() as tmp:
        blocks = -(-len(ids) // args.block_size)  # the prompt's
        config = cache_config_for(tier, args, blocks, tmp, codec)
        with Engine(lm, config) as engine:
            for store in engine.cache.tiers.stores if engine.cache.tiers else ():
                store.clear()  # exactly this prefix: nothing left from an earlier point or run
            engine.prefill(unrelated(ids))  # the prefill figure a serving engine has (the gate's)
            layers = [(k[:, :, :cached], v[:, :, :cached]) for k, v in kv]
            engine.on_loop(lambda: engine.cache.store(ids[:cached], layers))
            point = measure_variants(engine, ids, kv, tier, cached, args, paired_device)
            return point | {"codec": codec, "read_gate": engine.cache.stats()["read_gate"]}


def unrelated(ids: list[int]) -> list[int]:
    """A prompt as long as `ids` that shares no block with it."""
    return [(t + 1) % 256 if i == 0 else t for i, t in enumerate(ids)]


def measure_variants(
    engine, ids: list[int], kv: list, tier: str, cached: int, args, paired_device: bool = True
) -> dict:
    """Interleaved rounds of the variants; medians and the paired ratios of kvstore to ideal
    and, for a spill tier, to the device tier's hit of the same prompt."""
    model = engine.model.model

    def nocache() -> int:  # as the engine runs the model: its thread, its linear kernels
        return engine.on_loop(
            lambda: suffix_first_token(model, ids, DynamicCache(config=model.config))
        )

    def ideal(past: DynamicCache) -> int:
        return engine.on_loop(lambda: suffix_first_token(model, ids, past))

    loaded: list[int] = []

    def kvstore() -> int:
        skipped = skips(engine.cache)
        pre = engine.prefill(ids)
        if pre.cached_tokens != cached and skips(engine.cache) == skipped:
            raise RuntimeError(f"{tier}: loaded {pre.cached_tokens} tokens, expected {cached}")
        loaded.append(pre.cached_tokens)  # fewer: the read gate computed the tier's blocks
        return int(torch.argmax(pre.logits))

    def device() -> int:  # the prefix in the pool, as kvstore's lookup left it
        pre = engine.prefill(ids)
        if pre.cached_tokens != cached:
            raise RuntimeError(f"device: {pre.cached_tokens} tokens in the pool, not {cached}")
        return int(torch.argmax(pre.logits))

    paired = paired_device and tier != "device"
    times: dict[str, list[float]] = {"nocache": [], "ideal": [], "kvstore": []}
    times |= {"device": []} if paired else {}
    spent: dict[str, list[float]] = {"load": [], "wait": []}  # layer-by-layer loads' seconds
    tokens = set()
    with torch.inference_mode():
        for round_ in range(args.runs + 1):  # round 0 is the warm-up
            for name in round_order(round_, paired):
                if name == "device":  # the pool holds the prefix (kvstore's lookup put it there)
                    elapsed, token = timed(device)
                elif name == "ideal":
                    past = engine.on_loop(lambda: clone_prefix(model, kv, cached))
                    elapsed, token = timed(lambda p=past: ideal(p))
                else:
                    if name == "kvstore":  # outside the timed region, on the engine's thread
                        engine.on_loop(lambda: hold_only_in_tier(engine.cache, tier))
                    before = layer_seconds(engine.cache)
                    elapsed, token = timed(nocache if name == "nocache" else kvstore)
                    after = layer_seconds(engine.cache)
                    if round_ and name == "kvstore":
                        for key in spent:
                            spent[key].append(after[key] - before[key])
                tokens.add(token)
                if round_:
                    times[name].append(elapsed)
    point = summarize(times, tier, len(ids), cached, len(tokens) == 1)
    if tier == "device":  # the device tier is its own base
        point |= {"ttft_device_s": point["ttft_kvstore_s"], "ratio_to_device": 1.0}
    timed_loads = loaded[-args.runs :] if args.runs else []
    skipped = sum(n != cached for n in timed_loads)
    point |= {"read_skipped": skipped, "loaded_tokens": statistics.median(timed_loads or [0])}
    return point | {f"{key}_s": statistics.median(v) for key, v in spent.items()}


def skips(cache) -> int:
    """Lookups whose tier read the read gate skipped, so far (every tier)."""
    counters = cache.metrics.snapshot()["counters"].get("tier_read_skipped_total", {})
    return int(sum(counters.values()))


def layer_seconds(cache) -> dict[str, float]:
    """Seconds the cache's layer-by-layer loads took on the loader (`load`) and kept
    forwards waiting (`wait`), so far."""
    get = cache.metrics.get
    return {"load": get("layer_load_seconds_total"), "wait": get("layer_wait_seconds_total")}


def summarize(times: dict, tier: str, prompt_tokens: int, cached: int, same: bool) -> dict:
    median = {name: statistics.median(values) for name, values in times.items()}
    paired = [k / i for k, i in zip(times["kvstore"], times["ideal"], strict=True)]
    nocache = [k / n for k, n in zip(times["kvstore"], times["nocache"], strict=True)]
    hits = times.get("device", [])  # the device tier's, timed beside this one's
    device = [k / d for k, d in zip(times["kvstore"], hits, strict=True)] if hits else []
    return {
        "tier": tier,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "ttft_nocache_s": median["nocache"],
        "ttft_ideal_s": median["ideal"],
        "ttft_kvstore_s": median["kvstore"],
        "ratio_to_ideal": statistics.median(paired),
        "ratio_to_nocache": statistics.median(nocache),
        # over the device tier's hit timed in the same rounds (None: none was)
        "ttft_device_s": median.get("device"),
        "ratio_to_device": statistics.median(device) if device else None,
        "same_first_token": same,
    }


def tier_label(point: dict) -> str:
    """The tier, and its codec when it is not `none`."""
    codec = point.get("codec", "none")
    return point["tier"] if codec == "none" else f"{point['tier']} {codec}"


def device_cell(point: dict) -> str:
    ratio = point.get("ratio_to_device")
    return "-" if ratio is None else f"{ratio:.3f}"


def device_ms_cell(point: dict) -> str:
    """The device tier's TTFT timed beside this point's (its own, for the device tier)."""
    seconds = point.get("ttft_device_s")
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def print_table(
    points: list[dict], args: argparse.Namespace, extra: Sequence[tuple[str, Callable]] = ()
) -> None:
    """`extra`: (column, point -> cell text) pairs after the fixed columns."""
    from rich.console import Console
    from rich.table import Table

    on = "GPU" if args.device == "cuda" else f"{args.threads} threads"
    title = f"TTFT, {args.model} model fp32, {on}, median of {args.runs}"
    pool = args.kv_cache_dtype
    title += "" if pool == "auto" else f", {pool} pool"
    table = Table(title=title)
    cols = ("tier", "prompt", "cached", "no cache ms", "ideal ms", "kvstore ms", "ratio",
            "load ms", "waited ms")  # fmt: skip
    for col in cols + tuple(name for name, _ in extra):
        table.add_column(col, justify="right")
    for p in points:
        table.add_row(
            tier_label(p),
            str(p["prompt_tokens"]),
            str(p["cached_tokens"]),
            f"{p['ttft_nocache_s'] * 1e3:.1f}",
            f"{p['ttft_ideal_s'] * 1e3:.1f}",
            f"{p['ttft_kvstore_s'] * 1e3:.1f}",
            f"{p['ratio_to_ideal']:.3f}",
            f"{p['load_s'] * 1e3:.1f}",
            f"{p['wait_s'] * 1e3:.1f}",
            *(cell(p) for _, cell in extra),
        )
    Console().print(table)


class FirstTokenClock:
    """A generate streamer noting when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass
