"""Retention on the device: retained blocks go after every unretained one or at their TTL
(an injected clock), within a total cap and per-tenant quotas, refreshed by hits."""

from __future__ import annotations

import numpy as np
import pytest
from test_cache import BS, kv_for, tokens

from hashing import Namespace
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig, ConfigError
from kvstore.index.policies import LRUPolicy
from kvstore.index.policies.retaining import RetainingPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks: int = 256, clock: Clock | None = None, **kw) -> PrefixCache:
    ns = Namespace("fp", "float32", 2, 2, 8, BS)
    config = CacheConfig(block_size=BS, device_blocks=num_blocks, tail_blocks=0, **kw)
    return PrefixCache(config, ns, clock=clock or Clock())


def serve(cache: PrefixCache, prompt: np.ndarray, tenant: str = "") -> int:
    """What the engine does with a prompt: lookup, store, release; returns tokens hit."""
    hit = cache.lookup(prompt, tenant=tenant)
    cache.store(prompt, kv_for(prompt), tenant=tenant, keys=hit.keys)
    cache.release(hit)
    return hit.num_cached_tokens


def blocks(n: int, seed: int) -> np.ndarray:
    """A prompt of n full blocks and a partial last one."""
    return tokens(n * BS + 1, seed)


def test_a_retained_prompt_survives_a_flood_that_evicts_its_unretained_twin():
    cache = make(256)
    retained, control = blocks(40, 1), blocks(40, 2)
    serve(cache, retained)
    serve(cache, control)
    assert cache.retain(retained, 300.0) == (40, 40, 0)
    for seed in range(20):  # each a quarter of the pool
        serve(cache, blocks(64, 100 + seed))
    assert serve(cache, retained) == 40 * BS  # all but its last partial block
    assert serve(cache, control) == 0
    cache.check_integrity()


def test_retention_ends_exactly_at_its_ttl_on_the_injected_clock():
    clock = Clock()
    cache = make(128, clock)
    prompt = blocks(20, 1)
    serve(cache, prompt)
    cache.retain(prompt, 10.0)
    clock.now = 9.999
    assert cache.stats()["retention"]["blocks_by_tenant"] == {"": 20}
    clock.now = 10.0
    stats = cache.stats()["retention"]
    assert (stats["blocks_by_tenant"], stats["expired_blocks_total"]) == ({}, 20)
    for seed in range(4):  # plain LRU again: the flood evicts it
        serve(cache, blocks(32, 100 + seed))
    assert cache.lookup(prompt).num_cached_tokens == 0


def test_a_hit_refreshes_retention_to_a_full_ttl():
    clock = Clock()
    cache = make(128, clock)
    prompt = blocks(20, 1)
    serve(cache, prompt)
    cache.retain(prompt, 10.0)
    clock.now = 8.0
    assert serve(cache, prompt) == 20 * BS
    clock.now = 17.9
    for seed in range(4):
        serve(cache, blocks(32, 100 + seed))
    assert serve(cache, prompt) == 20 * BS  # retained until 18.0, then refreshed again
    clock.now = 28.0
    assert cache.stats()["retention"]["blocks_by_tenant"] == {}


