"""Output with the cache equals an independent no-cache reference (one full forward)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from arch_configs import arch_config
from engine_helpers import (
    BLOCK_SIZE,
    close_to_reference,
    greedy_matches_reference,
    micro_cache_config,
    micro_config,
    reference_logits,
)
from transformers import GPT2Config, Qwen3Config

from engine.loop.engine import Engine, SamplingParams
from engine.model.files import attn_implementation
from engine.model.loading import LoadedModel, load_model, wrap_model
from engine.model.tiny import byte_tokenizer, random_model


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def check_prefill(
    engine: Engine, ids: list[int], expected_cached: int, tol: float = 1e-4
) -> torch.Tensor:
    logits, cached = engine.prefill_logits(ids)
    assert cached == expected_cached
    assert close_to_reference(logits, reference_logits(engine.model, ids)[-1], tol)
    return logits


def test_exact_repeat_hits_all_whole_blocks_but_the_last_token(engine: Engine) -> None:
    ids = tokens(30, seed=0)
    check_prefill(engine, ids, expected_cached=0)
    check_prefill(engine, ids, expected_cached=28)  # whole blocks of the first 29 tokens


def test_shared_prefix_with_a_different_suffix(engine: Engine) -> None:
    prefix = tokens(20, seed=1)
    check_prefill(engine, [*prefix, 1, 2, 3, 4, 5, 6, 7], expected_cached=0)
    check_prefill(engine, [*prefix, 9, 8, 7, 6, 5, 4, 3, 2, 1], expected_cached=20)


def test_prefix_ending_on_a_block_boundary_and_one_token_past_it(engine: Engine) -> None:
    stored = tokens(24, seed=2)
    check_prefill(engine, stored, expected_cached=0)
    on_boundary = [*stored[:16], *[255 - t for t in stored[16:22]]]
    check_prefill(engine, on_boundary, expected_cached=16)
    one_past = [*stored[:17], *[255 - t for t in stored[17:22]]]
    check_prefill(engine, one_past, expected_cached=16)


def test_hit_is_capped_so_the_last_token_is_computed(engine: Engine) -> None:
    ids = tokens(6 * BLOCK_SIZE, seed=3)
    check_prefill(engine, ids, expected_cached=0)
    check_prefill(engine, ids, expected_cached=5 * BLOCK_SIZE)


def test_second_turn_hits_the_first_turns_generated_tokens(engine: Engine) -> None:
    turn1 = tokens(22, seed=4)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    first = engine.generate([turn1], params)[0]
    assert first.cached_tokens == 0
    assert len(first.output_token_ids) == 12
    assert greedy_matches_reference(engine.model, turn1, first.output_token_ids)
    # stored: KV of prompt + 11 generated tokens = 33 tokens -> 8 whole blocks and a tail
    # holding position 32 (kvstore/device/tails.py)
    turn2 = [*turn1, *first.output_token_ids, *tokens(10, seed=5)]
    check_prefill(engine, turn2, expected_cached=33)  # 33 > 22: generated tokens hit
    second = engine.generate([turn2], params)[0]
    # now turn 2's own blocks are cached too: all 11, a whole-prompt hit (the last token is
    # run again for its logits, its K/V read from the cached block)
    assert second.cached_tokens == 44
    assert greedy_matches_reference(engine.model, turn2, second.output_token_ids)


def test_generated_tokens_match_model_generate(engine: Engine) -> None:
    ids = tokens(18, seed=6)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    engine.generate([ids], params)
    result = engine.generate([ids], params)[0]
    assert result.cached_tokens == 16
    with torch.inference_mode():
        ref = engine.model.model.generate(
            torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None
        )
    assert result.output_token_ids == ref[0, len(ids) :].tolist()


def test_model_loaded_from_a_saved_directory(micro: LoadedModel, tmp_path: Path) -> None:
    micro.model.save_pretrained(tmp_path)
    micro.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.fingerprint == micro.fingerprint
    prompt = "The quick brown fox jumps over the lazy dog."  # 44 bytes + bos = 45 tokens
    with Engine(loaded, micro_cache_config()) as eng:
        ids = eng.encode(prompt, SamplingParams())
        assert len(ids) == 45
        first, second = (eng.generate([prompt], SamplingParams(max_new_tokens=1))[0] for _ in "ab")
        # the second: 11 whole blocks, and position 44 from the first one's tail
        assert (first.cached_tokens, second.cached_tokens) == (0, 45)
        assert first.output_token_ids == second.output_token_ids
        check_prefill(eng, ids, expected_cached=44)


def test_perturbed_cached_block_fails_the_equivalence_check(engine: Engine) -> None:
    ids = tokens(30, seed=7)
    check_prefill(engine, ids, expected_cached=0)
    hit = engine.cache.lookup(ids)
    try:
        assert hit.num_cached_tokens == 28
        engine.cache.pool.kv[hit.block_ids[3]] += 0.5  # every layer, K and V, of block 3
    finally:
        engine.cache.release(hit)
    logits, cached = engine.prefill_logits(ids)
    assert cached == 28
    assert not close_to_reference(logits, reference_logits(engine.model, ids)[-1])


def other_architectures() -> dict[str, LoadedModel]:
    gpt2 = GPT2Config(
        vocab_size=260, n_embd=64, n_layer=2, n_head=4, n_positions=128,
        bos_token_id=256, eos_token_id=257,
    )  # fmt: skip
    qwen3 = Qwen3Config(
        vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
    )  # fmt: skip
    return {
        name: wrap_model(random_model(cfg, seed=3), byte_tokenizer(), name)
        for name, cfg in (("gpt2", gpt2), ("qwen3", qwen3))
    }


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_other_full_attention_architectures(arch: str) -> None:
    # GPT-2 has learned absolute positions: wrong position ids would break equivalence
    with Engine(other_architectures()[arch], micro_cache_config()) as eng:
        ids = tokens(50, seed=8)
        check_prefill(eng, ids[:30], expected_cached=0)
        check_prefill(eng, ids, expected_cached=28)


@pytest.mark.parametrize("arch", ["gptj", "bloom"])
def test_eager_only_architectures_load_from_a_directory_and_meet_the_contract(
    arch: str, tmp_path: Path
) -> None:
    # Bloom has no SDPA in transformers, GPT-J none before 5.24: they load with eager
    # attention there, and with SDPA where the class supports it
    built = random_model(arch_config(arch), seed=4)
    built.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    expected = attn_implementation(built.config)
    assert loaded.model.config._attn_implementation == expected
    assert arch != "bloom" or expected == "eager"
    assert loaded.fingerprint == wrap_model(built, byte_tokenizer(), arch).fingerprint
    with Engine(loaded, micro_cache_config()) as eng:
        ids = tokens(50, seed=10)
        check_prefill(eng, ids[:30], expected_cached=0)
        check_prefill(eng, ids, expected_cached=28)
        first = eng.generate([ids], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert first.cached_tokens == 48
    assert greedy_matches_reference(loaded, ids, first.output_token_ids)


def test_bfloat16_stays_within_its_tolerance() -> None:
    model = random_model(micro_config(), seed=1).to(torch.bfloat16)
    loaded = wrap_model(model, byte_tokenizer(), "micro-bf16")
    assert loaded.kv_dtype == "bfloat16"
    with Engine(loaded, micro_cache_config()) as eng:
        ids = tokens(60, seed=9)
        check_prefill(eng, ids[:40], expected_cached=0, tol=2e-2)
        check_prefill(eng, ids, expected_cached=40, tol=2e-2)
