"""`python -m bench windows`: the blocks one request holds as decode goes on."""

from __future__ import annotations

from bench.windows import held_during_decode

MARKS = [1, 8, 24]


def test_a_window_model_holds_its_window_plus_one_block() -> None:
    # 8 prompt tokens + n generated: the K/V of 7 + n positions in 4-token blocks (the
    # newest token's K/V is written by the next step); after 24 tokens positions 0..30 are
    # written and the next query (31) sees keys 16..31: blocks 4..7. The index keeps the
    # prompt's blocks 0 and 1 (the window before the prompt's end): 6 in use
    r = held_during_decode("mistral-window", 8, 24, MARKS)
    assert r["window"] == 16
    assert r["held"] == r["window_held"] == {1: 2, 8: 4, 24: 4}
    assert r["in_use"] == r["window_in_use"] == {1: 2, 8: 4, 24: 6}
    assert r["bytes"] == {1: 4096, 8: 8192, 24: 8192}  # 1 KiB per layer and block, 2 layers


def test_a_hybrid_model_holds_every_blocks_full_layers_and_its_windows_window_layers() -> None:
    # the same request on 1 full layer + 5 window layers: every block's full layer (8 after
    # 24 tokens), the window layers of blocks 4..7 only; the index keeps the window parts of
    # the prompt's blocks 0 and 1 (6 in use), and the full parts of all 8
    r = held_during_decode("qwen2-hybrid-5:1", 8, 24, MARKS)
    assert r["held"] == {1: 2, 8: 4, 24: 8}
    assert r["window_held"] == {1: 2, 8: 4, 24: 4}
    assert r["in_use"] == {1: 2, 8: 4, 24: 8}
    assert r["window_in_use"] == {1: 2, 8: 4, 24: 6}
    # 8 full-layer parts + 4 x 5 window-layer parts, 1 KiB each; 48 KiB for all 6 layers
    assert r["bytes"][24] == (8 + 4 * 5) * 1024
    assert r["whole_bytes"][24] == 8 * 6 * 1024


def test_a_full_attention_model_holds_its_whole_sequence() -> None:
    r = held_during_decode("llama", 8, 24, MARKS)
    assert r["held"] == r["in_use"] == {1: 2, 8: 4, 24: 8}
    assert r["window_held"] == r["window_in_use"] == {1: 0, 8: 0, 24: 0}
