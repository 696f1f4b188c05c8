"""Logprobs: of sampled tokens and of prompt tokens, against a no-cache full forward, even
where a cached prefix skipped the prompt's logits (its blocks' summaries stand in for them);
a perturbed cached block or summary is caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from arch_configs import arch_config
from engine_helpers import BLOCK_SIZE, TOL, micro_cache_config, reference_logits

from engine.loop.engine import Engine
from engine.loop.logprobs import PromptLogprobCache, check_logprobs, prompt_scores
from engine.loop.request import (
    MAX_LOGPROBS,
    GenerateResult,
    InvalidRequestError,
    Request,
    SamplingParams,
)
from engine.loop.scheduler import Scheduler
from engine.loop.scheduler_config import SchedulerConfig
from engine.model.loading import LoadedModel, wrap_model
from engine.model.tiny import byte_tokenizer, random_model
from kvstore.block_tables import BlockTables
from kvstore.cache import PrefixCache

# a logprob is a logit minus the log-sum-exp of them all: within twice the logits' tolerance
LOGPROB_TOL = 2 * TOL
PROMPT = SamplingParams(max_new_tokens=1, prompt_logprobs=3)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def reference_logprobs(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    """log_softmax of one full no-cache forward: row p is the distribution of token p + 1."""
    return torch.log_softmax(reference_logits(model, ids), dim=-1)


def prompt_matches_reference(model: LoadedModel, ids: list[int], result: GenerateResult) -> bool:
    """Every prompt token's logprob, rank and top alternatives' logprobs as the reference's,
    within the tolerance (the first token has none)."""
    ref, got = reference_logprobs(model, ids), result.prompt_logprobs
    if got is None or len(got.logprobs) != len(ids) or got.logprobs[0] is not None:
        return False
    for t in range(1, len(ids)):
        row = ref[t - 1]
        k = len(got.top[t])
        top = torch.topk(row, k).values.tolist()
        if abs(got.logprobs[t] - float(row[ids[t]])) > LOGPROB_TOL:
            return False
        if any(abs(lp - want) > LOGPROB_TOL for (_, lp), want in zip(got.top[t], top, strict=True)):
            return False
    return True


def test_prompt_logprobs_with_a_cached_prefix_equal_a_no_cache_forward(micro) -> None:
    context = tokens(41, seed=1)  # 10 whole blocks and one token
    with Engine(micro, micro_cache_config()) as engine:
        first = engine.generate([context + tokens(7, seed=2)], PROMPT)[0]
        second_ids = context + tokens(9, seed=3)
        second = engine.generate([second_ids], PROMPT)[0]
    assert (first.cached_tokens, second.cached_tokens) == (0, 40)
    assert [len(t) for t in second.prompt_logprobs.top[1:]] == [3] * 49
    assert prompt_matches_reference(micro, second_ids, second)


def test_a_perturbed_cached_block_fails_the_prompt_logprobs_reference(micro) -> None:
    context = tokens(41, seed=1)
    with Engine(micro, micro_cache_config()) as engine:
        engine.generate([context + tokens(7, seed=2)], PROMPT)
        hit = engine.cache.lookup(context)
        engine.cache.pool.kv[hit.block_ids[3]] += 0.5  # every layer, K and V, of block 3
        engine.cache.release(hit)
        second_ids = context + tokens(9, seed=3)
        second = engine.generate([second_ids], PROMPT)[0]
    assert second.cached_tokens == 40
    assert not prompt_matches_reference(micro, second_ids, second)


def test_a_perturbed_summary_fails_the_prompt_logprobs_reference(micro) -> None:
    context = tokens(41, seed=1)
    with Engine(micro, micro_cache_config()) as engine:
        first = engine.generate([context + tokens(7, seed=2)], PROMPT)[0]
        assert first.cached_tokens == 0
        keys = engine.cache.block_keys(context)
        summary = engine.prompt_logprobs.summaries.get(keys[5], np.array(context[20:24]))
        summary.scores.logprob[1] += 0.5  # token 21's
        second_ids = context + tokens(9, seed=3)
        second = engine.generate([second_ids], PROMPT)[0]
    assert second.cached_tokens == 40
    assert not prompt_matches_reference(micro, second_ids, second)


def test_requests_queued_together_wait_for_the_shared_blocks_then_hit_them(micro) -> None:
    context = tokens(44, seed=11)  # 11 whole blocks
    asks = [context + tokens(3, seed=12 + i) for i in range(4)]
    with Engine(micro, micro_cache_config()) as engine:
        requests = engine.add_requests([Request(ids, PROMPT) for ids in asks])
        results = [r.future.result(60) for r in requests]
    assert [r.cached_tokens for r in results] == [0, 44, 44, 44]
    assert all(
        prompt_matches_reference(micro, ids, r) for ids, r in zip(asks, results, strict=True)
    )


def test_a_prefix_cached_without_summaries_is_prefilled_again_once(micro) -> None:
    context = tokens(41, seed=4)
    asks = [context + tokens(5, seed=5 + i) for i in range(3)]
    with Engine(micro, micro_cache_config()) as engine:
        plain = engine.generate([[*context, 1, 2]], SamplingParams(max_new_tokens=1))[0]
        results = [engine.generate([ids], PROMPT)[0] for ids in asks]
    assert plain.cached_tokens == 0
    # the plain request left blocks but no logprobs: the first asking one computes them all
    assert [r.cached_tokens for r in results] == [0, 40, 40]
    assert all(
        prompt_matches_reference(micro, ids, r) for ids, r in zip(asks, results, strict=True)
    )


def test_without_summaries_every_prompt_is_prefilled_whole_and_exact(micro) -> None:
    context = tokens(41, seed=6)
    asks = [context + tokens(5, seed=7 + i) for i in range(2)]
    with Engine(micro, micro_cache_config(), prompt_logprob_blocks=0) as engine:
        results = [engine.generate([ids], PROMPT)[0] for ids in asks]
        plain = engine.generate([asks[0]], SamplingParams(max_new_tokens=1))[0]
    assert [r.cached_tokens for r in results] == [0, 0]
    # the prefix cache itself still serves other requests: 11 blocks and a kept tail
    assert plain.cached_tokens == 46
    assert all(
        prompt_matches_reference(micro, ids, r) for ids, r in zip(asks, results, strict=True)
    )


def test_a_whole_prompt_hit_and_a_chunked_prefill_give_the_same_logprobs(micro) -> None:
    ids = tokens(44, seed=8)  # 11 whole blocks: the repeat hits all of them
    chunks = SchedulerConfig(max_num_batched_tokens=8)
    with Engine(micro, micro_cache_config(), scheduler_config=chunks) as engine:
        first, again = (engine.generate([ids], PROMPT)[0] for _ in "ab")
    assert (first.cached_tokens, again.cached_tokens) == (0, 44)
    assert prompt_matches_reference(micro, ids, first)
    assert prompt_matches_reference(micro, ids, again)


@pytest.mark.parametrize("arch", ["qwen2-hybrid", "mistral-window"])
def test_a_window_models_repeat_hits_and_keeps_exact_prompt_logprobs(arch: str) -> None:
    model = wrap_model(random_model(arch_config(arch), seed=0), byte_tokenizer(), arch)
    ids = tokens(48, seed=16)  # longer than the window (16)
    chunks = SchedulerConfig(max_num_batched_tokens=16)
    with Engine(model, micro_cache_config(), scheduler_config=chunks) as engine:
        first, again = (engine.generate([ids], PROMPT)[0] for _ in "ab")
        engine.cache.check_integrity()
    assert (first.cached_tokens, again.cached_tokens) == (0, 48)
    assert prompt_matches_reference(model, ids, first)
    assert prompt_matches_reference(model, ids, again)


def test_prompts_sharing_steps_and_preempted_keep_exact_logprobs(micro) -> None:
    # 24 blocks: 1 scratch, 23 for 3 requests that each grow to ceil((30 + 40) / 4) = 18
    prompts = [tokens(30, seed=30 + i) for i in range(3)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    with Engine(micro, micro_cache_config(device_blocks=24)) as engine:
        requests = engine.add_requests([Request(p, params) for p in prompts])
        results = [r.future.result(120) for r in requests]
    assert sum(r.num_preemptions for r in requests) >= 1
    for prompt, result in zip(prompts, results, strict=True):
        assert prompt_matches_reference(micro, prompt, result)
        assert len(result.output_logprobs) == 40


def test_output_logprobs_are_of_the_raw_distribution_whatever_the_temperature(micro) -> None:
    prompt = tokens(21, seed=9)
    params = SamplingParams(max_new_tokens=6, temperature=0.7, seed=3, ignore_eos=True, logprobs=4)
    with Engine(micro, micro_cache_config()) as engine:
        result = engine.generate([prompt], params)[0]
    ref = reference_logprobs(micro, prompt + result.output_token_ids)
    assert [e.token_id for e in result.output_logprobs] == result.output_token_ids
    for j, entry in enumerate(result.output_logprobs):
        row = ref[len(prompt) - 1 + j]  # before temperature: not scaled by it
        assert abs(entry.logprob - float(row[entry.token_id])) <= LOGPROB_TOL
        top = torch.topk(row, 4).values.tolist()
        assert len(entry.top) == 4
        assert all(
            abs(lp - want) <= LOGPROB_TOL for (_, lp), want in zip(entry.top, top, strict=True)
        )
    assert result.prompt_logprobs is None


def test_a_resumed_request_looks_up_past_the_prompt_logprobs_it_has(micro) -> None:
    """A preempted request keeps the prompt logprobs it gathered: its lookup may cover
    those blocks without summaries, and it feeds again from the last cached position."""
    cache = PromptLogprobCache(BLOCK_SIZE, capacity=8)
    request = Request(tokens(18, seed=10), PROMPT)
    keys = [bytes([b]) * 16 for b in range(4)]  # 4 whole blocks
    scores = prompt_scores(request)
    fake = torch.zeros(9, 260)
    cache.record(request, 0, fake, keys)  # tokens 1..9: blocks 0 and 1 whole
    assert len(cache.summaries) == 2
    plan = cache.plan(request, keys)
    assert (plan.limit, plan.summaries) == (2 * BLOCK_SIZE, {})
    assert cache.admitted(request, plan, num_cached=8) == 7
    cache.summaries.put(keys[2], scores.block(2, BLOCK_SIZE))  # as if another request's
    plan = cache.plan(request, keys)
    assert (plan.limit, list(plan.summaries)) == (3 * BLOCK_SIZE, [2])


def test_a_step_that_prefills_admits_a_prompt_logprobs_request_only_if_all_it_feeds_fits(
    micro,
) -> None:
    """Its probe counts what it will feed: a cached prefix without summaries is no hit."""
    cache = PrefixCache(micro_cache_config(), micro.namespace(BLOCK_SIZE))
    tables = BlockTables(cache)
    context = tokens(20, seed=13)
    seq = tables.open(context, "", "")  # the context's 5 blocks indexed, as a plain request's
    tables.grow(seq, 20)
    tables.commit(seq, context, 20)
    tables.close(seq)
    logprobs = PromptLogprobCache(BLOCK_SIZE, capacity=64)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16), tables, logprobs)
    a, b = Request(tokens(6, seed=14), PROMPT), Request(context + tokens(4, seed=15), PROMPT)
    for request in (a, b):
        scheduler.add(request)
    fed = []
    for _ in range(2):
        rows = scheduler.schedule(lambda request, error: pytest.fail(str(error)))
        for row in rows:  # what the engine does after the forward
            row.request.state.num_computed = row.start + row.num_new
            if row.start + row.num_new == row.request.num_tokens:
                row.request.emit(1)
        fed.append([(row.request, row.start, row.num_new) for row in rows])
    # b's 24 tokens do not fit beside a's prefill; then it goes first, a chunk of 15
    assert fed == [[(a, 0, 6)], [(a, 6, 1), (b, 0, 15)]]
    for request in (a, b):
        scheduler.finish(request)
    cache.close()


def test_logprobs_fields_are_validated_and_named() -> None:
    for field in ("logprobs", "prompt_logprobs"):
        for bad in (MAX_LOGPROBS + 1, -1, True, 1.0):
            with pytest.raises(InvalidRequestError) as info:
                SamplingParams(**{field: bad})
            assert info.value.field == field
    assert SamplingParams(logprobs=0, prompt_logprobs=MAX_LOGPROBS).prompt_logprobs == 20
    with pytest.raises(InvalidRequestError) as info:
        check_logprobs(SamplingParams(prompt_logprobs=1), batched=False)
    assert info.value.field == "prompt_logprobs"
    check_logprobs(SamplingParams(prompt_logprobs=1), batched=True)
