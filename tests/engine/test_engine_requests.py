"""Request handling: validation, sampling, stops, concurrency, namespaces, lifecycle."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from engine_helpers import greedy_matches_reference, micro_cache_config, micro_model

from engine.loop.engine import (
    Engine,
    EngineClosedError,
    GenerateResult,
    InvalidRequestError,
    SamplingParams,
)
from engine.model.loading import LoadedModel

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("", "empty"),
        ([], "empty"),
        ([1, 2, 260], r"\[0, 260\)"),
        ([1, -1], r"\[0, 260\)"),
        ([1, 2.5], r"\[0, 260\)"),
        ([True, 2], r"\[0, 260\)"),
        ([1] * 250, "exceeds the model's 256 positions"),
        (3.0, "a str or a list of token ids"),
    ],
    ids=["empty-text", "empty-ids", "id-too-large", "negative-id", "float-id", "bool-id",
         "too-long", "not-a-prompt"],
)  # fmt: skip
def test_invalid_prompts_raise_invalid_request(engine: Engine, prompt, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        engine.generate([prompt], GREEDY)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -3}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": "7"}, "seed"),
        ({"seed": 2**64}, "seed"),  # torch cannot seed it: a clear error, not a crash
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_invalid_sampling_params_raise_invalid_request(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)
    assert issubclass(InvalidRequestError, ValueError)


def test_a_bare_token_list_is_rejected_as_prompts(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="wrap token ids in a list"):
        engine.generate([1, 2, 3], GREEDY)


def test_invalid_request_in_a_batch_queues_nothing(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError):
        engine.generate([tokens(12, 0), []], GREEDY)
    assert engine.generate([tokens(12, 0)], GREEDY)[0].cached_tokens == 0


def test_greedy_result_fields(engine: Engine, micro: LoadedModel) -> None:
    ids = tokens(13, seed=1)
    result = engine.generate([ids], GREEDY)[0]
    assert isinstance(result, GenerateResult)
    assert (result.prompt_tokens, result.cached_tokens, result.finish_reason) == (13, 0, "length")
    assert len(result.output_token_ids) == 8
    assert result.text == micro.tokenizer.decode(result.output_token_ids, skip_special_tokens=True)
    assert result.ttft_s > 0
    assert greedy_matches_reference(micro, ids, result.output_token_ids)


def test_tiny_top_p_is_greedy_and_a_seed_reproduces_samples(engine: Engine) -> None:
    ids = tokens(21, seed=2)
    greedy = engine.generate([ids], GREEDY)[0].output_token_ids
    narrow = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1e-6, ignore_eos=True)
    assert engine.generate([ids], narrow)[0].output_token_ids == greedy
    sampled = SamplingParams(max_new_tokens=8, temperature=1.5, seed=11, ignore_eos=True)
    first, second = engine.generate([ids, ids], sampled)
    assert first.output_token_ids == second.output_token_ids
    assert (first.cached_tokens, second.cached_tokens) == (20, 20)


def test_stop_token_ends_generation_and_is_reported(engine: Engine) -> None:
    ids = tokens(9, seed=3)
    full = engine.generate([ids], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    stop = full.output_token_ids[5]
    k = full.output_token_ids.index(stop)
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(stop,), ignore_eos=True)
    result = engine.generate([ids], params)[0]
    assert result.output_token_ids == full.output_token_ids[: k + 1]
    assert result.finish_reason == "stop"


def test_stop_string_cuts_the_text_before_it(engine: Engine, micro: LoadedModel) -> None:
    ids = tokens(9, seed=4)
    out = engine.generate([ids], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    decode = micro.tokenizer.decode
    k = next(
        i
        for i, t in enumerate(out.output_token_ids)
        if i > 0 and 33 <= t < 127 and chr(t) not in decode(out.output_token_ids[: i + 1][:-1])
    )
    params = SamplingParams(
        max_new_tokens=24, stop=(chr(out.output_token_ids[k]),), ignore_eos=True
    )
    result = engine.generate([ids], params)[0]
    assert result.output_token_ids == out.output_token_ids[: k + 1]
    assert result.text == decode(out.output_token_ids[:k])
    assert result.finish_reason == "stop"


def test_concurrent_callers_get_correct_results(engine: Engine, micro: LoadedModel) -> None:
    common = tokens(30, seed=5)
    own = [tokens(26, seed=100 + i) for i in range(4)]
    results: dict[int, list[GenerateResult]] = {}

    def call(i: int) -> None:
        results[i] = engine.generate([common, own[i]], GREEDY)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # a caller whose request shares a step with the first one computes the prefix too
    cached = sorted(results[i][0].cached_tokens for i in range(4))
    assert cached[0] == 0 and cached[-1] == 28 and set(cached) <= {0, 28}
    assert [results[i][1].cached_tokens for i in range(4)] == [0, 0, 0, 0]
    common_outputs = {tuple(results[i][0].output_token_ids) for i in range(4)}
    assert len(common_outputs) == 1
    assert greedy_matches_reference(micro, common, results[0][0].output_token_ids)
    for i in range(4):
        assert greedy_matches_reference(micro, own[i], results[i][1].output_token_ids)


def test_generated_tokens_are_not_stored_when_cache_generated_is_off(micro: LoadedModel) -> None:
    ids = tokens(10, seed=6)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    with Engine(micro, micro_cache_config(), cache_generated=False) as eng:
        out = eng.generate([ids], params)[0].output_token_ids
        # the prompt's 10: 2 blocks, and its tail (positions 8, 9); none of the generated
        assert eng.generate([[*ids, *out]], params)[0].cached_tokens == 10
    with Engine(micro, micro_cache_config()) as eng:
        out = eng.generate([ids], params)[0].output_token_ids
        # KV of 10 prompt + 9 generated tokens = 19: 4 whole blocks and a tail of 3
        assert eng.generate([[*ids, *out]], params)[0].cached_tokens == 19


def test_other_weights_with_the_same_config_hash_to_disjoint_keys(micro: LoadedModel) -> None:
    ids = tokens(40, seed=7)
    with (
        Engine(micro, micro_cache_config()) as a,
        Engine(micro_model(2), micro_cache_config()) as b,
    ):
        a.generate([ids], GREEDY)
        assert set(a.cache.hasher.hash_blocks(ids)).isdisjoint(b.cache.hasher.hash_blocks(ids))
        assert b.generate([ids], GREEDY)[0].cached_tokens == 0


def test_other_weights_with_the_same_config_get_no_cached_tokens(
    micro: LoadedModel, tmp_path: Path
) -> None:
    ids = tokens(40, seed=7)
    shared = micro_cache_config(lmdb_dir=str(tmp_path / "lmdb"), lmdb_write_policy="write-through")
    with Engine(micro, shared) as eng:
        assert eng.generate([ids], GREEDY)[0].cached_tokens == 0
        assert eng.generate([ids], GREEDY)[0].cached_tokens == 40  # a whole-prompt hit
    with Engine(micro_model(seed=1), shared) as same:  # same weights, fresh device pool
        assert same.generate([ids], GREEDY)[0].cached_tokens == 40
    other = micro_model(seed=2)
    with Engine(other, shared) as eng:
        result = eng.generate([ids], GREEDY)[0]
    assert result.cached_tokens == 0
    assert greedy_matches_reference(other, ids, result.output_token_ids)


def test_closed_engine_rejects_requests(micro: LoadedModel) -> None:
    eng = Engine(micro, micro_cache_config())
    eng.close()
    eng.close()  # idempotent
    with pytest.raises(EngineClosedError):
        eng.generate([tokens(5, 0)], GREEDY)
