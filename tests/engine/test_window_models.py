"""Sliding-window and hybrid models: cached output meets the no-cache reference in mixed
batches and through LMDB; a window layer never reads a block outside its window, a full
layer of a hybrid model reads them all; Gemma 2's softcapping is applied."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from arch_configs import arch_config
from engine_helpers import close_to_reference, micro_cache_config, reference_logits
from transformers import DynamicCache

from engine.contract import greedy_matches_reference
from engine.engine import Engine
from engine.model import (
    LoadedModel,
    byte_tokenizer,
    kv_cache,
    random_model,
    with_cache,
    wrap_model,
)
from engine.request import Request, SamplingParams
from engine.scheduler import SchedulerConfig

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def model_of(arch: str) -> LoadedModel:
    return wrap_model(random_model(arch_config(arch), seed=0), byte_tokenizer(), arch)


@pytest.mark.parametrize("arch", ["gemma2", "qwen2-hybrid", "mistral-window"])
def test_a_mixed_batch_through_lmdb_meets_each_requests_reference(arch: str, tmp_path) -> None:
    model, system = model_of(arch), tokens(24, seed=1)  # longer than every window
    config = micro_cache_config(lmdb_dir=str(tmp_path), lmdb_write_policy="write-through")
    with Engine(model, config) as warm:
        warm.generate([system + tokens(5, 2)], GREEDY)
    sched = SchedulerConfig(max_num_batched_tokens=16)
    with Engine(model, config, scheduler_config=sched) as engine:
        prompts = [system + tokens(5, 2), system + tokens(30, 4), tokens(3, 5), tokens(41, 6)]
        requests = engine.add_requests([Request(p, GREEDY) for p in prompts])
        results = [r.future.result(60) for r in requests]
        assert engine.mode == "paged"
        engine.cache.check_integrity()
    assert [r.cached_tokens for r in results] == [28, 24, 0, 0]
    assert results[0].cached_by_tier == {"lmdb": 28}
    for prompt, result in zip(prompts, results, strict=True):
        assert greedy_matches_reference(model, prompt, result.output_token_ids)


def perturbed_prefill(arch: str, block: int) -> bool:
    """Cache 40 tokens, add 0.5 to one cached block (every layer, K and V), prefill the same
    40 again (36 cached: queries at 36..39). Whether the logits still meet the reference."""
    model, ids = model_of(arch), tokens(40, seed=7)
    with Engine(model, micro_cache_config()) as engine:
        assert engine.mode == "paged"  # the paged attention's window, not HF's
        engine.prefill_logits(ids)
        hit = engine.cache.lookup(ids)
        try:
            assert hit.num_cached_tokens == 36
            engine.cache.pool.kv[hit.block_ids[block]] += 0.5
        finally:
            engine.cache.release(hit)
        logits, cached = engine.prefill_logits(ids)
    assert cached == 36
    return close_to_reference(logits, reference_logits(model, ids)[-1])


@pytest.mark.parametrize("arch", ["mistral-window", "qwen2-window", "gemma2", "qwen2-hybrid"])
def test_a_perturbed_block_inside_the_window_fails_the_contract(arch: str) -> None:
    assert not perturbed_prefill(arch, block=8)  # positions 32..35: in every window


@pytest.mark.parametrize("block", [0, 6])
def test_a_window_model_never_reads_a_block_outside_its_window(block: int) -> None:
    # window 7: the queries at 36..39 see keys from 30 on; block 6 holds 24..27
    assert perturbed_prefill("mistral-window", block)


@pytest.mark.parametrize("arch", ["gemma2", "qwen2-hybrid"])
def test_a_hybrid_models_full_layers_read_the_whole_prefix(arch: str) -> None:
    assert not perturbed_prefill(arch, block=0)


def test_gemma2_softcapping_changes_the_output_and_the_engine_applies_it() -> None:
    capped = model_of("gemma2")
    config = arch_config("gemma2")
    config.attn_logit_softcapping = None
    plain = wrap_model(random_model(config, seed=0), byte_tokenizer(), "gemma2-plain")
    prompt = tokens(30, seed=9)
    with Engine(capped, micro_cache_config()) as engine:
        engine.generate([prompt], GREEDY)
        out = engine.generate([prompt], GREEDY)[0]
    assert out.cached_tokens == 28
    assert greedy_matches_reference(capped, prompt, out.output_token_ids)
    assert not greedy_matches_reference(plain, prompt, out.output_token_ids)


def test_window_layers_keep_every_position_so_the_whole_prefix_is_stored() -> None:
    model, prompt = model_of("qwen2-window"), tokens(30, seed=11)
    with Engine(model, micro_cache_config()) as engine:
        first = engine.generate([prompt], GREEDY)[0]
        ids = prompt + first.output_token_ids
        hit = engine.cache.lookup(ids)
        try:
            assert hit.num_cached_tokens == 40  # 41 positions have K/V: 10 whole blocks
            stored = engine.cache.pool.kv[hit.block_ids].clone()  # [10, L, 2, H, 4, D]
        finally:
            engine.cache.release(hit)
    with torch.inference_mode():  # HF's own cache keeps a window layer's last 6 positions
        x = torch.tensor([ids[:40]])
        past, full = DynamicCache(config=model.model.config), kv_cache(model.model.config)
        model.model(input_ids=x, **with_cache(model.model, past))
        model.model(input_ids=x, **with_cache(model.model, full))
    assert [layer.keys.shape[2] for layer in past.layers] == [6, 6]
    for i, layer in enumerate(full.layers):
        keys = stored[:, i, 0].permute(1, 0, 2, 3).reshape(layer.keys.shape[1], 40, -1)
        assert torch.allclose(keys, layer.keys[0], atol=1e-4)
