"""`python -m bench predictability`: runs and their labels, AUC, the whether oracle."""

from __future__ import annotations

import json

import numpy as np
import pytest
from bench_helpers import chains_from_paths, traces
from hypothesis import given, settings

from bench.hitrate import replay
from bench.predictability import (
    FEATURES,
    auc,
    find_runs,
    held_out_score,
    main,
    oracle_hits,
    references,
    tpr_at_fpr,
)
from bench.traces import from_chains, load_trace
from kvstore.index.policies import LRUPolicy

FIXTURE = "bench/fixtures/conversation_mooncake.jsonl"


def test_runs_have_the_features_a_cache_knows_and_whether_their_first_block_returns() -> None:
    # r0 [0,1]; r1 extends it (turn 2); r2 a new prompt; r3 extends r1 (turn 3); r4 extends r2
    trace = from_chains(chains_from_paths([[0, 0], [0, 0, 1], [1], [0, 0, 1, 2], [1, 0]]), 4)
    found = find_runs(trace, references(trace))
    table = np.stack([found.features[f] for f in FEATURES], axis=1).tolist()
    assert table == [
        # turn, hit, new, prompt tokens, gap ms (-1: nothing hit), arrival ms
        [1, 0, 2, 9, -1, 0],
        [2, 2, 1, 13, 1, 1],
        [1, 0, 1, 5, -1, 2],
        [3, 3, 1, 17, 2, 3],
        [2, 1, 1, 9, 2, 4],
    ]
    assert found.returns.tolist() == [True, True, True, False, False]


def test_auc_counts_ties_as_half() -> None:
    score = np.array([1.0, 2.0, 2.0, 3.0])
    label = np.array([False, True, False, True])
    # positives 2, 3 against negatives 1, 2: 1 + 0.5 + 1 + 1 of 4 pairs
    assert auc(score, label) == 0.875
    assert auc(score, np.zeros(4, dtype=bool)) is None


def test_tpr_at_fpr_takes_the_best_threshold_within_the_false_positive_budget() -> None:
    score = np.array([0.9, 0.8, 0.7, 0.6, 0.5])
    label = np.array([True, False, True, True, False])
    assert tpr_at_fpr(score, label, 0.0) == pytest.approx(1 / 3)
    assert tpr_at_fpr(score, label, 0.5) == 1.0
    # a threshold cannot split a tie: the tied negative comes with the tied positive
    tied = np.array([0.9, 0.5, 0.5, 0.1])
    assert tpr_at_fpr(tied, np.array([True, True, False, False]), 0.0) == 0.5
    assert tpr_at_fpr(tied, np.array([True, True, False, False]), 0.5) == 1.0


def test_auc_equals_a_pairwise_count() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        score = rng.integers(0, 4, 30).astype(float)  # many ties
        label = rng.random(30) < 0.4
        pos, neg = score[label], score[~label]
        pairs = [(p > n) + 0.5 * (p == n) for p in pos for n in neg]
        assert auc(score, label) == pytest.approx(sum(pairs) / len(pairs))


def test_the_held_out_scores_do_not_see_the_labels_they_are_scored_on() -> None:
    trace = load_trace(FIXTURE)
    found = find_runs(trace, references(trace))
    half = len(found.returns) // 2
    flipped = found.returns.copy()
    flipped[half:] = ~flipped[half:]
    score, _ = held_out_score(found)
    score_flipped, _ = held_out_score(found._replace(returns=flipped))
    assert np.array_equal(score, score_flipped)


def test_a_perfect_oracle_keeps_the_block_that_returns_where_lru_does_not() -> None:
    trace = from_chains([[0], [1], [2], [0]])  # capacity 2: LRU evicts 0 to store 2
    refs = references(trace)
    assert replay(trace, "lru", 2).block_hits == 0
    assert oracle_hits(trace, refs, 2, 1.0, 0.0) == 1
    assert oracle_hits(trace, refs, 2, 0.0, 0.0) == 0


def test_a_split_tail_is_judged_by_its_own_first_block() -> None:
    # y=0 returns at r4; [a b c] with c dead; [a b d] splits it, d returns at r5; z=5 dead.
    # At r3 the perfect oracle must evict c (dead) and keep y; judging the tail c by the
    # head's first block a (which returns) would evict y, the least recently used, instead.
    trace = from_chains([[0], [1, 2, 3], [1, 2, 4], [5], [0], [1, 2, 4]])
    refs = references(trace)
    assert oracle_hits(trace, refs, 5, 1.0, 0.0) == 2 + 1 + 3
    assert replay(trace, "lru", 5).block_hits == 2 + 0 + 3


def test_replay_refuses_a_policy_instance_that_was_used_before() -> None:
    trace = from_chains([[0], [1]])
    policy = LRUPolicy(2)
    assert replay(trace, policy, 2).block_hits == 0
    with pytest.raises(ValueError, match="fresh policy"):
        replay(trace, policy, 2)


@settings(max_examples=60, deadline=None)
@given(trace=traces())
def test_an_oracle_that_never_predicts_a_return_is_exactly_lru(trace) -> None:
    refs = references(trace)
    for capacity in (1, 2, 4):
        assert oracle_hits(trace, refs, capacity, 0.0, 0.0) == replay(trace, "lru", capacity)[0]


def test_oracle_at_zero_rates_matches_lru_on_the_fixture() -> None:
    trace = load_trace(FIXTURE)
    refs = references(trace)
    for capacity in (184, 552):
        assert oracle_hits(trace, refs, capacity, 0.0, 0.0) == replay(trace, "lru", capacity)[0]


def test_json_report_has_every_field(capsys) -> None:
    argv = ["--workload", f"trace:{FIXTURE}", "--capacity-blocks", "3%",
            "--oracle", "1:0,0:0", "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["feature_auc"]) == set(FEATURES)
    trace, seen, adding = load_trace(FIXTURE), set(), 0
    for r in range(trace.num_requests):  # requests that add a block, counted independently
        chain = trace.request(r).tolist()
        adding += not seen.issuperset(chain)
        seen.update(chain)
    assert report["runs"] == adding
    held = report["held_out_tpr_at_fpr"]["0.2"]
    assert 0.0 < held < 1.0 and 0 < report["runs_scored"] < report["runs"]
    rows = [(o["capacity_blocks"], o["tpr"], o["fpr"], o["held_out"]) for o in report["oracle"]]
    assert rows == [(552, 1.0, 0.0, False), (552, 0.0, 0.0, False), (552, held, 0.2, True)]
    lru = replay(trace, "lru", 552).block_hits / trace.num_refs
    assert report["oracle"][1]["block_hit_rate"] == pytest.approx(lru, abs=1e-6)
    assert report["oracle"][0]["ratio_to_offline"] > report["oracle"][1]["ratio_to_offline"]


@pytest.mark.parametrize("points", ["1:2", "x", "0.5"])
def test_bad_oracle_points_are_refused_with_a_message(points: str, capsys) -> None:
    argv = ["--workload", f"trace:{FIXTURE}", "--capacity-blocks", "1%", "--oracle", points]
    with pytest.raises(SystemExit):
        main(argv)
    assert "TPR:FPR" in capsys.readouterr().err
