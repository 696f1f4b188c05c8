import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.config import POLICY_NAMES
from kvstore.index.policies import (
    POLICIES,
    LFUPolicy,
    LRUPolicy,
    Policy,
    S3FIFOPolicy,
    SLRUPolicy,
    make_policy,
)


def add(policy: Policy, *keys: int, size: int = 1) -> None:
    for key in keys:
        policy.insert(key, size, tag=key)
        policy.set_evictable(key, True)


def drain(policy: Policy) -> list[int]:
    """Evict everything evictable, in victim order."""
    order = []
    while (key := policy.victim()) is not None:
        policy.remove(key, tag=key)
        order.append(key)
    policy.check_integrity()
    return order


def test_registry_names_match_the_config_choices():
    assert tuple(POLICIES) == POLICY_NAMES
    for name in POLICY_NAMES:
        assert isinstance(make_policy(name, 100), POLICIES[name])


def test_unknown_policy_name_raises_listing_the_choices():
    with pytest.raises(ValueError, match="'lru', 'lfu', 'slru', 's3fifo'"):
        make_policy("fifo")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_capacity_must_be_positive(name):
    with pytest.raises(ValueError, match="capacity_blocks"):
        make_policy(name, 0)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_empty_policy_has_no_victim(name):
    assert make_policy(name).victim() is None


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_entries_that_are_not_evictable_are_never_chosen(name):
    policy = make_policy(name, 10)
    add(policy, 1, 2, 3)
    policy.set_evictable(1, False)
    policy.insert(4, 2)  # inserted entries start not evictable
    assert sorted(drain(policy)) == [2, 3]
    assert policy.entries() == {1: (1, False), 4: (2, False)}
    policy.set_evictable(4, True)
    assert drain(policy) == [4]
    policy.set_evictable(1, True)
    assert drain(policy) == [1]
    assert policy.entries() == {}


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_resize_keeps_the_entry_and_updates_its_size(name):
    policy = make_policy(name, 10)
    add(policy, 1, size=4)
    policy.resize(1, 3, tag=99)
    assert policy.entries() == {1: (3, True)}
    assert policy.victim() == 1
    policy.check_integrity()


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_repeated_hits_keep_policy_state_bounded(name):
    policy = make_policy(name, 10)
    add(policy, 1, 2)
    for _ in range(10_000):
        policy.access(1)
        policy.touch(2)
    heaps = getattr(policy, "_heaps", None)
    if heaps is None:  # lhd: one record per entry, nothing per access
        assert (len(policy._entries), len(policy._evictable)) == (2, 2)
    else:
        assert sum(len(h) for h in heaps) <= 2 * 2 + 64 + 1
    policy.check_integrity()


def test_lru_evicts_least_recently_used_first():
    policy = LRUPolicy()
    add(policy, 1, 2, 3)
    policy.access(1)
    assert policy.victim() == 2
    policy.touch(2)
    assert drain(policy) == [3, 1, 2]


def test_lru_entry_becoming_evictable_again_keeps_its_recency():
    policy = LRUPolicy()
    add(policy, 1, 2)
    policy.set_evictable(1, False)
    assert policy.victim() == 2
    policy.set_evictable(1, True)
    assert drain(policy) == [1, 2]


def test_split_entry_inherits_the_history_of_the_entry_it_came_from():
    policy = LRUPolicy()
    add(policy, 1, 2)
    policy.insert(3, 1, like=1)
    policy.set_evictable(3, True)
    assert drain(policy) == [1, 3, 2]


def test_lfu_evicts_fewest_hits_first_with_recency_breaking_ties():
    policy = LFUPolicy()
    add(policy, 1, 2, 3)
    policy.access(1)
    policy.access(1)
    policy.access(3)
    assert drain(policy) == [2, 3, 1]
    add(policy, 4, 5)
    policy.touch(4)  # recency only: 4 and 5 both have one use, 5 is now older
    assert drain(policy) == [5, 4]


def test_slru_protects_reused_entries_from_a_scan():
    scan = list(range(3, 11))
    lru, slru = LRUPolicy(10), SLRUPolicy(10)
    for policy in (lru, slru):
        add(policy, 1, 2)
        policy.access(1)
        policy.access(2)
        add(policy, *scan)
    assert drain(lru) == [1, 2, *scan]
    assert drain(slru) == [*scan, 1, 2]


def test_slru_demotes_the_protected_lru_when_the_segment_overflows():
    policy = SLRUPolicy(10)  # protected segment: at most 8 blocks
    add(policy, *range(1, 10))
    for key in range(1, 10):
        policy.access(key)  # the 9th promotion demotes 1
    add(policy, 10)
    assert drain(policy) == [1, 10, *range(2, 10)]


