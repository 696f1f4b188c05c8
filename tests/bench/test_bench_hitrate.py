import json
from pathlib import Path

import pytest
from bench_helpers import naive_block_lru_hits, requests, run_lru_hits, traces
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.hitrate import main, parse_capacities, replay
from bench.hitrate.live import live_replay, mooncake_answers, with_answers
from bench.hitrate.offline import (
    block_lru_hits,
    infinite_hits,
    offline_leaf_hits,
    upper_bound_hits,
)
from bench.traces import BlockTrace, from_chains
from kvstore.index.policies import POLICIES

FIXTURES = Path(__file__).resolve().parents[2] / "bench" / "fixtures"
TOKEN_FIXTURE = FIXTURES / "conversation_tokens.jsonl"
MOONCAKE_FIXTURE = FIXTURES / "conversation_mooncake.jsonl"


def per_request_hits(trace: BlockTrace, policy: str, capacity: int) -> list[int]:
    hits: list[int] = []
    replay(trace, policy, capacity, on_request=lambda r, hit, index: hits.append(hit))
    return hits


def test_lru_replay_on_a_small_example_counts_hits_and_evicts_the_oldest_leaf():
    # capacity 3: request 2 trims blocks 2 and 1 off the tail of run [0, 1, 2]; request 3
    # hits block 0 (now locked) and evicts run [3, 4], the least recently used leaf
    trace = from_chains([[0, 1, 2], [0, 1, 2], [3, 4], [0, 1, 2], [0, 1], [3]], block_tokens=16)
    assert per_request_hits(trace, "lru", 3) == [0, 3, 0, 1, 2, 0]
    result = replay(trace, "lru", 3)
    assert result.block_hits == 6
    assert result.token_hits == 6 * 16


def test_a_hit_refreshes_only_the_blocks_it_used_as_block_exact_lru_does():
    # capacity 4: request 2 hits block 0 only, so blocks 1 and 2 keep request 0's recency;
    # request 3 evicts block 2 (the oldest leaf block), not run [3], which request 4 then
    # hits. Recency per run would refresh [0, 1, 2] whole on request 2 and evict [3] instead.
    trace = from_chains([[0, 1, 2], [3], [0], [4], [3]], block_tokens=16)
    expected = [0, 0, 1, 0, 1]
    assert per_request_hits(trace, "lru", 4) == expected
    assert naive_block_lru_hits(trace, 4) == expected
    assert block_lru_hits(trace, 4).block_hits == live_replay(trace, 4).block_hits == 2
    assert run_lru_hits(trace, 4) == [0, 0, 1, 0, 0]


@pytest.mark.parametrize("capacity", [1, 2, 3, 5, 8, 13])
@settings(max_examples=40, derandomize=True, deadline=None)
@given(trace=traces())
def test_lru_replay_equals_block_exact_lru(capacity, trace):
    hits = per_request_hits(trace, "lru", capacity)
    assert hits == naive_block_lru_hits(trace, capacity)
    assert block_lru_hits(trace, capacity).block_hits == sum(hits)


@pytest.mark.parametrize("capacity", [1, 3, 8])
@settings(max_examples=15, derandomize=True, deadline=None)
@given(trace=traces())
def test_the_live_cache_hits_what_the_replay_hits(capacity, trace):
    assert live_replay(trace, capacity).block_hits == replay(trace, "lru", capacity).block_hits


@pytest.mark.parametrize("capacity", [2000, 8000])
def test_mooncake_fixture_with_answers_stored_hits_as_block_exact_lru_everywhere(capacity):
    # each stored answer is an unused tail that the next turn's hit ends before
    from bench.traces import load_trace

    trace = load_trace(MOONCAKE_FIXTURE)
    stored, lookup = with_answers(trace, mooncake_answers(MOONCAKE_FIXTURE))
    assert stored.num_refs - trace.num_refs == 1605
    exact = block_lru_hits(stored, capacity, lookup=lookup).block_hits
    assert exact == {2000: 10300, 8000: 16077}[capacity]
    assert replay(stored, "lru", capacity, lookup=lookup).block_hits == exact
    assert live_replay(stored, capacity, lookup).block_hits == exact