def test_retained_blocks_at_their_cap_never_block_admission():
    cache = make(256)  # cap: half the pool, 128 blocks
    kept = [blocks(40, seed) for seed in range(4)]
    for prompt in kept:
        serve(cache, prompt)
        cache.retain(prompt, 300.0)
    assert cache.stats()["retention"]["blocks_by_tenant"] == {"": 128}
    big = blocks(103, 9)  # 40% of the pool
    assert cache.store(big, kv_for(big)) == 103
    assert cache.lookup(big).num_cached_tokens == 103 * BS
    # what fit the cap was retained prefix-first: the fourth prompt got 8 of its 40 blocks
    assert [cache.peek(p) // BS for p in kept[:3]] == [40, 40, 40]
    cache.check_integrity()


def test_when_only_retained_blocks_are_left_they_are_evicted_earliest_deadline_first():
    cache = make(64, retention_max_fraction=0.99)
    first, second = blocks(30, 1), blocks(30, 2)
    serve(cache, first)
    cache.retain(first, 100.0)
    serve(cache, second)
    cache.retain(second, 200.0)
    serve(cache, blocks(10, 3))  # needs 6 retained blocks: the first's tail goes
    assert (cache.peek(first) // BS, cache.peek(second) // BS) == (24, 30)
    assert cache.stats()["retention"]["forced_blocks_total"] == 6
    cache.check_integrity()


def test_one_tenants_retention_past_its_quota_does_not_cost_another_tenant_hits():
    def run(num_retained: int) -> int:
        cache = make(128, retention_quota_blocks=16)
        mine = [blocks(16, seed) for seed in range(num_retained)]
        for prompt in mine:
            serve(cache, prompt, tenant="a")
            cache.retain(prompt, 300.0, tenant="a")
        theirs = [blocks(12, 50 + i % 6) for i in range(30)]  # 6 prompts, each 5 times
        return sum(serve(cache, p, tenant="b") for p in theirs)

    within, beyond = run(1), run(4)
    assert within == beyond == 24 * 12 * BS  # each of b's 6 prompts hit on 4 of its 5 turns


def test_retention_counts_per_tenant_and_release_ends_it():
    cache = make(256, retention_quota_blocks=30)
    a, b = blocks(20, 1), blocks(40, 2)
    serve(cache, a, "x")
    serve(cache, b, "y")
    assert cache.retain(a, 60.0, tenant="x").num_device_blocks == 20
    assert cache.retain(b, 60.0, tenant="y").num_device_blocks == 30  # its quota
    assert cache.stats()["retention"]["blocks_by_tenant"] == {"x": 20, "y": 30}
    assert cache.release_retention(b) == 30
    assert cache.stats()["retention"]["blocks_by_tenant"] == {"x": 20}
    cache.check_integrity()


def test_retaining_a_prefix_splits_the_run_and_retains_only_the_prefix():
    cache = make(256)
    prompt = blocks(40, 1)
    serve(cache, prompt)
    assert cache.retain(prompt[: 10 * BS + 2], 60.0).num_device_blocks == 10
    for seed in range(6):
        serve(cache, blocks(60, 100 + seed))
    assert cache.peek(prompt) == 10 * BS
    cache.check_integrity()


def test_retention_of_uncached_blocks_retains_nothing_on_the_device():
    cache = make(64)
    assert cache.retain(blocks(10, 1), 60.0) == (0, 0, 0)


@pytest.mark.parametrize("ttl", [0, -1.0, float("nan"), True, "5m"])
def test_a_bad_ttl_is_refused(ttl):
    with pytest.raises(ValueError, match="ttl_s"):
        make(64).retain(blocks(4, 1), ttl)


@pytest.mark.parametrize(
    ("field", "value"),
    [("retention_max_fraction", 1.0), ("retention_max_fraction", -0.1),
     ("retention_quota_blocks", 0), ("retention_quota_blocks", True)],
)  # fmt: skip
def test_bad_retention_settings_name_their_field(field, value):
    with pytest.raises(ConfigError, match=field):
        CacheConfig(**{field: value})


def test_retaining_policy_hides_retained_entries_until_expiry():
    clock = Clock()
    policy = RetainingPolicy(LRUPolicy(), clock)
    for key in (1, 2, 3):
        policy.insert(key, 1)
        policy.set_evictable(key, True)
    policy.retain(1, 1, 5.0, "t")
    assert policy.victim() == 2
    policy.remove(2)
    assert policy.victim() == 3
    assert policy.counts.deferred == 2
    policy.remove(3)
    assert policy.victim() == 1  # only retained entries left: it goes (forced)
    clock.now = 5.0
    policy.expire()
    assert policy.retained(1) is None and policy.counts.expired == 1
    policy.check_integrity()