def test_s3fifo_evicts_one_hit_entries_from_the_small_queue_first():
    policy = S3FIFOPolicy(10)
    add(policy, 1, 2, 3, 4, 5)
    policy.access(1)  # hit while small: moves to main instead of being evicted
    assert drain(policy) == [2, 3, 4, 5, 1]


def test_s3fifo_main_queue_reinserts_hit_entries():
    policy = S3FIFOPolicy(10)
    add(policy, 1, 2, 3)
    for key in (1, 2, 3):
        policy.access(key)
    assert policy.victim() == 1  # all moved to main with their counters cleared
    policy.access(1)
    assert drain(policy) == [2, 3, 1]


def test_s3fifo_clears_the_counter_of_entries_moving_to_main():
    policy = S3FIFOPolicy(10)
    add(policy, 1, 2, 3)
    for key in (1, 1, 1, 2):
        policy.access(key)
    assert drain(policy) == [3, 1, 2]  # 1's three hits do not follow it into main


def test_s3fifo_ghost_hit_admits_straight_to_main():
    policy = S3FIFOPolicy(10)
    add(policy, 1)
    assert drain(policy) == [1]  # evicted unhit from small: tag 1 becomes a ghost
    policy.insert(2, 1, tag=1)  # same content comes back
    policy.set_evictable(2, True)
    add(policy, 3)
    assert drain(policy) == [3, 2]


# --- randomized: LRU and LFU against a brute-force reference ------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "like", "remove", "access", "touch", "flag", "victim"]),
        st.integers(0, 7),
        st.integers(0, 7),
    ),
    max_size=60,
)


def _reference_victim(ref: dict[int, list], lfu: bool) -> int | None:
    live = [(c if lfu else 0, t, k) for k, (ev, c, t) in ref.items() if ev]
    return min(live)[2] if live else None


@pytest.mark.parametrize("name", ["lru", "lfu"])
@settings(max_examples=150, derandomize=True, deadline=None)
@given(ops=OPS)
def test_lru_and_lfu_victims_equal_a_brute_force_reference(name, ops):
    policy, lfu = make_policy(name), name == "lfu"
    ref: dict[int, list] = {}  # key -> [evictable, count, last tick]
    for tick, (op, key, other) in enumerate(ops, start=1):
        if op == "insert" and key not in ref:
            policy.insert(key, 1)
            ref[key] = [False, 1, tick]
        elif op == "like" and key not in ref and other in ref:
            policy.insert(key, 1, like=other)
            ref[key] = [False, *ref[other][1:]]
        elif op == "remove" and key in ref:
            policy.remove(key)
            del ref[key]
        elif op in ("access", "touch") and key in ref:
            getattr(policy, op)(key)
            ref[key][1] += op == "access"
            ref[key][2] = tick
        elif op == "flag" and key in ref:
            policy.set_evictable(key, not ref[key][0])
            ref[key][0] = not ref[key][0]
        assert policy.victim() == _reference_victim(ref, lfu)
        policy.check_integrity()


@pytest.mark.parametrize("name", ["slru", "s3fifo"])
@settings(max_examples=150, derandomize=True, deadline=None)
@given(ops=OPS)
def test_segmented_policies_only_choose_live_evictable_entries(name, ops):
    apply_ops_checking_victims(make_policy(name, 8), ops)


def apply_ops_checking_victims(policy: Policy, ops: list[tuple[str, int, int]]) -> None:
    """Run `ops`; after each, the victim is None iff nothing is evictable, else a live
    evictable entry, and the policy's entries match a dict model."""
    evictable: dict[int, bool] = {}
    for op, key, other in ops:
        if op in ("insert", "like") and key not in evictable:
            like = other if op == "like" and other in evictable else None
            policy.insert(key, 1 + other % 3, tag=other, like=like)
            evictable[key] = False
        elif op == "remove" and key in evictable:
            policy.remove(key, tag=key)
            del evictable[key]
        elif op in ("access", "touch") and key in evictable:
            getattr(policy, op)(key)
        elif op == "flag" and key in evictable:
            evictable[key] = not evictable[key]
            policy.set_evictable(key, evictable[key])
        elif op == "victim" and (victim := policy.victim()) is not None:
            policy.remove(victim, tag=victim)
            del evictable[victim]
        victim = policy.victim()
        assert (victim is None) == (not any(evictable.values()))
        assert victim is None or evictable[victim]
        assert {k: ev for k, (_, ev) in policy.entries().items()} == evictable
        policy.check_integrity()
    assert sorted(drain(policy)) == sorted(k for k, ev in evictable.items() if ev)
