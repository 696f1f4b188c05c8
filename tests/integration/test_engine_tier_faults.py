"""Tier failures under the engine: a failing Redis is a miss, never a failed request."""

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from engine_helpers import greedy_matches_reference, micro_cache_config, micro_model

from engine.loop.engine import Engine, SamplingParams

PARAMS = SamplingParams(max_new_tokens=6)
BS = 4


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length).tolist() for _ in range(n)]


def redis_config(url: str):
    return micro_cache_config(
        redis_url=url, lookup_deadline_ms=100.0, breaker_failures=2, breaker_cooldown_s=0.3
    )


def breaker_state(engine: Engine) -> str:
    return engine.cache.tiers.stores[0].stats().breaker_state


def test_redis_killed_mid_run_and_restarted_keeps_every_request_correct(redis_server):
    model = micro_model(seed=1)
    config = redis_config(redis_server.url)
    before, during, after = prompts(3, 41, 1), prompts(4, 41, 2), prompts(3, 41, 3)
    with Engine(model, config) as writer:  # fills Redis through write-through
        for p in before:
            writer.generate([p], PARAMS)
    states = []
    with Engine(model, config) as eng:  # an empty device pool: hits come from Redis
        for p in before:
            res = eng.generate([p], PARAMS)[0]
            assert res.cached_tokens == 40
            assert greedy_matches_reference(model, p, res.output_token_ids)
        redis_server.kill()
        for p in during:  # Redis down: misses, recompute, never an error
            res = eng.generate([p], PARAMS)[0]
            assert res.cached_tokens == 0
            assert greedy_matches_reference(model, p, res.output_token_ids)
            states.append(breaker_state(eng))
        assert states[-1] == "open"
        redis_server.restart()  # empty: no persistence
        time.sleep(0.4)  # past the cooldown: the next call probes and closes the breaker
        for p in after:
            res = eng.generate([p], PARAMS)[0]
            assert greedy_matches_reference(model, p, res.output_token_ids)
        assert eng.cache.flush(10)
        assert breaker_state(eng) == "closed"
    with Engine(model, config) as fresh:  # hits resume from the restarted Redis
        for p in after:
            assert fresh.generate([p], PARAMS)[0].cached_tokens == 40
