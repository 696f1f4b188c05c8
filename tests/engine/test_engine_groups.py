"""Parallel sampling: a group of n sequences of one prompt (engine/loop/group.py) prefills
the prompt once, shares its full blocks by reference and copies only its partly filled block
once per other sequence, is admitted as one unit, and gives each sequence the tokens of an
independent request with its seed."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest
import torch
import xxhash
from arch_configs import arch_config
from engine_helpers import TOL, greedy_matches_reference, micro_cache_config, reference_logits

from engine.loop.engine import Engine
from engine.loop.group import SequenceGroup, branch_params, unreleased_leader
from engine.loop.request import InvalidRequestError, Request, RequestCancelled, SamplingParams
from engine.loop.scheduler import Scheduler
from engine.loop.scheduler_config import SchedulerConfig
from engine.model.loading import LoadedModel, wrap_model
from engine.model.tiny import byte_tokenizer, random_model
from kvstore.block_tables import BlockTables
from kvstore.cache import PrefixCache

BS = 4
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def group_of(prompt: list[int], params: SamplingParams, n: int) -> SequenceGroup:
    return SequenceGroup([Request(list(prompt), p) for p in branch_params(params, n)])


def run_group(engine: Engine, group: SequenceGroup) -> list:
    engine.add_group(group)
    return [request.future.result(60) for request in group.requests]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_each_sequence_of_a_group_is_the_independent_request_with_its_seed(micro, params):
    prompt = tokens(10, seed=1)
    with Engine(micro, micro_cache_config()) as engine:
        group = [r.output_token_ids for r in run_group(engine, group_of(prompt, params, 4))]
        engine.cache.check_integrity()
    alone = []
    for branch in branch_params(params, 4):  # each on an engine of its own: nothing shared
        with Engine(micro, micro_cache_config()) as engine:
            alone.append(engine.generate([prompt], branch)[0].output_token_ids)
    assert group == alone
    if params.seed is not None:
        assert [p.seed for p in branch_params(params, 4)] == [5, 6, 7, 8]
        assert len({tuple(t) for t in group}) == 4


@pytest.mark.parametrize(
    ("num_prompt", "prompt_blocks", "per_branch"),
    [
        (10, 2, 2),  # 2 full blocks + 2 tokens: the partial block is copied (4 positions
        # of output need 15 positions of K/V: blocks 2 and 3 are each sequence's own)
        (12, 3, 2),  # 3 full blocks: each sequence's own blocks start at its first decode
    ],
)
def test_a_group_allocates_the_prompts_blocks_once(micro, num_prompt, prompt_blocks, per_branch):
    prompt, n = tokens(num_prompt, seed=2), 4
    with Engine(micro, micro_cache_config()) as engine:
        before = engine.cache.pool.num_allocated
        results = run_group(engine, group_of(prompt, GREEDY, n))
        cache = engine.cache
        allocated = cache.pool.num_allocated - before
        tail_tokens = cache.metrics.get("tail_hits_tokens_total")
        cache.check_integrity()
        unheld = cache.pool.num_free_blocks + cache.index.num_evictable_blocks + len(cache.tails)
        assert cache.pool.num_blocks - unheld == 1  # the engine's scratch block: no leak
    assert allocated == prompt_blocks + n * per_branch
    # the others computed only the prompt's last token: every other one was cached
    assert [r.cached_tokens for r in results] == [0] + [num_prompt] * (n - 1)
    assert tail_tokens == (n - 1) * (num_prompt % BS)  # one copy of the partial block each


def test_a_group_that_could_never_run_at_once_is_refused_before_it_queues(micro) -> None:
    prompt = tokens(30, seed=3)  # 8 blocks with its first decode slot
    config = SchedulerConfig(max_num_seqs=5)
    with Engine(micro, micro_cache_config(device_blocks=12), scheduler_config=config) as engine:
        with pytest.raises(InvalidRequestError, match="need 12 blocks") as info:
            engine.add_group(group_of(prompt, GREEDY, 5))  # 8 + 4 > 11 usable
        assert info.value.field == "n"
        with pytest.raises(InvalidRequestError, match="at most 5 run together") as info:
            engine.add_group(group_of(prompt, GREEDY, 6))
        assert info.value.field == "n"
        assert engine.queue_stats().waiting == 0
        results = run_group(engine, group_of(prompt, GREEDY, 4))  # 8 + 3 = 11: it fits
    assert len({tuple(r.output_token_ids) for r in results}) == 1


def fake_step(scheduler: Scheduler) -> list[tuple[Request, int]]:
    """One step as the engine takes it, without a forward: rows, their full blocks
    committed, one token for each row that reached its end, and for the other sequences of
    a group whose leader's prompt is now computed (the group released)."""
    rows = scheduler.schedule(lambda request, error: pytest.fail(str(error)))
    sampled = []
    for row in rows:
        state, end = row.request.state, row.start + row.num_new
        state.num_computed = end
        scheduler.tables.commit(state.blocks, row.request.token_slice(0, end), end)
        if end == row.request.num_tokens:
            sampled.append(row.request)
            if (group := unreleased_leader(row.request)) is not None:
                scheduler.release_group(group)
                sampled += group.waiting
    for request in sampled:
        request.emit(1)
    return [(row.request, row.num_new) for row in rows]