class Shadow:
    """Checks every request of a replay against the index content before and after it."""

    def __init__(self, trace: BlockTrace, capacity: int):
        self.blocks, self.capacity = requests(trace), capacity
        self.parents = trace.parents().tolist()
        self.resident: set[int] = set()  # block ids are the dense ids

    def __call__(self, r: int, hit: int, index) -> None:
        blocks = self.blocks[r]
        expected = next((j for j, b in enumerate(blocks) if b not in self.resident), len(blocks))
        assert hit == expected, "the hit is the longest resident prefix"
        index.check_integrity()
        now = set(index.all_block_ids())
        assert len(now) == index.num_cached_blocks <= self.capacity
        assert set(blocks[:hit]) <= now, "the request's own hit path was evicted"
        assert set(blocks) <= now or len(now) == self.capacity, "room was left unused"
        assert all(self.parents[b] in now or self.parents[b] < 0 for b in now), "not a tree"
        self.resident = now


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("capacity", [1, 3, 6, 20])
@settings(max_examples=25, derandomize=True, deadline=None)
@given(trace=traces())
def test_every_policy_counts_the_longest_resident_prefix_and_keeps_the_invariants(
    policy, capacity, trace
):
    replay(trace, policy, capacity, on_request=Shadow(trace, capacity))


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_replays_the_mooncake_fixture_consistently(policy):
    from bench.traces import load_trace

    trace = load_trace(MOONCAKE_FIXTURE)
    trace = from_chains([trace.request(r) for r in range(300)], block_tokens=512)
    capacity = 120
    replay(trace, policy, capacity, on_request=Shadow(trace, capacity))


@settings(max_examples=60, derandomize=True, deadline=None)
@given(trace=traces(), capacity=st.integers(1, 16))
def test_no_policy_beats_the_upper_bound(trace, capacity):
    bound = upper_bound_hits(trace, capacity)
    assert bound <= infinite_hits(trace)
    assert offline_leaf_hits(trace, capacity).block_hits <= bound
    for policy in POLICIES:
        assert replay(trace, policy, capacity).block_hits <= bound, policy


def test_capacities_parse_blocks_and_percentages_of_unique_blocks():
    assert parse_capacities("10,1%,10", 1000) == [10]
    assert parse_capacities("5%, 200", 1000) == [50, 200]
    assert parse_capacities("0.01%", 1000) == [1]
    with pytest.raises(ValueError, match="neither a block count nor a percentage"):
        parse_capacities("lots", 1000)
    with pytest.raises(ValueError, match="at least 1 block"):
        parse_capacities("0", 1000)


RESULT_FIELDS = {
    "policy",
    "capacity_blocks",
    "block_hit_rate",
    "token_hit_rate",
    "optimal_block_hit_rate",
    "offline_block_hit_rate",
    "ratio_to_optimal",
    "ratio_to_offline",
}


def test_json_report_has_the_documented_fields_and_files(tmp_path, capsys):
    argv = ["--workload", f"trace:{TOKEN_FIXTURE}", "--capacity-blocks", "5%,100"]
    assert main([*argv, "--policy", "all", "--json", "--out", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["unique_blocks"] == 687
    assert report["requests"] == 156
    assert report["block_refs"] == 1731
    assert report["infinite_block_hit_rate"] == round((1731 - 687) / 1731, 6)
    assert [(r["capacity_blocks"], r["policy"]) for r in report["results"]] == [
        (c, p) for c in (34, 100) for p in POLICIES
    ]
    for r in report["results"]:
        assert set(r) == RESULT_FIELDS
        assert r["block_hit_rate"] <= r["optimal_block_hit_rate"]
        assert r["offline_block_hit_rate"] <= r["optimal_block_hit_rate"]
        assert r["optimal_block_hit_rate"] <= report["infinite_block_hit_rate"]
        assert r["ratio_to_optimal"] == pytest.approx(
            r["block_hit_rate"] / r["optimal_block_hit_rate"], abs=1e-4
        )
    assert json.loads((tmp_path / "hitrate.json").read_text()) == report
    table = (tmp_path / "hitrate.md").read_text().splitlines()
    rows = sum(line.startswith(("| 34 ", "| 100 ")) for line in table)
    assert rows == 2 * len(POLICIES)
    assert (tmp_path / "hitrate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_generated_workload_with_params_runs_and_prints_a_table(capsys):
    argv = [
        "--workload",
        "shared-prefix",
        "--param",
        "num_groups=4",
        "--param",
        "prompts_per_group=3",
        "--param",
        "system_prompt_len=64",
        "--param",
        "question_len=16",
        "--capacity-blocks",
        "10",
        "--policy",
        "lru,as3fifo",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "shared-prefix: 12 requests" in out
    assert "as3fifo" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "nope", "--capacity-blocks", "1"], "unknown workload 'nope'"),
        (["--workload", "rag", "--param", "x", "--capacity-blocks", "1"], "KEY=VALUE"),
        (["--workload", "trace:/nonexistent.jsonl", "--capacity-blocks", "1"], "no such trace"),
        (["--workload", "multiturn", "--capacity-blocks", "1", "--policy", "mru"], "'mru'"),
    ],
)
def test_bad_arguments_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
