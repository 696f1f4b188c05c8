"""Fault 9: tenant isolation by cache salt in every tier."""

from __future__ import annotations

from bench.faults.common import (
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


def tenant_isolation(ctx: Context) -> FaultOutcome:
    """The same prompts under another cache salt: 0 cached tokens in the device pool, LMDB
    and Redis, while the owner still hits its own entries in each."""
    flush_redis(ctx.redis.url)
    prompts = make_prompts(max(4, ctx.scale.requests // 4), seed=90)
    both = {"lmdb_dir": str(ctx.workdir / "lmdb-tenant"), "redis_url": ctx.redis.url}
    sent, results, cross, own = [], [], 0, 0
    with Engine(ctx.model, cache_config(ctx, **both)) as engine:
        for salt in ("owner", "other-device"):
            results += serve(engine, prompts, salt)
        engine.cache.flush(30)
    cross += sum(r.cached_tokens for r in results[len(prompts) :] if r)
    sent += prompts + prompts
    for tier, salt in (("lmdb", "other-lmdb"), ("redis", "other-redis")):
        with Engine(
            ctx.model, cache_config(ctx, **{k: v for k, v in both.items() if tier in k})
        ) as e:
            other, mine = serve(e, prompts, salt), serve(e, prompts, "owner")
        cross += sum(r.cached_tokens for r in other if r)
        own += sum(bool(r and r.cached_by_tier.get(tier) == PROMPT_LEN - 1) for r in mine)
        sent, results = sent + prompts + prompts, results + other + mine
    return outcome(
        ctx,
        name="tenant isolation (cache_salt)",
        injected="same prompts under 3 other salts, one per tier (device, lmdb, redis)",
        prompts=sent,
        results=results,
        wrong_outputs_extra=cross,
        figures={"cross_tenant_tokens": cross, "owner_full_hits": own},
        note=f"{cross} cross-tenant cached tokens; owner full hits {own}/{2 * len(prompts)} "
        "from lmdb and redis",
    )
