"""Fault 10: a timing side channel. An attacker times prompts a victim sent (candidate hits)
against never-seen controls: with salts on the two must be indistinguishable (AUC ~ 0.5);
with one shared salt the same probe must separate them (AUC ~ 1), proving the probe works.

Each secret and each control is sent once, in one shuffled order, so the attacker's own probe
never creates the hit it looks for and load drift slows both classes alike. The victim and
the probes of a round share one engine (device pool), or the probes run on a fresh engine
whose only copy of the secrets is in LMDB or Redis. Spill writes are flushed after each probe
so they never slow the next one. AUC = P(control TTFT > secret TTFT), ties 1/2."""

from __future__ import annotations

import copy
import random
import shutil
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.faults.common import (
    BS,
    Context,
    FaultOutcome,
    cache_config,
    flush_redis,
    make_prompts,
    outcome,
    serve,
)
from engine.loop.engine import Engine, GenerateResult, SamplingParams
from engine.model.loading import LoadedModel, random_model, wrap_model
from kvstore.config import CacheConfig

# (salt setting, tier the shared-salt hits come from). The salted run keeps the secrets in
# the device pool, LMDB and Redis at once, so a salted probe misses all three; the lmdb and
# redis runs probe a fresh engine whose only copy of the secrets is in that tier.
RUNS = (("salted", "all"), ("unsalted", "device"), ("unsalted", "lmdb"), ("unsalted", "redis"))
SALTS = {"unsalted": ("", ""), "salted": ("victim", "attacker")}
ROUND = 32  # pairs per round: a round's blocks fit the pool, so no secret is evicted early
POOL_BLOCKS = 16384  # > 3 x ROUND prompts of 128 blocks + warm-ups
WARMUP = 4  # attacker requests before each round's probes, not timed
PAIRS_PER_REQUEST = 8  # pairs a run: 8 x scale.requests (64 at CI); at most MAX_PAIRS, where
MAX_PAIRS = 512  # the AUC's standard error under no channel is already 0.018
PARAMS = SamplingParams(max_new_tokens=1)  # the probe needs the first token only
POSITIONS = 1024
# A shared-salt hit skips ~4 ms of prefill, wider than a busy 2-core machine's scheduling
# jitter; the micro model's 256 positions (249-token prompts) left a ~1 ms gap that load hid.
LENGTH = 127 * BS + 1


def long_model(model: LoadedModel, positions: int = POSITIONS) -> LoadedModel:
    """`model`'s architecture with room for `positions` tokens (random weights, seed 1)."""
    config = copy.deepcopy(model.model.config)
    config.max_position_embeddings = positions
    return wrap_model(random_model(config, seed=1), model.tokenizer, f"{model.name}-{positions}")


def auc(miss: list[float], hit: list[float]) -> float:
    """P(a control's TTFT > a candidate hit's TTFT), ties 1/2: Mann-Whitney U / (n1 n2)."""
    if not miss or not hit:
        return float("nan")
    m, h = np.asarray(miss)[:, None], np.asarray(hit)[None, :]
    return float(((m > h).sum() + 0.5 * (m == h).sum()) / (m.size * h.size))


@dataclass
class Run:
    """One tier under one salt setting: every request and the probe's measurements."""

    tier: str
    prompts: list[list[int]] = field(default_factory=list)
    results: list[GenerateResult | None] = field(default_factory=list)
    secret_ttft: list[float] = field(default_factory=list)
    control_ttft: list[float] = field(default_factory=list)
    secret_cached: list[int] = field(default_factory=list)  # from this run's tier
    secret_cached_any: int = 0  # from any tier
    control_cached: int = 0

    def add(self, prompts: list[list[int]], results: list[GenerateResult | None]) -> None:
        self.prompts += prompts
        self.results += results

    def record(self, secret: bool, result: GenerateResult | None) -> None:
        if result is None:
            return
        if secret:
            self.secret_ttft.append(result.ttft_s)
            self.secret_cached.append(result.cached_by_tier.get(self.tier, 0))
            self.secret_cached_any += result.cached_tokens
        else:
            self.control_ttft.append(result.ttft_s)
            self.control_cached += result.cached_tokens


def _config(ctx: Context, tier: str, lmdb_dir: Path) -> CacheConfig:
    flush_redis(ctx.redis.url)
    spill = {"lmdb_dir": str(lmdb_dir), "redis_url": ctx.redis.url}
    spill = {k: v for k, v in spill.items() if tier == "all" or k.startswith(tier)}
    return cache_config(ctx, device_blocks=POOL_BLOCKS, **spill)


def _probe(engine: Engine, run: Run, secrets: list, controls: list, salt: str, seed: int) -> None:
    """Every secret and control once, shuffled together, so a probe never creates its hit."""
    order = [(True, p) for p in secrets] + [(False, q) for q in controls]
    random.Random(seed).shuffle(order)
    for secret, prompt in order:
        result = serve(engine, [prompt], salt, PARAMS)[0]
        engine.cache.flush(30)  # this probe's tier writes must not slow the next one
        run.add([prompt], [result])
        run.record(secret, result)


