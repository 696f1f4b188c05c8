"""`python -m bench windows`: the blocks one request holds as decode goes on."""

from __future__ import annotations

from bench.windows import held_during_decode


def test_a_window_model_holds_its_window_plus_one_block() -> None:
    # 8 prompt tokens + n generated: the K/V of 7 + n positions in 4-token blocks (the
    # newest token's K/V is written by the next step); after 24 tokens positions 0..30 are
    # written and the next query (31) sees keys 16..31: blocks 4..7. The index keeps the
    # prompt's blocks 0 and 1 (the window before the prompt's end): 6 in use
    r = held_during_decode("mistral-window", 8, 24, [1, 8, 24])
    assert r == {"window": 16, "held": {1: 2, 8: 4, 24: 4}, "in_use": {1: 2, 8: 4, 24: 6}}


def test_a_hybrid_model_holds_its_whole_sequence() -> None:
    r = held_during_decode("qwen2-hybrid", 8, 24, [1, 8, 24])
    assert r == {"window": 16, "held": {1: 2, 8: 4, 24: 8}, "in_use": {1: 2, 8: 4, 24: 8}}