def test_a_group_waits_for_room_for_all_its_sequences_and_starts_them_together(micro) -> None:
    cache = PrefixCache(micro_cache_config(device_blocks=16), micro.namespace(BS))
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockTables(cache))
    other = Request(tokens(40, seed=4), GREEDY)  # 10 blocks: 6 left, the group needs 3 + 3
    scheduler.add(other)
    assert fake_step(scheduler) == [(other, 40)]
    group = group_of(tokens(10, seed=5), GREEDY, 4)
    leader, *branches = group.requests
    scheduler.add(leader)
    assert fake_step(scheduler) == [(other, 1)]  # one block short: the leader waits
    scheduler.finish(other)  # its blocks are cached: evictable
    assert fake_step(scheduler) == [(leader, 10)]  # its prompt computed: the group released
    assert fake_step(scheduler) == [(leader, 1)] + [(b, 1) for b in branches]  # together
    assert [b.num_cached_tokens for b in branches] == [10] * 3
    for request in group.requests:
        scheduler.finish(request)
    cache.check_integrity()
    cache.close()


def test_released_sequences_wait_together_until_the_pool_holds_them_all(micro) -> None:
    cache = PrefixCache(micro_cache_config(device_blocks=16), micro.namespace(BS))
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockTables(cache))
    group = group_of(tokens(10, seed=6), GREEDY, 3)  # starts with 3 + 2 blocks
    leader, *branches = group.requests
    later = Request(tokens(47, seed=7), GREEDY)  # admitted beside the leader: 12 blocks
    scheduler.add(leader)
    scheduler.add(later)
    assert fake_step(scheduler) == [(leader, 10), (later, 47)]  # 1 block left; 2 needed
    small = Request(tokens(3, seed=8), GREEDY)  # 1 block: it would fit, but waits behind
    scheduler.add(small)
    assert fake_step(scheduler) == [(leader, 1), (later, 1)]
    scheduler.finish(later)
    assert fake_step(scheduler) == [(leader, 1), *((b, 1) for b in branches), (small, 3)]
    for request in [*group.requests, small]:
        scheduler.finish(request)
    cache.check_integrity()
    cache.close()


def test_a_cancelled_leader_that_never_started_ends_its_sequences(micro) -> None:
    config = SchedulerConfig(max_num_seqs=2)
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)
    with Engine(micro, micro_cache_config(), scheduler_config=config) as engine:
        busy = engine.add_requests([Request(tokens(8, seed=9 + i), long) for i in range(2)])
        group = group_of(tokens(8, seed=11), GREEDY, 2)
        engine.add_group(group)
        engine.cancel(group.leader)  # still waiting: both running slots are taken
        with pytest.raises(RequestCancelled, match="its group was cancelled"):
            group.requests[1].future.result(30)
        assert group.leader.future.cancelled()
        for request in busy:
            request.future.result(60)
        engine.cache.check_integrity()


