"""`bench hitrate --retain-s T`: a trace replayed through a real `PrefixCache` on the trace's
own clock, each request retaining its prompt for T seconds, against plain LRU."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from bench.hitrate import main, replay
from bench.hitrate.retention import check_clock, retention_replay, run
from bench.traces import Request, TraceError, from_chains, load_trace, write_token_jsonl

FIXTURES = Path(__file__).resolve().parents[2] / "bench" / "fixtures"
TOKEN_FIXTURE = FIXTURES / "conversation_tokens.jsonl"

# capacity 4, at most 2 retained: request 0's prefix [0, 1] is retained; requests 1 and 2 fill
# the cache, and LRU flushes [0, 1] for request 2; request 3 comes back to it. Requests arrive
# 1 ms apart (from_chains).
FLUSHED = [[0, 1], [2, 3], [4, 5], [0, 1]]


def test_a_retained_prefix_survives_the_traffic_that_flushes_it_under_lru():
    trace = from_chains(FLUSHED)
    lru = retention_replay(trace, 4, None, max_fraction=0.5)
    kept = retention_replay(trace, 4, 60.0, max_fraction=0.5)
    assert lru.hits == [0, 0, 0, 0]
    assert kept.hits == [0, 0, 0, 2]  # request 2 evicted [2, 3] instead
    assert kept.retained == [2, 2, 2, 2]  # the cap: requests 1 and 2 retain nothing
    assert lru.retained == [0, 0, 0, 0]


def test_retained_blocks_that_never_come_back_cost_the_hits_lru_would_have_had():
    trace = from_chains([[0, 1], [2, 3], [4, 5], [2, 3]])
    lru = retention_replay(trace, 4, None, max_fraction=0.5)
    kept = retention_replay(trace, 4, 60.0, max_fraction=0.5)
    assert (lru.hits, kept.hits) == ([0, 0, 0, 2], [0, 0, 0, 0])
    row = run(trace, [4], 60.0, max_fraction=0.5)["results"][0]
    assert (row["block_hits_won"], row["block_hits_lost"]) == (0, 2)
    assert (row["lru_block_hit_rate"], row["retain_block_hit_rate"]) == (0.25, 0.0)


def test_retention_ends_at_its_ttl_on_the_trace_clock():
    """Retained at 0 ms for 1.5 ms: expired when request 2 arrives at 2 ms, so LRU's."""
    trace = from_chains(FLUSHED)
    short = retention_replay(trace, 4, 0.0015, max_fraction=0.5)
    assert short.hits == [0, 0, 0, 0]
    assert short.retained == [2, 2, 2, 2]  # request 2's own blocks once request 0's expired
    later = dataclasses.replace(trace, timestamps=np.array([0.0, 1.0, 1.2, 3.0]))
    assert retention_replay(later, 4, 0.0015, max_fraction=0.5).hits == [0, 0, 0, 2]


def test_the_report_counts_hits_won_and_the_capacity_retained():
    report = run(from_chains(FLUSHED), [4], 60.0, max_fraction=0.5)
    assert (report["retain_s"], report["retention_max_fraction"]) == (60.0, 0.5)
    assert report["results"] == [
        {
            "capacity_blocks": 4,
            "lru_block_hit_rate": 0.0,
            "retain_block_hit_rate": 0.25,
            "lru_token_hit_rate": 0.0,
            "retain_token_hit_rate": round(2 / 12, 6),  # prompts are one token past blocks
            "block_hits_won": 2,
            "block_hits_lost": 0,
            "retained_mean_fraction": 0.5,
            "retained_peak_fraction": 0.5,
        }
    ]


@pytest.mark.parametrize("capacity", [35, 69])
def test_without_retention_the_replay_is_the_lru_replay(capacity):
    trace = load_trace(TOKEN_FIXTURE)
    lru = retention_replay(trace, capacity, None)
    assert sum(lru.hits) == replay(trace, "lru", capacity).block_hits


def test_a_trace_without_arrival_times_is_refused(tmp_path, capsys):
    same = dataclasses.replace(from_chains(FLUSHED), timestamps=np.zeros(4))
    with pytest.raises(TraceError, match="no arrival times"):
        check_clock(same)
    backwards = dataclasses.replace(same, timestamps=np.array([0.0, 2.0, 1.0, 3.0]))
    with pytest.raises(TraceError, match="request 2 arrives before request 1"):
        check_clock(backwards)
    path = tmp_path / "untimed.jsonl"
    write_token_jsonl(path, [Request(0.0, np.arange(40, dtype=np.uint32))] * 3)
    argv = ["--workload", f"trace:{path}", "--capacity-blocks", "4", "--retain-s", "60"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "every request has the same timestamp (no arrival times)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--retain-s", "0"], "--retain-s must be a number of seconds > 0, got 0.0"),
        (["--retain-s", "60", "--policy", "s3fifo"], "--retain-s replays the cache's LRU"),
        (["--retain-max-fraction", "0.2"], "--retain-max-fraction needs --retain-s"),
        (["--retain-s", "60", "--tiers", "device"], "no planning flags"),
        (["--retain-s", "60", "--retain-max-fraction", "2"], "retention_max_fraction"),
    ],
)
def test_bad_retention_arguments_exit_with_a_message(extra, message, capsys):
    argv = ["--workload", f"trace:{TOKEN_FIXTURE}", "--capacity-blocks", "10", *extra]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_command_prints_the_rule_against_lru_on_the_fixture(capsys):
    argv = ["--workload", f"trace:{TOKEN_FIXTURE}", "--capacity-blocks", "5%",
            "--retain-s", "30", "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["results"]
    assert row == EXPECTED_FIXTURE_ROW
    assert main(argv[:-1]) == 0  # the table
    out = capsys.readouterr().out
    assert "conversation_tokens: 156 requests" in out
    assert "19.4%" in out and "19.6%" in out  # LRU's and the rule's block hits


# the replay's own figures, recorded (LRU's equals `replay`'s, checked above): the rule
# wins and loses hits at 5% of the unique blocks
EXPECTED_FIXTURE_ROW = {
    "capacity_blocks": 34,
    "lru_block_hit_rate": 0.194107,
    "retain_block_hit_rate": 0.196418,
    "lru_token_hit_rate": 0.185169,
    "retain_token_hit_rate": 0.187373,
    "block_hits_won": 24,
    "block_hits_lost": 20,
    "retained_mean_fraction": 0.472097,
    "retained_peak_fraction": 0.5,
}
