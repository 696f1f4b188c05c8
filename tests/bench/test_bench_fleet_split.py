"""`bench fleet`'s prefill/decode scenarios, their accounting (the live runs start replicas,
Redis and a router: tests/server/test_router_handover.py drives the same processes)."""

from __future__ import annotations

import pytest

from bench.fleet import build_parser, main
from bench.fleet.handover_sweep import judge, print_sweep
from bench.fleet.split import compare, print_split, roles, summarize
from bench.load.client import ChatOutcome


def chat(ok: bool, text: str, times=(), error: str = "", event: bool = False, session=0, turn=0):
    out = ChatOutcome("u", ok, 200, ttft_s=0.1 if text else None, prompt_tokens=2048,
                      completion_tokens=len(times), text=text, error=error, session=session,
                      turn=turn)  # fmt: skip
    out.token_times, out.error_event = list(times), event
    return out


def test_inter_token_latency_is_the_gap_between_a_chats_streamed_chunks():
    chats = [chat(True, "abc", (0.0, 0.01, 0.03)), chat(True, "de", (1.0, 1.05))]
    run = summarize(chats, [], 1.0)
    assert run["itl_p50_ms"] == pytest.approx(20.0)  # gaps 10, 20, 50 ms
    assert run["itl_p90_ms"] == pytest.approx(44.0)


def test_a_broken_stream_is_partial_with_an_error_event_cut_without_and_lost_with_neither():
    outs = [
        chat(True, "ok", (0, 1)),
        chat(False, "half", (0,), "broke", event=True),
        chat(False, "", (), "broke before its first token", event=True),
        chat(False, "half", (0,), "RemoteProtocolError"),
        chat(False, "", (), "refused"),
    ]
    run = summarize(outs, [chat(True, "b", (0,), session=-1)], 2.0)
    assert (run["ok"], run["partial"], run["cut"], run["lost"]) == (2, 2, 1, 1)
    assert (run["chats"], run["bursts"], run["burst_prompt_tokens"]) == (5, 1, 2048)


def test_the_layouts_are_compared_answer_by_answer_and_as_ratios():
    colocated = summarize([chat(True, "x", (0, 0.1), turn=0), chat(True, "y", (0, 0.1), turn=1)],
                          [], 1.0)  # fmt: skip
    split = summarize([chat(True, "x", (0, 0.04), turn=0), chat(True, "z", (0, 0.04), turn=1)],
                      [], 1.0)  # fmt: skip
    versus = compare(colocated, split)
    assert versus["identical_answers"] == [1, 2]
    assert versus["itl_p90"] == pytest.approx(0.4)
    runs = [colocated | {"scenario": "split", "layout": "colocated", "roles": ["both"] * 2,
                         "handovers": {}, "decode_loads": {}},
            split | {"scenario": "split", "layout": "split", "roles": ["prefill", "decode"],
                     "handovers": {"handed_over": 3.0, "direct": 1.0, "busy": 0.0, "fallback": 0.0},
                     "decode_loads": {"whole": 3.0, "partial": 0.0},
                     "versus_colocated": versus}]  # fmt: skip
    text = print_split(runs)
    assert "| split | split | p,d | 2/2 |" in text and "| 3/1/0/0 | 3/0 |" in text
    assert "split ÷ colocated: ITL p90 0.40" in text and "identical answers 1/2" in text


def test_the_split_layout_gives_the_first_replicas_the_prefill_role():
    args = build_parser().parse_args(["--replicas", "3", "--prefill-replicas", "1"])
    assert roles(args, "split") == ("prefill", "decode", "decode")
    assert roles(args, "colocated") == ("both",) * 2  # as many as decode
    assert roles(args, "colocated-all") == ("both",) * 3


def test_the_sweep_finds_where_a_hand_over_pays_and_where_it_adds_little():
    keys = ("tokens", "direct", "decode_side", "handed_over")
    table = [(32, 26.0, 15.0, 43.0), (128, 73.0, 17.0, 94.0), (256, 155.0, 20.0, 190.0)]
    rows = [dict(zip(keys, values, strict=True)) for values in table]
    sweep = judge(rows)
    assert [r["saved_ms"] for r in sweep["rows"]] == [11.0, 56.0, 135.0]
    assert (sweep["break_even_tokens"], sweep["suggested_min_tokens"]) == (128, 256)
    assert "hand-over pays from 128 tokens" in print_sweep(sweep)


@pytest.mark.parametrize("argv", [["--scenarios", "split", "--prefill-replicas", "2",
                                   "--replicas", "2"]])  # fmt: skip
def test_a_split_fleet_needs_a_decode_replica(argv, capsys):
    assert main(argv) == 2
    assert "--prefill-replicas < --replicas" in capsys.readouterr().err