def test_each_sequence_counts_the_log_probability_of_its_tokens(micro: LoadedModel) -> None:
    prompt = tokens(9, seed=12)
    group = group_of(prompt, SEEDED, 3)
    for request in group.requests:
        request.cumulative_logprob = 0.0
    with Engine(micro, micro_cache_config()) as engine:
        results = run_group(engine, group)
    for request, result in zip(group.requests, results, strict=True):
        out = result.output_token_ids
        logprobs = torch.log_softmax(reference_logits(micro, prompt + out), -1)
        want = sum(float(logprobs[len(prompt) - 1 + k, t]) for k, t in enumerate(out))
        assert request.cumulative_logprob == pytest.approx(want, abs=1e-3)


def test_a_group_streams_each_sequences_tokens_to_its_own_callback(micro) -> None:
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    lock = threading.Lock()

    def on_token(index: int):
        def push(token: int) -> None:
            with lock:
                seen[index].append(token)

        return push

    params = branch_params(SEEDED, 3)
    group = SequenceGroup([Request(tokens(7, 13), p, on_token=on_token(i))
                           for i, p in enumerate(params)])  # fmt: skip
    with Engine(micro, micro_cache_config()) as engine:
        results = run_group(engine, group)
    assert [seen[i] for i in range(3)] == [r.output_token_ids for r in results]


def test_sequences_that_stop_at_their_first_token_take_no_block_of_their_own(micro) -> None:
    prompt = tokens(10, seed=14)
    one = SamplingParams(max_new_tokens=1, temperature=1.0, seed=20)
    with Engine(micro, micro_cache_config()) as engine:
        before = engine.cache.pool.num_allocated
        results = run_group(engine, group_of(prompt, one, 4))
        assert engine.cache.pool.num_allocated - before == 3  # the leader's prompt only
        engine.generate([tokens(5, seed=15)], GREEDY)  # the loop went on: nothing left held
        assert not engine.scheduler.released
        engine.cache.check_integrity()
    firsts = []
    for branch in branch_params(one, 4):
        with Engine(micro, micro_cache_config()) as engine:
            firsts.append(engine.generate([prompt], branch)[0].output_token_ids)
    assert [r.output_token_ids for r in results] == firsts
    assert [r.finish_reason for r in results] == ["length"] * 4


@pytest.mark.parametrize("arch", ["mistral-window", "qwen2-hybrid"])
def test_a_window_models_group_meets_the_reference_and_its_independent_requests(arch) -> None:
    model = wrap_model(random_model(arch_config(arch), seed=0), byte_tokenizer(), arch)
    prompt = tokens(30, seed=16)  # longer than the window: the leader lets blocks go
    with Engine(model, micro_cache_config()) as engine:
        greedy = run_group(engine, group_of(prompt, GREEDY, 3))
        seeded = run_group(engine, group_of(prompt, SEEDED, 3))
        engine.cache.check_integrity()
    for result in greedy:
        assert greedy_matches_reference(model, prompt, result.output_token_ids)
    alone = []
    for branch in branch_params(SEEDED, 3):
        with Engine(model, micro_cache_config()) as engine:
            alone.append(engine.generate([prompt], branch)[0].output_token_ids)
    assert [r.output_token_ids for r in seeded] == alone


def test_a_groups_prompt_is_hashed_once(micro, monkeypatch) -> None:
    prompt = tokens(240, seed=17)  # 60 blocks
    with Engine(micro, micro_cache_config()) as engine:
        engine.generate([[1, 2, 3, 4, 5]], GREEDY)  # the engine's first-step work, uncounted
        digests, digest = [], xxhash.xxh3_128_digest
        monkeypatch.setattr(
            xxhash, "xxh3_128_digest", lambda *a, **k: digests.append(1) or digest(*a, **k)
        )
        run_group(engine, group_of(prompt, GREEDY, 4))
    # the prompt's 60 blocks once, then the block each sequence fills (positions 240..243)
    assert len(digests) == 60 + 4


