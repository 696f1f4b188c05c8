"""The timed paths of `bench e2e` (see bench/e2e.py): HF `generate` without a cache, the
engine without a cache, the engine's prefill of each reusable prefix, the engine with its
prefix handed over for free in memory, and kvstore."""

from __future__ import annotations

import time
from functools import partial
from typing import NamedTuple

import torch
from transformers import DynamicCache

from bench.ttft.point import FirstTokenClock
from engine.loop.sequential import forward_on


class RunResult(NamedTuple):
    total_s: float
    outputs: list[list[int]]
    ttfts: list[float]  # per request
    cached_tokens: int


def run_nocache(engine, lm, prompts: list[list[int]], new_tokens: int, bar) -> RunResult:
    """HF `generate` as a user runs it (the model's own kernels), on the engine's thread: the
    process keeps one OpenMP team (engine/loop/threads.py)."""
    outputs, ttfts = [], []
    start = time.perf_counter()
    for ids in prompts:
        timed = partial(generate_timed, lm, ids, new_tokens)
        output, ttft = engine.on_loop(timed, step_kernels=False)
        outputs.append(output)
        ttfts.append(ttft)
        bar.update(1)
    return RunResult(time.perf_counter() - start, outputs, ttfts, 0)


def run_engine_nocache(engine, prompts: list[list[int]], new_tokens: int, bar) -> RunResult:
    """The engine with nothing cached: its pool is emptied, untimed, before each request."""
    from engine.loop.engine import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    total, outputs, ttfts = 0.0, [], []
    for ids in prompts:
        engine.cache.evict_device()
        start = time.perf_counter()
        result = engine.run(ids, params)
        total += time.perf_counter() - start
        outputs.append(result.output_token_ids)
        ttfts.append(result.ttft_s)
        bar.update(1)
    return RunResult(total, outputs, ttfts, 0)


def run_prefixes(engine, prompts: list[list[int]], reusable: list[int], bar) -> float:
    """The engine's prefill of each request's reusable prefix alone, on an empty pool, summed."""
    total = 0.0
    for ids, n in zip(prompts, reusable, strict=True):
        if n:
            engine.cache.evict_device()
            start = time.perf_counter()
            engine.prefill(ids[:n])
            total += time.perf_counter() - start
        bar.update(1)
    return total


def generate_timed(lm, ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    """HF `generate`, greedy, without a prefix cache: the generated tokens and the TTFT."""
    model = lm.model
    clock, start = FirstTokenClock(), time.perf_counter()
    out = model.generate(
        torch.tensor([ids], device=lm.device),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=lm.device),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=model.config.pad_token_id,
        streamer=clock,
    )
    return out[0, len(ids) :].tolist(), clock.first - start


def run_kvstore(engine, prompts: list[list[int]], new_tokens: int, bar) -> RunResult:
    from engine.loop.engine import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    outputs, ttfts, cached = [], [], 0
    start = time.perf_counter()
    for ids in prompts:
        result = engine.run(ids, params)
        outputs.append(result.output_token_ids)
        ttfts.append(result.ttft_s)
        cached += result.cached_tokens
        bar.update(1)
    return RunResult(time.perf_counter() - start, outputs, ttfts, cached)


def run_free_prefix(engine, lm, prompts: list[list[int]], reusable: list[int], new_tokens: int,
                    bar) -> RunResult:  # fmt: skip
    """The ideal engine of `bench ttft` (docs/BENCHMARKS.md): each request's reusable prefix
    is already in memory as a `DynamicCache` (built untimed), the suffix is prefilled on it
    and `new_tokens` decoded greedily, as the engine does (its thread, its linear kernels);
    no lookup, load or store."""
    total, outputs, ttfts = 0.0, [], []
    for ids, n in zip(prompts, reusable, strict=True):
        out, ttft, elapsed = engine.on_loop(partial(_free_prefix, lm, ids, n, new_tokens))
        total += elapsed
        ttfts.append(ttft)
        outputs.append(out)
        bar.update(1)
    return RunResult(total, outputs, ttfts, sum(reusable))


def _free_prefix(lm, ids: list[int], n: int, new_tokens: int) -> tuple[list[int], float, float]:
    """(tokens, TTFT, seconds) of one request on a prefix of n tokens built untimed."""
    past = DynamicCache(config=lm.model.config)
    if n:
        forward_on(lm.model, ids[:n], past)
    start = time.perf_counter()
    out = [int(torch.argmax(forward_on(lm.model, ids[n:], past)))]
    ttft = time.perf_counter() - start
    while len(out) < new_tokens:
        out.append(int(torch.argmax(forward_on(lm.model, out[-1:], past))))
    return out, ttft, time.perf_counter() - start
