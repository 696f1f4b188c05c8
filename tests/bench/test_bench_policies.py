"""The policies added for prompt workloads: adaptive S3-FIFO and ARC over radix entries."""

import pytest

from kvstore.index.policies import MAIN, SMALL, AdaptiveS3FIFOPolicy, ARCPolicy


def add(policy, *keys: int, size: int = 1) -> None:
    for key in keys:
        policy.insert(key, size, tag=key)
        policy.set_evictable(key, True)


def evict(policy) -> int:
    key = policy.victim()
    policy.remove(key, tag=key)
    return key


@pytest.mark.parametrize("cls", [AdaptiveS3FIFOPolicy, ARCPolicy])
def test_content_evicted_unhit_and_coming_back_is_admitted_to_the_main_queue(cls):
    policy = cls(10)
    add(policy, 1, 2)
    assert evict(policy) == 1  # unhit, from the small queue: remembered
    policy.insert(11, 1, tag=1)  # the same content returns
    assert policy._entries[11].queue == MAIN
    policy.insert(12, 1, tag=3)  # never seen
    assert policy._entries[12].queue == SMALL
    policy.check_integrity()


def test_a_recent_small_queue_ghost_hit_grows_the_small_share_as_arc_does():
    policy = AdaptiveS3FIFOPolicy(100, small_fraction=0.1)
    add(policy, 1, size=5)
    evict(policy)
    policy.insert(2, 5, tag=1)
    assert policy._small_share == pytest.approx(0.1 + 5 / 100)


def test_a_recent_main_queue_ghost_hit_shrinks_the_small_share():
    policy = AdaptiveS3FIFOPolicy(100, small_fraction=0.1)
    add(policy, 1, size=4)
    evict(policy)
    policy.insert(2, 4, tag=1)  # back into main
    policy.set_evictable(2, True)
    assert policy._small_share == pytest.approx(0.14)
    assert evict(policy) == 2  # evicted from main: remembered in the main history
    policy.insert(3, 4, tag=2)
    assert policy._small_share == pytest.approx(0.10)


def test_a_ghost_hit_older_than_a_capacity_of_evictions_admits_without_adapting():
    policy = AdaptiveS3FIFOPolicy(10, small_fraction=0.1, ghost_factor=4)
    add(policy, 1)
    evict(policy)
    for key in range(100, 111):  # 11 more blocks evicted from the small queue after tag 1
        add(policy, key)
        evict(policy)
    policy.insert(2, 1, tag=1)
    assert policy._entries[2].queue == MAIN
    assert policy._small_share == pytest.approx(0.1)


def test_ghost_histories_hold_at_most_ghost_factor_capacities_of_blocks():
    policy = AdaptiveS3FIFOPolicy(10, ghost_factor=2)
    for key in range(50):
        add(policy, key, size=3)
        evict(policy)
    history = policy._histories[SMALL]
    assert history.blocks == 18  # six runs of 3 blocks fit in 2 x 10
    assert list(history.tags) == list(range(44, 50))
    policy.check_integrity()


def test_the_small_share_stays_within_its_bounds():
    policy = AdaptiveS3FIFOPolicy(10, small_fraction=0.5, min_small=0.2, max_small=0.6)
    for key in range(20):
        add(policy, key, size=3)
        evict(policy)
        policy.insert(100 + key, 3, tag=key)
        policy.remove(100 + key)
    assert policy._small_share == pytest.approx(0.6)
    policy.check_integrity()


def test_arc_moves_a_hit_entry_to_the_frequency_queue_and_keeps_lru_order():
    policy = ARCPolicy(10, small_fraction=0.3)
    add(policy, 1, 2, 3, 4, 5)
    policy.access(2)
    policy.access(4)
    assert policy._entries[2].queue == MAIN
    policy.touch(2)  # 4 is now the older of the two hit entries
    # the recency queue holds 1, 3, 5: at its 3-block target it gives up its LRU entry; below
    # target the frequency queue gives up its LRU entries; then the rest of the recency queue
    assert [evict(policy) for _ in range(5)] == [1, 4, 2, 3, 5]


def test_arc_evicts_one_time_entries_of_a_scan_before_reused_ones():
    policy = ARCPolicy(10, small_fraction=0.1)
    add(policy, 1, 2)
    policy.access(1)
    policy.access(2)
    add(policy, *range(3, 11))
    assert [evict(policy) for _ in range(8)] == list(range(3, 11))
    assert [evict(policy) for _ in range(2)] == [1, 2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ghost_factor": 0}, "ghost_factor"),
        ({"min_small": 0.5, "small_fraction": 0.1}, "min_small <= small_fraction"),
        ({"max_small": 1.0}, "max_small < 1"),
    ],
)
def test_invalid_parameters_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveS3FIFOPolicy(10, **kwargs)
