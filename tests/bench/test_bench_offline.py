import numpy as np
import pytest
from bench_helpers import (
    brute_optimal_hits,
    chains_from_paths,
    naive_offline_hits,
    traces,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.hitrate.offline import (
    NEVER,
    infinite_hits,
    next_use,
    offline_leaf_hits,
    upper_bound_hits,
)
from bench.traces import from_chains


def test_next_use_points_at_the_next_reference_of_the_same_block():
    blocks = np.array([5, 1, 5, 2, 1, 5])
    assert next_use(blocks).tolist() == [2, 4, 5, NEVER, NEVER, NEVER]


def test_upper_bound_bypasses_a_block_used_farther_than_every_resident_one():
    # capacity 1: keeping block 0 yields 2 hits; storing the one-off blocks would yield 0
    trace = from_chains([[0], [1], [0], [2], [0]])
    assert upper_bound_hits(trace, 1) == 2
    assert brute_optimal_hits(trace, 1) == 2


def test_offline_reference_inserts_every_block_so_a_one_off_evicts_the_reused_one():
    trace = from_chains([[0], [1], [0], [2], [0]])
    assert offline_leaf_hits(trace, 1).block_hits == 0
    assert offline_leaf_hits(trace, 2).block_hits == 2


def test_offline_reference_never_evicts_the_requests_own_path():
    # request 2 hits [0, 1] and needs one more block: only leaf 3 of request 1 can go
    trace = from_chains([[0, 1], [4, 3], [0, 1, 2], [0, 1, 2]])
    result = offline_leaf_hits(trace, 4)
    assert result.block_hits == 2 + 3
    assert result.token_hits == 5


def test_infinite_capacity_hits_every_reference_after_a_blocks_first():
    trace = from_chains(chains_from_paths([[0, 1], [0, 1, 2], [1], [0, 2]]))
    assert infinite_hits(trace) == 3


def _first_refs(trace, limit: int):
    """The longest run of whole requests with at most `limit` block references."""
    keep = int(np.searchsorted(trace.offsets, limit, side="right")) - 1
    return from_chains([trace.request(r) for r in range(keep)])


@pytest.mark.parametrize("capacity", [1, 2, 3, 4])
@settings(max_examples=40, derandomize=True, deadline=None)
@given(trace=traces())
def test_upper_bound_equals_an_exhaustive_search_over_schedules(capacity, trace):
    trace = _first_refs(trace, 22)  # the search is exponential in the capacity
    assert upper_bound_hits(trace, capacity) == brute_optimal_hits(trace, capacity)


@pytest.mark.parametrize("capacity", [1, 2, 4, 8])
@settings(max_examples=60, derandomize=True, deadline=None)
@given(trace=traces())
def test_offline_reference_equals_a_naive_block_level_simulation(capacity, trace):
    assert offline_leaf_hits(trace, capacity).block_hits == sum(naive_offline_hits(trace, capacity))


@settings(max_examples=60, derandomize=True, deadline=None)
@given(trace=traces(), capacity=st.integers(1, 12))
def test_offline_reference_and_infinite_capacity_bracket_the_upper_bound(trace, capacity):
    bound = upper_bound_hits(trace, capacity)
    assert offline_leaf_hits(trace, capacity).block_hits <= bound <= infinite_hits(trace)


def test_capacity_below_one_block_is_rejected():
    trace = from_chains([[0]])
    with pytest.raises(ValueError, match="capacity"):
        upper_bound_hits(trace, 0)
    with pytest.raises(ValueError, match="capacity"):
        offline_leaf_hits(trace, 0)
