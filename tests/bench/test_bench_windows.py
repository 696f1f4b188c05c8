"""`python -m bench windows`: the blocks one request holds as decode goes on."""

from __future__ import annotations

from bench.windows import held_during_decode


def test_a_window_model_holds_its_whole_sequence_today() -> None:
    # 8 prompt tokens + n generated: the K/V of 7 + n positions in 4-token blocks (the
    # newest token's K/V is written by the next step)
    r = held_during_decode("mistral-window", 8, 24, [1, 8, 24])
    assert r == {"window": 16, "held": {1: 2, 8: 4, 24: 8}}
