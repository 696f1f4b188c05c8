"""Exact block accounting (`Engine.check_integrity`, engine/loop/accounting.py): every
block's references are its owners' (index, tails, the scratch block, running tables, lent
blocks), the states add up to the total, tails and reserved blocks are what they say,
tenant counts are those of the runs' owners and never negative, retention counts too. Each
planted fault is caught; `n`, `best_of`, preemption, aborts, quotas and retention driven
together keep it whole after every step; the counts a client reported drifting do not."""

from __future__ import annotations

import contextlib
import logging
import random

import numpy as np
import pytest
from engine_helpers import micro_cache_config, micro_model

from engine.loop.accounting import check_blocks
from engine.loop.engine import Engine
from engine.loop.group import SequenceGroup, branch_params
from engine.loop.request import Request, Retain, SamplingParams


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def group(prompt: list[int], params: SamplingParams, n: int, best_of: int | None = None):
    jobs = [Request(list(prompt), p) for p in branch_params(params, best_of or n)]
    if best_of is not None:
        for job in jobs:
            job.cumulative_logprob = 0.0
    return SequenceGroup(jobs)


def test_groups_aborts_and_preemptions_leave_the_reserved_count_and_the_states_whole():
    """Twenty requests of n=2 and n=3 (and best_of=3), some cancelled, under a pool small
    enough to preempt: the reserved count stays 1 (the scratch block) and the states add
    up to the total (each `n=2` request lowered it by one, through the lent block)."""
    model = micro_model(seed=31)
    rng = random.Random(0)
    with Engine(model, micro_cache_config(device_blocks=48)) as engine:
        assert engine.cache.held.num_reserved == 1
        groups = []
        for i in range(20):
            params = SamplingParams(max_new_tokens=rng.randint(3, 12), ignore_eos=True,
                                    temperature=0.7, seed=i)  # fmt: skip
            n = rng.choice([2, 3])
            g = group(tokens(rng.randint(6, 30), seed=i), params, n, 3 if i % 5 == 4 else None)
            engine.add_group(g)
            groups.append(g)
            if i % 4 == 3:
                engine.cancel(g.requests[rng.randrange(len(g.requests))])
        for g in groups:
            for request in g.requests:
                with contextlib.suppress(Exception):  # the cancelled ones, and their groups
                    request.future.result(120)
        engine.check_integrity()
        stats = engine.stats()["device"]
        assert stats["blocks_reserved"] == 1
        parts = ("blocks_free", "blocks_cached", "blocks_tails", "blocks_reserved")
        assert sum(stats[k] for k in parts) == stats["blocks_total"]
        assert sum(r.num_preemptions for g in groups for r in g.requests) >= 1


def test_a_tenant_extending_anothers_path_leaves_both_counts_whole_after_eviction():
    """x then y send the same 41-token prompt (no salt, quota 5 blocks): y extends x's
    path. Eviction gives each its own blocks back: no count goes negative, and x's next
    prompt is cached on its second send (x was locked out of an empty cache before)."""
    model = micro_model(seed=32)
    params = SamplingParams(max_new_tokens=1)
    prompt = tokens(41, seed=5)
    config = micro_cache_config(tenant_quota_blocks=5, tail_blocks=0)
    with Engine(model, config) as engine:
        engine.submit(prompt, params, tenant="x").result(60)
        engine.submit(prompt, params, tenant="y").result(60)
        counts = engine.cache.device_index.tenants.blocks
        assert {t: n for t, n in counts.items() if n} == {"x": 5, "y": 5}
        engine.on_loop(engine.cache.evict_device)
        assert all(n >= 0 for n in counts.values()) and sum(counts.values()) == 0
        engine.check_integrity()
        other = tokens(21, seed=6)
        first = engine.submit(other, params, tenant="x").result(60)
        second = engine.submit(other, params, tenant="x").result(60)
        engine.check_integrity()
    assert (first.cached_tokens, second.cached_tokens) == (0, 20)


# --- planted faults -------------------------------------------------------------------------


@pytest.fixture
def busy():
    """An engine with cached blocks, a kept tail and a retained prefix, checked whole."""
    model = micro_model(seed=33)
    with Engine(model, micro_cache_config(device_blocks=64)) as engine:
        retained = Request(tokens(17, seed=7), SamplingParams(max_new_tokens=3),
                           retention=(Retain(16, 60.0),))  # fmt: skip
        engine.add_requests([retained])
        retained.future.result(60)
        engine.generate([tokens(10, seed=8)], SamplingParams(max_new_tokens=3))
        engine.check_integrity()
        yield engine


def cached_block(engine: Engine) -> int:
    return engine.cache.index.all_block_ids()[0]


def plant(engine: Engine, fault) -> None:
    engine.on_loop(lambda: fault(engine.cache))