def _round(ctx: Context, run: Run, salts: tuple[str, str], n: int, seed: int) -> None:
    secrets, controls = (make_prompts(n, seed + i, LENGTH) for i in (0, 1))
    warm = make_prompts(WARMUP, seed + 2, LENGTH)
    lmdb_dir = ctx.workdir / f"lmdb-timing-{seed}"
    config = _config(ctx, run.tier, lmdb_dir)
    with ExitStack() as stack:
        engine = stack.enter_context(Engine(ctx.model, config))
        run.add(secrets, serve(engine, secrets, salts[0], PARAMS))
        if run.tier in ("lmdb", "redis"):
            engine.close()  # flushes the victim's blocks; the attacker's engine starts empty
            engine = stack.enter_context(Engine(ctx.model, config))
        run.add(warm, serve(engine, warm, salts[1], PARAMS))
        _probe(engine, run, secrets, controls, salts[1], seed)
    shutil.rmtree(lmdb_dir, ignore_errors=True)


def _run(ctx: Context, tier: str, salts: tuple[str, str], pairs: int, seed: int) -> Run:
    run = Run(tier)
    for i, start in enumerate(range(0, pairs, ROUND)):
        _round(ctx, run, salts, min(ROUND, pairs - start), seed + 10 * i)
    return run


def _key(name: str, tier: str) -> str:
    return name if tier in ("all", "device") else f"{name}_{tier}"


def _figures(runs: dict[tuple[str, str], Run], pairs: int, length: int) -> dict[str, float]:
    figures: dict[str, float] = {"pairs": pairs, "prompt_tokens": length}
    for (tier, cond), run in runs.items():
        figures[_key(f"auc_{cond}", tier)] = round(auc(run.control_ttft, run.secret_ttft), 4)
        for name, ttft in (("secret", run.secret_ttft), ("control", run.control_ttft)):
            figures[_key(f"ttft_ms_{name}_{cond}", tier)] = round(1e3 * np.median(ttft), 3)
    salted = [r for (_, cond), r in runs.items() if cond == "salted"]
    unsalted = [r for (_, cond), r in runs.items() if cond == "unsalted"]
    figures["cross_tenant_tokens"] = sum(r.secret_cached_any for r in salted)
    # every token but the last from the cache (on the device a kept tail may give the last too)
    figures["full_hits"] = sum(c >= length - 1 for r in unsalted for c in r.secret_cached)
    figures["control_cached_tokens"] = sum(r.control_cached for r in runs.values())
    return figures


def _note(f: dict[str, float]) -> str:
    def medians(cond: str) -> str:
        return f"{f[f'ttft_ms_secret_{cond}']:.2f} vs {f[f'ttft_ms_control_{cond}']:.2f} ms"

    return (
        f"AUC salted {f['auc_salted']:.2f}, shared salt {f['auc_unsalted']:.2f} (hits from "
        f"the device pool), {f['auc_unsalted_lmdb']:.2f} (LMDB), {f['auc_unsalted_redis']:.2f} "
        f"(Redis); {int(f['pairs'])} pairs a run; median TTFT secret vs control: salted "
        f"{medians('salted')}, shared salt {medians('unsalted')}; "
        f"{int(f['cross_tenant_tokens'])} cross-tenant cached tokens"
    )


def timing_side_channel(ctx: Context) -> FaultOutcome:
    """Salted: an attacker's TTFT cannot tell the victim's prompts from fresh ones (AUC ~ 0.5)
    in the device pool, LMDB or Redis. Shared salt: the same probe separates them (AUC ~ 1)."""
    ctx = ctx._replace(model=long_model(ctx.model))
    pairs, length = min(PAIRS_PER_REQUEST * ctx.scale.requests, MAX_PAIRS), LENGTH
    runs = {
        (tier, cond): _run(ctx, tier, SALTS[cond], pairs, 100_000 + 10_000 * k)
        for k, (cond, tier) in enumerate(RUNS)
    }
    figures = _figures(runs, pairs, length)
    return outcome(
        ctx,
        name="timing side channel (cache_salt)",
        injected=f"victim (salt 'victim') sends {pairs} {length}-token secrets to the micro Llama "
        f"with {POSITIONS} positions; attacker (salt 'attacker') sends each once, shuffled with "
        f"{pairs} unseen controls, after {WARMUP} untimed warm-ups a round; secrets in device "
        "pool + LMDB + Redis; control runs with both salts '' hit the device pool, or LMDB or "
        "Redis alone from a fresh engine",
        prompts=[p for r in runs.values() for p in r.prompts],
        results=[x for r in runs.values() for x in r.results],
        wrong_outputs_extra=figures["cross_tenant_tokens"],
        figures=figures,
        note=_note(figures),
    )
