"""Two things that make one client's chat faster, held to the output contract: the next turn
reuses the partly filled last block its previous turn ended in (kvstore/device/tails.py), and a
request decoding alone reads its K/V from one contiguous buffer
(engine/attention/decode_mirror.py)."""

from __future__ import annotations

import numpy as np
import torch
from engine_helpers import greedy_matches_reference, micro_cache_config

from engine.attention.decode_mirror import DecodeMirror
from engine.loop.engine import Engine
from engine.loop.graph import GraphConfig
from engine.loop.request import SamplingParams
from engine.model.loading import LoadedModel

FIVE = SamplingParams(max_new_tokens=5, ignore_eos=True)
# the mirror serves eager one-row decode steps; with decode graphs on, a graph replays them
EAGER = GraphConfig("off")
TEN = SamplingParams(max_new_tokens=10, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def two_turns(engine: Engine, perturb: float = 0.0) -> tuple[list[int], object]:
    """Turn 1: 10 prompt tokens, 5 generated (K/V of 14 positions: 3 full blocks of 4, and
    2 positions in the fourth). Turn 2: all of it, then 6 new tokens."""
    p1 = tokens(10, seed=1)
    first = engine.generate([p1], FIVE)[0]
    (tail,) = engine.cache.tails.block_ids()
    engine.cache.pool.kv[tail] += perturb  # every layer's K/V of positions 12 and 13
    p2 = p1 + first.output_token_ids + tokens(6, seed=2)
    return p2, engine.generate([p2], TEN)[0]


def test_the_next_turn_reuses_the_partial_block_its_previous_turn_ended_in(micro) -> None:
    with Engine(micro, micro_cache_config()) as engine:
        prompt, second = two_turns(engine)
        engine.cache.check_integrity()
        tail_tokens = engine.cache.metrics.get("tail_hits_tokens_total")
    assert (second.cached_tokens, second.cached_by_tier, tail_tokens) == (14, {"device": 14}, 2)
    assert greedy_matches_reference(micro, prompt, second.output_token_ids)


def test_a_perturbed_tail_block_fails_the_reference(micro: LoadedModel) -> None:
    with Engine(micro, micro_cache_config()) as engine:
        prompt, second = two_turns(engine, perturb=2.0)
    assert second.cached_tokens == 14
    assert not greedy_matches_reference(micro, prompt, second.output_token_ids)


def test_without_generated_tokens_cached_the_tail_holds_only_prompt_tokens(micro) -> None:
    p1 = tokens(10, seed=1)
    with Engine(micro, micro_cache_config(), cache_generated=False) as engine:
        first = engine.generate([p1], FIVE)[0]
        again = engine.generate([p1 + first.output_token_ids], TEN)[0]
    assert again.cached_tokens == 10  # 2 blocks and positions 8, 9 (the prompt's)
    assert greedy_matches_reference(micro, p1 + first.output_token_ids, again.output_token_ids)


def test_tails_off_leave_the_next_turn_at_its_last_full_block(micro) -> None:
    with Engine(micro, micro_cache_config(tail_blocks=0)) as engine:
        p1 = tokens(10, seed=1)
        first = engine.generate([p1], FIVE)[0]
        second = engine.generate([p1 + first.output_token_ids + tokens(6, seed=2)], TEN)[0]
    assert second.cached_tokens == 12


def decode_alone(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return engine.generate([prompt], params)[0].output_token_ids


def test_decoding_alone_through_the_mirror_gives_the_tokens_of_the_pool_path(micro) -> None:
    prompt, params = tokens(23, seed=3), SamplingParams(max_new_tokens=24, ignore_eos=True)
    with Engine(micro, micro_cache_config(), graph_config=EAGER) as engine:
        assert isinstance(engine.runner.mirror, DecodeMirror)
        builds = engine.runner.mirror.builds
        mirrored = decode_alone(engine, prompt, params)
        assert engine.runner.mirror.builds == builds + 1  # once, then appended each step
        engine.runner.mirror = None
        engine.cache.evict_device()
        gathered = decode_alone(engine, prompt, params)
    assert mirrored == gathered
    assert greedy_matches_reference(micro, prompt, mirrored)


def test_a_perturbed_mirror_fails_the_reference(micro: LoadedModel) -> None:
    prompt, params = tokens(23, seed=3), SamplingParams(max_new_tokens=24, ignore_eos=True)
    with Engine(micro, micro_cache_config(), graph_config=EAGER) as engine:
        mirror = engine.runner.mirror
        out: list[int] = []

        def spoil(token: int) -> None:  # on the engine thread, between steps
            out.append(token)
            if len(out) == 3:
                with torch.inference_mode():  # the buffer was made in the engine's forward
                    mirror.buffer[:, :, :, :20] += 2.0  # positions 0..19, every layer

        engine.submit(prompt, params, on_token=spoil).result(60)
    assert len(out) == 24
    assert not greedy_matches_reference(micro, prompt, out)


def test_a_request_that_stops_decoding_alone_gets_its_mirror_rebuilt(micro) -> None:
    """A decodes alone; B joins it for a few steps (the mirror is dropped: those steps write
    A's K/V to the pool only); once B is done A decodes alone again from a rebuilt mirror."""
    a_prompt, b_prompt = tokens(17, seed=4), tokens(9, seed=5)
    a_params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    with Engine(micro, micro_cache_config(), graph_config=EAGER) as engine:
        start = engine.runner.mirror.builds
        joined: list = []

        def on_a(token: int) -> None:
            if len(joined) == 0 and engine.runner.mirror.builds == start + 1:
                joined.append(engine.submit(b_prompt, FIVE))  # queued before the next step

        a = engine.submit(a_prompt, a_params, on_token=on_a).result(60)
        b = joined[0].result(60)
        builds = engine.runner.mirror.builds - start
    assert builds == 2
    assert greedy_matches_reference(micro, a_prompt, a.output_token_ids)
    assert greedy_matches_reference(micro, b_prompt, b.output_token_ids)


def test_a_request_longer_than_the_mirror_may_hold_reads_the_pool(micro) -> None:
    """The mirror holds at most a quarter of the pool's positions (64 of 64 blocks of 4):
    a request decodes through it up to position 63, then from the pool."""
    prompt, params = tokens(57, seed=6), SamplingParams(max_new_tokens=14, ignore_eos=True)
    with Engine(micro, micro_cache_config(device_blocks=64), graph_config=EAGER) as engine:
        mirror = engine.runner.mirror
        assert mirror.max_positions == 64
        builds = mirror.builds
        out = decode_alone(engine, prompt, params)
        assert (mirror.builds - builds, mirror.seq, mirror.length) == (1, None, 0)
    assert greedy_matches_reference(micro, prompt, out)
