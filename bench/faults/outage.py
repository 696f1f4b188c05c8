"""Fault 1: Redis paused, killed and restarted under concurrent load."""

from __future__ import annotations

import threading
import time

import numpy as np

from bench.faults.common import (
    Context,
    FaultOutcome,
    Timed,
    cache_config,
    flush_redis,
    load_threads,
    make_prompts,
    outcome,
    serve,
    wait_for,
)
from engine.loop.engine import Engine


def redis_outage(ctx: Context) -> FaultOutcome:
    """Redis SIGSTOPped, resumed, SIGKILLed and restarted empty under 4 client threads."""
    flush_redis(ctx.redis.url)
    deadline_ms, down = 50.0, ctx.scale.outage_s
    config = cache_config(
        ctx,
        redis_url=ctx.redis.url,
        device_blocks=24,
        lookup_deadline_ms=deadline_ms,
        breaker_failures=2,
        breaker_cooldown_s=0.3,
        # the breaker's recovery is measured here, not the read gate's: on a busy machine the
        # gate may judge Redis (just restarted, reads slowed) dearer than the micro model's
        # prefill and skip it for tier_reprobe_s (30 s), longer than the 20 s this waits
        tier_read_gate=False,
    )
    prompts = make_prompts(20, seed=10)
    with Engine(ctx.model, config) as writer:
        serve(writer, prompts)
        writer.cache.flush(30)
    done: list[Timed] = []
    errors: list[str] = []
    stop, marks = threading.Event(), {}
    with Engine(ctx.model, config) as engine:
        threads = load_threads(engine, prompts, stop, done, errors)
        for name, action in (
            ("pause", ctx.redis.pause),
            ("resume", ctx.redis.resume),
            ("kill", ctx.redis.kill),
            ("restart", ctx.redis.restart),
        ):
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
        ctx,
        name="redis paused / killed under load",
        injected=f"4 client threads; SIGSTOP {down:g} s, SIGCONT, SIGKILL, {down:g} s down, "
        "restart empty",
        prompts=[t.prompt for t in done],
        results=[t.result for t in done],
        recovery_s=None if first is None or not recovered else first - marks["restart"],
        figures={"p99_added_ttft_ms": p99, "deadline_ms": deadline_ms, "faulted": len(added)},
        note=("errors: " + "; ".join(sorted(set(errors))) + "; " if errors else "")
        + f"p99 added TTFT during faults {p99:.1f} ms ({len(added)} requests; lookup "
        f"deadline {deadline_ms:g} ms); recovery = restart to first Redis hit",
    )


def redis_hit(t: Timed, since: float) -> bool:
    return t.done_at > since and t.result is not None and "redis" in t.result.cached_by_tier