FAULTS = {
    "a stray reference": (lambda c: c.pool.incref([c.index.all_block_ids()[0]]), "references"),
    "a reserved block that is no scratch block": (
        lambda c: c.held.reserved.update(c.held.allocate(1)), "reserved blocks"),
    "the scratch block not reserved": (lambda c: c.held.reserved.clear(), "reserved blocks"),
    "a tail listed twice": (
        lambda c: c.tails._tails.update({(b"x", b"y"): next(iter(c.tails._tails.values()))}),
        "tail block is listed twice"),
    "a tail that is also cached": (
        lambda c: c.tails._tails.update({(b"x", b"y"): next(iter(c.tails._tails.values()))
                                         ._replace(block_id=c.index.all_block_ids()[0])}),
        "tail block is cached"),
    "phantom tenant blocks": (lambda c: c.device_index.tenants.blocks.update(ghost=99),
                              "tenant block counts"),
    "a negative tenant count": (
        lambda c: c.device_index.tenants.blocks.__setitem__("ghost", -2), "negative"),
    "a negative retention count": (
        lambda c: c.index.policy.blocks.__setitem__("ghost", -1), "retained blocks are"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(FAULTS))
def test_each_planted_fault_is_caught(busy: Engine, name: str) -> None:
    fault, match = FAULTS[name]
    reserved = set(busy.cache.held.reserved)
    plant(busy, fault)
    with pytest.raises(Exception, match=match):
        busy.check_integrity()
    busy.cache.held.reserved.update(reserved)  # (the engine gives its scratch block back)


def test_a_lent_block_without_its_reference_is_caught() -> None:
    """While a released group's branches wait, its lent block holds one more reference."""
    model = micro_model(seed=34)
    with Engine(model, micro_cache_config(device_blocks=64)) as engine:
        seen: list = []

        def at_release(scheduler=engine.scheduler, release=engine.scheduler.release_group):
            def wrapped(g):
                release(g)
                check_blocks(engine.cache, scheduler, {engine.runner.scratch_block})  # whole
                engine.cache.pool.free([g.lent.block_id])  # the lent reference, lost
                try:
                    check_blocks(engine.cache, scheduler, {engine.runner.scratch_block})
                except AssertionError as e:
                    seen.append(str(e))
                engine.cache.pool.incref([g.lent.block_id])

            return wrapped

        engine.scheduler.release_group = at_release()
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        g = group(tokens(10, seed=9), params, 3)
        engine.add_group(g)
        [r.future.result(60) for r in g.requests]
        engine.check_integrity()
    assert len(seen) == 1 and "references" in seen[0]


def test_the_shutdown_check_reports_a_block_left_out(caplog) -> None:
    model = micro_model(seed=35)
    engine = Engine(model, micro_cache_config())
    engine.generate([tokens(9, seed=10)], SamplingParams(max_new_tokens=2))
    engine.on_loop(lambda: engine.cache.held.reserve(1))  # a block nobody gives back
    with caplog.at_level(logging.ERROR, "kvstore.engine"):
        engine.close()
    assert "block accounting at shutdown: reserved blocks" in caplog.text


# --- everything at once ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_n_best_of_preemption_aborts_quotas_and_retention_keep_the_accounts_every_step(seed):
    rng = random.Random(seed)
    model = micro_model(seed=36)
    config = micro_cache_config(device_blocks=40, tenant_quota_blocks=12,
                                retention_quota_blocks=6)  # fmt: skip
    with Engine(model, config) as engine:
        checked, failures = [0], []
        step = engine.stepper.step

        def checked_step() -> None:  # on the loop thread, after each step
            step()
            try:
                check_blocks(engine.cache, engine.scheduler, {engine.runner.scratch_block})
            except AssertionError as e:
                failures.append(str(e))
            checked[0] += 1

        engine.stepper.step = checked_step
        futures = []
        for i in range(16):
            prompt = tokens(rng.randint(5, 28), seed=100 * seed + i)
            params = SamplingParams(max_new_tokens=rng.randint(1, 10), ignore_eos=True,
                                    temperature=rng.choice([0.0, 0.8]), seed=i)  # fmt: skip
            tenant = rng.choice(["a", "b", ""])
            kind = rng.random()
            if kind < 0.3:
                g = group(prompt, params, rng.choice([2, 3]), rng.choice([None, 3]))
                for r in g.requests:
                    r.tenant = tenant or None
                engine.add_group(g)
                futures += [r.future for r in g.requests]
                victim = g.requests[-1]
            else:
                retain = (Retain(min(16, len(prompt) - 1), 30.0),) if kind < 0.5 else ()
                victim = Request(prompt, params, tenant=tenant or None, retention=retain)
                engine.add_requests([victim])
                futures.append(victim.future)
            if rng.random() < 0.2:
                engine.cancel(victim)
        for future in futures:
            with contextlib.suppress(Exception):  # the cancelled ones
                future.result(120)
        engine.check_integrity()
    assert failures == [] and checked[0] > 10
