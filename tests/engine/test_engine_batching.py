"""Continuous batching over the paged pool: each request meets its own no-cache reference
whatever it shares a step with (prompt lengths, cached prefixes from different tiers, a
cancelled neighbour, preemption), and a perturbed cached block is caught."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from engine_helpers import greedy_matches_reference, micro_cache_config

from engine.loop.engine import Engine
from engine.loop.request import Request, RequestCancelled, SamplingParams
from engine.loop.scheduler import Scheduler
from engine.loop.scheduler_config import SchedulerConfig
from engine.model.loading import LoadedModel
from kvstore.block_tables import BlockTables
from kvstore.cache import PrefixCache

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
BS = 4


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def run_together(engine: Engine, prompts: list[list[int]], params=GREEDY) -> list:
    """All prompts queued at once, so they share steps."""
    requests = engine.add_requests([Request(p, params) for p in prompts])
    return [r.future.result(60) for r in requests]


def test_a_mixed_batch_meets_each_requests_reference(micro: LoadedModel, tmp_path) -> None:
    system = tokens(24, seed=1)
    config = micro_cache_config(lmdb_dir=str(tmp_path), lmdb_write_policy="write-through")
    with Engine(micro, config) as warm:  # system prompt + one whole prompt into LMDB
        warm.generate([system + tokens(5, 2)], GREEDY)
    sched = SchedulerConfig(max_num_batched_tokens=16)  # prefill in chunks beside decodes
    with Engine(micro, config, scheduler_config=sched) as engine:
        engine.generate([tokens(9, 3)], GREEDY)  # on the device only
        prompts = [
            system + tokens(5, 2),  # LMDB: the whole prompt's blocks
            tokens(9, 3),  # device: 8 of 9 tokens
            system + tokens(30, 4),  # LMDB prefix, then a chunked suffix
            tokens(3, 5),  # under one block: nothing to cache
            tokens(61, 6),  # a miss, prefilled over 4 steps
        ]
        results = run_together(engine, prompts)
        engine.cache.check_integrity()
    assert [r.cached_tokens for r in results] == [28, 8, 24, 0, 0]
    assert results[0].cached_by_tier == {"lmdb": 28}
    assert results[1].cached_by_tier == {"device": 8}
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.output_token_ids) == 10
        assert greedy_matches_reference(micro, prompt, result.output_token_ids)


def test_batched_text_equals_one_at_a_time_text(micro: LoadedModel) -> None:
    prompts = [tokens(n, seed=10 + n) for n in (5, 12, 17, 33, 40, 7, 26, 19)]
    with Engine(micro, micro_cache_config()) as alone:
        single = [alone.generate([p], GREEDY)[0].output_token_ids for p in prompts]
    with Engine(micro, micro_cache_config()) as engine:
        batched = [r.output_token_ids for r in run_together(engine, prompts)]
    assert batched == single


def test_a_cancelled_request_leaves_its_neighbours_correct(micro: LoadedModel) -> None:
    prompts = [tokens(18, seed=20), tokens(22, seed=21), tokens(9, seed=22)]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    with Engine(micro, micro_cache_config()) as engine:
        requests = [Request(p, params) for p in prompts]
        seen = threading.Event()

        def cancel_after_3(token_id: int, request=requests[1]) -> None:
            if len(request.output) == 3:
                engine.cancel(request)
                seen.set()

        requests[1].on_token = cancel_after_3
        engine.add_requests(requests)
        with pytest.raises(RequestCancelled):
            requests[1].future.result(60)
        others = [requests[0].future.result(60), requests[2].future.result(60)]
        assert seen.is_set() and len(requests[1].output) == 3  # no token after the cancel
        engine.cache.check_integrity()
    for prompt, result in zip([prompts[0], prompts[2]], others, strict=True):
        assert len(result.output_token_ids) == 30
        assert greedy_matches_reference(micro, prompt, result.output_token_ids)


def test_an_exhausted_pool_preempts_the_newest_request_and_resumes_it(micro) -> None:
    # 24 blocks: 1 scratch, 23 for 3 requests that each grow to ceil((30 + 40) / 4) = 18
    prompts = [tokens(30, seed=30 + i) for i in range(3)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    with Engine(micro, micro_cache_config(device_blocks=24)) as engine:
        requests = engine.add_requests([Request(p, params) for p in prompts])
        results = [r.future.result(120) for r in requests]
        engine.cache.check_integrity()
    assert sum(r.num_preemptions for r in requests) >= 1
    assert requests[0].num_preemptions == 0  # the oldest runs through
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.output_token_ids) == 40
        assert greedy_matches_reference(micro, prompt, result.output_token_ids)


def test_a_perturbed_cached_block_fails_the_reference(micro: LoadedModel) -> None:
    prompt = tokens(41, seed=40)
    with Engine(micro, micro_cache_config()) as engine:
        first = engine.generate([prompt], GREEDY)[0]
        assert greedy_matches_reference(micro, prompt, first.output_token_ids)
        hit = engine.cache.lookup(prompt)
        engine.cache.pool.kv[hit.block_ids[3]] += 2.0  # one cached block, every layer
        engine.cache.release(hit)
        again = engine.generate([prompt], GREEDY)[0]
    assert again.cached_tokens == 40
    assert not greedy_matches_reference(micro, prompt, again.output_token_ids)


def test_a_step_that_already_prefills_admits_only_prompts_that_fit_whole(micro) -> None:
    """Under a burst, prompts are prefilled one after another, not split across steps beside
    each other: the first finishes a step sooner, and no prompt waits for another's chunk."""
    cache = PrefixCache(micro_cache_config(), micro.namespace(BS))
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16), BlockTables(cache))
    a, b, c = (Request(tokens(n, seed=70 + n), GREEDY) for n in (6, 20, 4))
    for request in (a, b, c):
        scheduler.add(request)

    def step() -> list[tuple[Request, int]]:
        rows = scheduler.schedule(lambda request, error: pytest.fail(str(error)))
        for row in rows:  # what the engine does after the forward
            row.request.state.num_computed = row.start + row.num_new
            if row.start + row.num_new == row.request.num_tokens:
                row.request.emit(1)
        return [(row.request, row.num_new) for row in rows]

    lookups = []
    for want in (
        [(a, 6)],  # b would get 10 of its 20 tokens; c waits behind b
        [(a, 1), (b, 15)],  # the first prefill of a step may be a chunk
        [(a, 1), (b, 5), (c, 4)],  # c fits whole beside b's last chunk
    ):
        assert step() == want
        lookups.append(cache.metrics.get("lookups_total"))
    assert lookups == [1, 2, 3]  # a request held back is probed, not looked up
    for request in (a, b, c):
        scheduler.finish(request)
    cache.close()