def test_the_per_request_fallback_runs_a_groups_sequences_one_by_one(micro) -> None:
    prompt = tokens(9, seed=18)
    group = group_of(prompt, SEEDED, 3)
    for request in group.requests:
        request.cumulative_logprob = 0.0
    with Engine(micro, micro_cache_config(device_blocks=6)) as engine:  # no room to self-test
        assert engine.mode == "sequential"
        results = run_group(engine, group)
    alone = []
    for branch in branch_params(SEEDED, 3):
        with Engine(micro, micro_cache_config()) as engine:
            alone.append(engine.generate([prompt], branch)[0].output_token_ids)
    assert [r.output_token_ids for r in results] == alone
    for request, out in zip(group.requests, alone, strict=True):
        logprobs = torch.log_softmax(reference_logits(micro, prompt + out), -1)
        want = sum(float(logprobs[len(prompt) - 1 + k, t]) for k, t in enumerate(out))
        assert request.cumulative_logprob == pytest.approx(want, abs=1e-3)
    with Engine(micro, micro_cache_config(device_blocks=6)) as engine:  # logprobs: refused
        for field in ("logprobs", "prompt_logprobs"):
            params = replace(SEEDED, **{field: 1})
            with pytest.raises(InvalidRequestError, match=field) as info:
                engine.add_group(group_of(prompt, params, 3))
            assert info.value.field == field
        assert engine.queue_stats().waiting == 0


LOGPROBS = SamplingParams(max_new_tokens=4, temperature=1.0, seed=30, ignore_eos=True,
                          logprobs=2, prompt_logprobs=3)  # fmt: skip


def same_logprobs(got: list[tuple], want: list[tuple]) -> bool:
    """(token id, logprob) pairs: the same ids, logprobs within twice the logits' tolerance."""
    return len(got) == len(want) and all(
        g[0] == w[0] and abs(g[1] - w[1]) <= 2 * TOL for g, w in zip(got, want, strict=True)
    )


@pytest.mark.parametrize("arch", [None, "mistral-window"])
def test_each_sequence_has_the_logprobs_of_its_independent_request(micro, arch) -> None:
    # the others' prompt logprobs are the leader's (their own prompt is never prefilled; a
    # window model's compute its partial block again)
    model = micro if arch is None else wrap_model(
        random_model(arch_config(arch), seed=0), byte_tokenizer(), arch
    )  # fmt: skip
    prompt = tokens(14, seed=19)  # 3 whole blocks and 2 tokens
    with Engine(model, micro_cache_config()) as engine:
        group = run_group(engine, group_of(prompt, LOGPROBS, 3))
        engine.cache.check_integrity()
    for branch, result in zip(branch_params(LOGPROBS, 3), group, strict=True):
        with Engine(model, micro_cache_config()) as engine:
            alone = engine.generate([prompt], branch)[0]
        assert result.output_token_ids == alone.output_token_ids
        got, want = result.output_logprobs, alone.output_logprobs
        assert [len(e.top) for e in got] == [2] * 4
        assert same_logprobs([(e.token_id, e.logprob) for e in got],
                             [(e.token_id, e.logprob) for e in want])  # fmt: skip
        for mine, its in zip(got, want, strict=True):
            assert same_logprobs(mine.top, its.top)
        got_prompt, want_prompt = result.prompt_logprobs, alone.prompt_logprobs
        assert got_prompt.logprobs[0] is None and got_prompt.ranks == want_prompt.ranks
        pairs = zip(got_prompt.logprobs[1:], want_prompt.logprobs[1:], strict=True)
        assert all(abs(a - b) <= 2 * TOL for a, b in pairs)
        tops = zip(got_prompt.top[1:], want_prompt.top[1:], strict=True)
        assert all(same_logprobs(a, b) for a, b in tops)
