"""Async scheduling (engine/loop/overlap.py): a step launches before the previous step's
greedy tokens reach the host, each pending token fed to its next row from the device and
delivered one step late. Forced on here (a CPU's default is off): every result (tokens,
text, finish reason, cached tokens, streaming order) equals the synchronous engine's, for
stops, EOS, `n`, logprobs, streaming and preemption."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import greedy_matches_reference, micro_cache_config, micro_model

from engine.loop.engine import Engine
from engine.loop.graph import GraphConfig
from engine.loop.group import SequenceGroup, branch_params
from engine.loop.overlap import Overlap
from engine.loop.request import Request, SamplingParams
from engine.loop.scheduler_config import SchedulerConfig

ASYNC, SYNC = SchedulerConfig(async_scheduling=True), SchedulerConfig(async_scheduling=False)
GRAPHS = {"graphs": GraphConfig("auto"), "eager": GraphConfig("off")}


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


PROMPTS = [tokens(n, seed=n) for n in (5, 13, 9, 22, 3)]


def run(steps: SchedulerConfig, graphs: str, params, prompts=PROMPTS, **cache) -> tuple:
    """(results, streamed tokens per request, launches of device sampling)."""
    model = micro_model(seed=21)
    streamed: list[list[int]] = [[] for _ in prompts]
    config = micro_cache_config(**cache)
    with Engine(model, config, scheduler_config=steps, graph_config=GRAPHS[graphs]) as engine:
        launches = count_launches(engine)
        requests = [Request(p, params, on_token=streamed[i].append) for i, p in enumerate(prompts)]
        results = [r.future.result(120) for r in engine.add_requests(requests)]
        engine.cache.check_integrity()
        preemptions = sum(r.num_preemptions for r in requests)
    return results, streamed, launches[0], preemptions


def count_launches(engine: Engine) -> list[int]:
    count = [0]
    launch = engine.overlap.launch

    def counted(requests, logits):
        count[0] += 1
        launch(requests, logits)

    engine.overlap.launch = counted
    return count


def same(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.output_token_ids == y.output_token_ids
        assert (x.text, x.finish_reason, x.cached_tokens) == (y.text, y.finish_reason,
                                                              y.cached_tokens)  # fmt: skip


@pytest.mark.parametrize("graphs", list(GRAPHS))
def test_async_greedy_decoding_gives_the_synchronous_results(graphs):
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    sync, sync_streamed, _, _ = run(SYNC, graphs, params)
    out, streamed, launches, _ = run(ASYNC, graphs, params)
    same(out, sync)
    assert streamed == sync_streamed == [r.output_token_ids for r in out]
    assert launches >= 15  # every decode step sampled on the device
    model = micro_model(seed=21)
    assert all(greedy_matches_reference(model, p, r.output_token_ids) for p, r in
               zip(PROMPTS, out, strict=True))  # fmt: skip


def test_stop_tokens_and_stop_strings_end_at_the_synchronous_token():
    """The token that ends a request is known a step late; the row it was given meanwhile
    is dropped, and nothing past the stop reaches the client."""
    free = SamplingParams(max_new_tokens=16, ignore_eos=True)
    base, _, _, _ = run(SYNC, "graphs", free)
    stop_ids = tuple({r.output_token_ids[5] for r in base})  # each stops by its 6th token
    by_id = SamplingParams(max_new_tokens=16, stop_token_ids=stop_ids)
    sync, sync_streamed, _, _ = run(SYNC, "graphs", by_id)
    out, streamed, _, _ = run(ASYNC, "graphs", by_id)
    same(out, sync)
    assert streamed == sync_streamed
    assert all(r.finish_reason == "stop" and len(r.output_token_ids) <= 6 for r in out)
    text = base[1].text
    by_text = SamplingParams(max_new_tokens=16, ignore_eos=True, stop=(text[4:6],))
    sync, _, _, _ = run(SYNC, "graphs", by_text)
    out, _, _, _ = run(ASYNC, "graphs", by_text)
    same(out, sync)
    assert out[1].finish_reason == "stop"


def test_one_token_requests_and_length_limits_match():
    for n in (1, 2, 3):
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        sync, _, _, _ = run(SYNC, "graphs", params)
        out, _, _, _ = run(ASYNC, "graphs", params)
        same(out, sync)


def test_preemption_under_a_small_pool_matches():
    """24 blocks for 3 requests that grow to 18 each: the newest is preempted, some while
    their token is still on the device."""
    prompts = [tokens(30, seed=30 + i) for i in range(3)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    sync, _, _, sync_preempted = run(SYNC, "graphs", params, prompts, device_blocks=24)
    out, _, launches, preempted = run(ASYNC, "graphs", params, prompts, device_blocks=24)
    assert preempted >= 1 and sync_preempted >= 1 and launches > 0
    same(out, sync)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2),
        SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, seed=5),
    ],
    ids=["logprobs", "sampled"],
)
def test_steps_that_need_their_logits_on_the_host_stay_synchronous(params):
    sync, _, _, _ = run(SYNC, "graphs", params)
    out, _, launches, _ = run(ASYNC, "graphs", params)
    assert launches == 0
    same(out, sync)
    if params.logprobs is not None:
        assert [r.output_logprobs for r in out] == [r.output_logprobs for r in sync]


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_parallel_sequences_match(temperature):
    """n = 3: the leader's group is released in a synchronous step, then each sequence
    runs as any request (greedy ones on the device)."""
    model = micro_model(seed=22)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=temperature, seed=3)
    results = {}
    for name, steps in (("sync", SYNC), ("async", ASYNC)):
        with Engine(model, micro_cache_config(), scheduler_config=steps) as engine:
            group = SequenceGroup([Request(list(PROMPTS[3]), p) for p in branch_params(params, 3)])
            engine.add_group(group)
            results[name] = [r.future.result(60).output_token_ids for r in group.requests]
            engine.cache.check_integrity()
    assert results["async"] == results["sync"]


def test_a_wrong_pending_token_changes_the_output(monkeypatch):
    """Control: feeding a row another request's pending token is visible in the results."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    sync, _, _, _ = run(SYNC, "eager", params)
    feed = Overlap.feed

    def shuffled(self, requests):
        got = feed(self, requests)
        return None if got is None else got._replace(slots=got.slots[::-1])

    monkeypatch.setattr(Overlap, "feed", shuffled)
    out, _, _, _ = run(ASYNC, "eager", params)
    assert [r.output_token_ids for r in out] != [r.output_token_ids for r in sync]
