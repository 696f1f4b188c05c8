"""Sliding-window and hybrid models: cached output meets the no-cache reference in mixed
batches and through LMDB; a window layer never reads a block outside its window, a full
layer of a hybrid model reads them all; Gemma 2's softcapping is applied."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from arch_configs import arch_config
from engine_helpers import close_to_reference, micro_cache_config, reference_logits

from engine.contract import greedy_matches_reference
from engine.loop.engine import Engine
from engine.loop.request import Request, SamplingParams
from engine.loop.scheduler_config import SchedulerConfig
from engine.model.loading import LoadedModel, kv_cache, with_cache, wrap_model
from engine.model.tiny import byte_tokenizer, random_model

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


def perturbed_prefill(arch: str, block: int, layers: str = "every") -> bool:
    """Cache 40 tokens, add 0.5 to one block the index holds (K and V of `layers`: "every"
    layer, or a hybrid model's "window" layers), prefill the same 40 again (36 cached:
    queries at 36..39). Whether the logits still meet the reference."""
    model, ids = model_of(arch), tokens(40, seed=7)
    with Engine(model, micro_cache_config()) as engine:
        assert engine.mode == "paged"  # the paged attention's window, not HF's
        engine.prefill_logits(ids)
        hit = engine.cache.lookup(ids)
        try:
            assert hit.num_cached_tokens == 36
            held = engine.cache.index.path_block_ids(hit.node)
            assert None not in held  # a synchronous prefill drops nothing
            pool = engine.cache.pool
            perturbed = pool.read_blocks(held[block : block + 1])
            perturbed[:, pool.window_layers if layers == "window" else slice(None)] += 0.5
            pool.write_blocks(held[block : block + 1], perturbed)
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


@pytest.mark.parametrize("arch", ["gemma2", "qwen2-hybrid"])
def test_a_hybrid_models_window_layers_read_their_window_from_the_window_plane(arch: str) -> None:
    # windows of 6 and 5 keys: the queries at 36..39 see keys from 31 (30) on
    assert not perturbed_prefill(arch, block=8, layers="window")  # 32..35
    assert perturbed_prefill(arch, block=6, layers="window")  # 24..27: no window sees them


def shared_system_prompt(arch: str) -> tuple[list[int], int, int]:
    """Three prompts sharing a 24-token system prompt, one after another, each meeting its
    reference: their cached tokens, the blocks (a hybrid model's window parts) the index
    let go of, and the blocks it holds at the end."""
    model, system = model_of(arch), tokens(24, seed=1)
    prompts = [system + tokens(5, 2), system + tokens(6, 3), system + tokens(7, 4)]
    with Engine(model, micro_cache_config()) as engine:
        results = [engine.generate([p], GREEDY)[0] for p in prompts]
        engine.cache.check_integrity()
        windowed_out = engine.cache.metrics.get("windowed_out_blocks_total")
        cached_blocks = engine.cache.index.num_cached_blocks
    for prompt, result in zip(prompts, results, strict=True):
        assert greedy_matches_reference(model, prompt, result.output_token_ids)
    return [r.cached_tokens for r in results], windowed_out, cached_blocks


def test_a_hybrid_models_shared_prefix_is_recomputed_once_then_kept_at_its_branch() -> None:
    # window 6, blocks of 4: a hit at block 6 (the 24-token system prompt) needs the window
    # parts of blocks 4 and 5
    cached, windowed_out, cached_blocks = shared_system_prompt("gemma2")
    # a decoded past block 4, so its index let go of window parts 0..4 (5 and 6: its
    # prompt's window); b recomputes the system prompt, its commit gives blocks 0..5 their
    # window parts back, and its branch point keeps 4 and 5's from then on: c hits
    assert cached == [0, 0, 24]
    # let go as each request slid on (40, 41, 42 positions: to blocks 8, 9, 9), less the
    # window before each prompt's end (5, 6) and before the branch (4, 5): a 0..4 and 7,
    # b 0..3 (filled back by its commit), 7 and 8, c 7 and 8
    assert windowed_out == 14
    assert cached_blocks == 6 + 3 * 4  # every full part: the system prompt, 4 blocks each


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


def full_forward_keys(model: LoadedModel, ids: list[int]) -> list[torch.Tensor]:
    """Each layer's keys [kv_heads, len(ids), head_dim] from one plain forward."""
    with torch.inference_mode():
        full = kv_cache(model.model.config)
        model.model(input_ids=torch.tensor([ids]), **with_cache(model.model, full))
    return [layer.keys[0] for layer in full.layers]


def assert_blocks_hold_keys(pool_kv: torch.Tensor, ids: dict[int, int], keys: list) -> None:
    """Pool block ids[i] holds positions [4i, 4i + 4) of every layer's keys."""
    for i, block_id in ids.items():
        for layer, want in enumerate(keys):
            got = pool_kv[block_id, layer, 0]  # [H, 4, D]
            assert torch.allclose(got, want[:, 4 * i : 4 * i + 4], atol=1e-4)


def test_a_window_models_pool_keeps_its_window_and_lmdb_every_position(tmp_path) -> None:
    model, prompt = model_of("qwen2-window"), tokens(30, seed=11)  # window 7, blocks of 4
    config = micro_cache_config(lmdb_dir=str(tmp_path), lmdb_write_policy="write-through")
    with Engine(model, config) as engine:
        first = engine.generate([prompt], GREEDY)[0]
        ids = prompt + first.output_token_ids  # 42 tokens: 41 positions have K/V
        keys = full_forward_keys(model, ids[:40])
        hit = engine.cache.lookup(ids)
        try:  # a hit at 40 needs keys from 33 on: blocks 8 and 9
            assert (hit.num_cached_tokens, hit.tier_tokens) == (40, {"device": 40})
            assert hit.block_ids[:8] == [None] * 8 and None not in hit.block_ids[8:]
            window = {8: hit.block_ids[8], 9: hit.block_ids[9]}
            assert_blocks_hold_keys(engine.cache.pool.kv, window, keys)
        finally:
            engine.cache.release(hit)
        assert engine.cache.flush(10)
        engine.cache.evict_device()
        hit = engine.cache.lookup(ids)  # every block again, from LMDB, verified
        try:
            assert (hit.num_cached_tokens, hit.tier_tokens) == (40, {"lmdb": 40})
            path = engine.cache.index.path_block_ids(hit.node)[:10]
            assert_blocks_hold_keys(engine.cache.pool.kv, dict(enumerate(path)), keys)
        finally:
            engine.cache.release(hit)
        engine.cache.check_integrity()


def test_a_window_models_shared_prefix_is_recomputed_once_then_kept_at_its_branch() -> None:
    # window 7, blocks of 4: a hit at block 6 (the 24-token system prompt) needs blocks 4, 5
    cached, windowed_out, _ = shared_system_prompt("mistral-window")
    # a decoded past block 5, dropping it: b recomputes the prompt and its branch point
    # keeps blocks 4 and 5 from then on, so c hits the whole system prompt
    assert cached == [0, 0, 24]
    # dropped from the index as each request slid on (40, 41, 42 positions: blocks 0..7,
    # 0..7, 4..8), less the window before each prompt's end (5, 6) and before the branch
    # point (4, 5): a 0-4 and 7, b 0-3 and 7, c 7 and 8
    assert windowed_out == 13


def per_request_run_on_dropped_blocks(perturb: bool) -> bool:
    """A batched request decodes past its prompt and drops blocks 0..4 (window 7, blocks of
    4; it keeps 5, 6, the window before its prompt's end). The per-request path then finds
    28 tokens cached and loads zeros for blocks 0..4 (no query of its window sees them).
    Whether its output meets the reference (with block 6, inside the window, perturbed)."""
    model, prompt = model_of("mistral-window"), tokens(29, seed=13)
    with Engine(model, micro_cache_config()) as engine:
        engine.generate([prompt], GREEDY)
        hit = engine.cache.lookup(prompt)
        try:
            assert hit.num_cached_tokens == 28
            assert hit.block_ids[:5] == [None] * 5 and None not in hit.block_ids[5:]
            if perturb:
                engine.cache.pool.kv[hit.block_ids[6]] += 0.5
        finally:
            engine.cache.release(hit)
        result = engine.run(prompt, GREEDY)
        engine.cache.check_integrity()
    assert result.cached_tokens == 28
    return greedy_matches_reference(model, prompt, result.output_token_ids)


def test_the_per_request_path_meets_the_reference_on_a_hit_with_dropped_blocks() -> None:
    assert per_request_run_on_dropped_blocks(perturb=False)


def test_the_per_request_path_reads_the_windows_blocks() -> None:
    assert not per_request_run_on_dropped_blocks(perturb=True)


def test_a_hybrid_prompt_longer_than_the_window_slots_is_served_in_chunks() -> None:
    # 12 window slots for 48 blocks: a 100-token prompt (25 blocks) gets window parts
    # chunk by chunk and lets go of them as its window slides; 2 requests at once
    model = model_of("gemma2")
    config = micro_cache_config(device_blocks=48, window_share=0.25)
    prompts = [tokens(100, seed=21), tokens(9, seed=22)]
    with Engine(model, config) as engine:  # a step budget of 256 tokens: steps shrink
        assert engine.cache.pool.window.num_slots == 12
        requests = engine.add_requests([Request(p, GREEDY) for p in prompts])
        results = [r.future.result(60) for r in requests]  # (admitted at all: no hang)
        again = engine.generate(prompts[:1], GREEDY)[0]
        engine.cache.check_integrity()
        assert engine.cache.metrics.get("evicted_blocks_total") == 0
    assert again.cached_tokens == 100  # its prompt's window kept its window parts
    for prompt, result in zip(prompts + prompts[:1], [*results, again], strict=True):
        assert greedy_matches_reference(model, prompt, result.output_token_ids)


def test_a_hybrid_synchronous_prefill_longer_than_the_window_slots_runs_in_chunks() -> None:
    model, prompt = model_of("qwen2-hybrid"), tokens(100, seed=23)
    config = micro_cache_config(device_blocks=48, window_share=0.25)  # 12 slots
    with Engine(model, config) as engine:
        logits, cached = engine.prefill_logits(prompt)
        # chunks of 25, 38 and 37 tokens (halved until their blocks' window parts fit);
        # the index keeps those of the last chunk's 11 blocks, the scratch block has one
        plane = engine.cache.pool.window
        assert (plane.num_free, len(engine.cache.kind.windows.punched)) == (0, 14)
        again, cached_again = engine.prefill_logits(prompt)  # slots come back from the index
        assert (plane.num_free, len(engine.cache.kind.windows.punched)) == (1, 15)
        engine.cache.check_integrity()
    assert (cached, cached_again) == (0, 96)
    want = reference_logits(model, prompt)[-1]
    assert close_to_reference(logits, want) and close_to_reference(again, want)


def test_a_step_reading_a_block_without_its_window_part_is_refused() -> None:
    from engine.attention.paged import PagedAttentionError
    from engine.attention.step_row import Row

    with Engine(model_of("gemma2"), micro_cache_config()) as engine:
        block = engine.cache.held.allocate(1, window=False)
        with pytest.raises(PagedAttentionError, match="without window parts"):
            engine.on_loop(lambda: engine.runner.forward([Row(block, 0, 3)], [[1, 2, 3]], [0]))
        engine.cache.held.free(block, window=False)


def test_a_hybrid_pool_smaller_than_a_window_is_refused_at_start() -> None:
    from kvstore.config import ConfigError

    with pytest.raises(ConfigError, match="fewer than a request's window"):
        Engine(model_of("gemma2"), micro_cache_config(device_blocks=4))  # window: 2 blocks + 3


@pytest.mark.parametrize("stop", ["cache_generated=False", "quota"])
def test_a_hybrid_request_whose_commits_stop_lets_go_of_its_window_parts(stop: str) -> None:
    # tier entries of 4 blocks: a request keeps the window parts of the chunk it fills until
    # the chunk is committed, but when its commits stop (generated tokens not cached, or
    # its tenant at its quota) nothing waits: 12 slots serve a 90-token decode
    model, prompt = model_of("gemma2"), tokens(8, seed=24)
    quota = {"tenant_quota_blocks": 3} if stop == "quota" else {}
    config = micro_cache_config(
        device_blocks=48, window_share=0.25, memory_cache_gb=0.01, chunk_blocks=4, **quota
    )
    params = SamplingParams(max_new_tokens=90, ignore_eos=True)
    with Engine(model, config, cache_generated=stop == "quota") as engine:
        request = engine.add_requests([Request(prompt, params)])[0]
        result = request.future.result(60)
        assert request.num_preemptions == 0
        engine.cache.check_integrity()
        logits = engine.prefill(tokens(100, seed=25)).logits  # stores nothing: no commit
    assert greedy_matches_reference(model, prompt, result.output_token_ids)
    assert close_to_reference(logits, reference_logits(model, tokens(100, seed=25))[-1])