def test_the_step_budget_defaults_by_device_and_an_explicit_one_is_kept() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert SchedulerConfig().for_device(cpu).max_num_batched_tokens == 256
    assert SchedulerConfig().for_device(cuda).max_num_batched_tokens == 2048
    assert SchedulerConfig(max_num_batched_tokens=64).for_device(cuda).max_num_batched_tokens == 64
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an int >= 1"):
        SchedulerConfig(max_num_batched_tokens=0)


def test_sampling_is_per_request_and_reproducible_by_seed(micro: LoadedModel) -> None:
    prompt = tokens(14, seed=50)
    hot = SamplingParams(max_new_tokens=12, temperature=1.5, top_p=0.9, seed=7, ignore_eos=True)
    with Engine(micro, micro_cache_config()) as engine:
        a, greedy, b = run_together(engine, [prompt, prompt, prompt], hot)[0], None, None
        greedy = engine.generate([prompt], GREEDY)[0]
        b = run_together(engine, [tokens(20, 51), prompt], hot)[1]
    assert a.output_token_ids == b.output_token_ids  # same seed, other neighbours
    assert a.output_token_ids != greedy.output_token_ids[:12]


def test_the_model_stays_plain_sdpa_for_other_callers(micro: LoadedModel) -> None:
    prompt = tokens(10, seed=70)
    with torch.inference_mode():
        before = micro.model(
            input_ids=torch.tensor([prompt], device=micro.device), use_cache=False
        ).logits
    with Engine(micro, micro_cache_config()) as engine:
        engine.generate([prompt], GREEDY)
        with torch.inference_mode():
            after = micro.model(
                input_ids=torch.tensor([prompt], device=micro.device), use_cache=False
            ).logits
    assert torch.equal(before, after)


def test_cancelling_a_preempted_request_ends_it(micro: LoadedModel) -> None:
    """A request that ran, was preempted and waits to resume has a running future: a
    cancel must end it (RequestCancelled), not leave it waiting forever."""
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    two = threading.Event()
    with Engine(micro, micro_cache_config()) as engine:
        request = Request(tokens(9, seed=70), params, on_token=lambda _: two.set())
        engine.add_requests([request])
        assert two.wait(30)
        engine.on_loop(lambda: (engine.scheduler.preempt(request), engine.cancel(request)))
        with pytest.raises(RequestCancelled):
            request.future.result(30)
        engine.cache.check_integrity()
