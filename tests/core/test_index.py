from unittest import mock

import numpy as np
import pytest

from hashing import BlockHasher, Namespace
from kvstore.fleet.events import EventSink, KVEvent
from kvstore.index import IntegrityError, RadixIndex, TreeNode
from kvstore.index.policies import POLICIES, LFUPolicy, make_policy

BS = 4
HASHER = BlockHasher(Namespace("index-model", "float32", 1, 1, 4, BS))


def prompt(*blocks: int) -> np.ndarray:
    """One block of BS equal tokens per argument."""
    return np.repeat(np.array(blocks, dtype=np.uint32), BS)


def keys(tokens: np.ndarray) -> list[bytes]:
    return HASHER.hash_blocks(tokens)


def insert(index: RadixIndex, tokens: np.ndarray, ids: list[int]) -> list[int]:
    unkept = index.insert(keys(tokens), tokens, ids)
    index.check_integrity()
    return unkept


def match(index: RadixIndex, tokens: np.ndarray, num_blocks: int | None = None):
    return index.match_prefix(keys(tokens)[:num_blocks], tokens)


A = prompt(1, 2, 3, 4)
B = prompt(1, 2, 7, 8)  # shares A's first 2 blocks


def shared_tree() -> RadixIndex:
    """root -> [1 2] -> {[3 4], [7 8]}"""
    index = RadixIndex(BS)
    insert(index, A, [0, 1, 2, 3])
    assert insert(index, B, [10, 11, 12, 13]) == [10, 11]
    return index


def test_empty_index_matches_nothing_and_returns_the_root():
    index = RadixIndex(BS)
    result = match(index, A)
    assert (result.num_blocks, result.block_ids, result.last_node) == (0, [], index.root)
    assert match(index, prompt()).num_blocks == 0


def test_inserted_prompt_matches_every_block_in_order():
    index = RadixIndex(BS)
    assert insert(index, A, [5, 6, 7, 8]) == []
    result = match(index, np.concatenate([A, [9, 9]]).astype(np.uint32))
    assert (result.num_blocks, result.block_ids) == (4, [5, 6, 7, 8])
    assert (index.num_cached_blocks, index.num_evictable_blocks, index.num_nodes) == (4, 4, 1)


def test_diverging_prompts_split_the_shared_run_and_return_the_redundant_ids():
    index = shared_tree()
    assert (index.num_cached_blocks, index.num_nodes) == (6, 3)
    (shared,) = index.root.children.values()
    assert shared.num_blocks == 2 and len(shared.children) == 2
    assert match(index, A).block_ids == [0, 1, 2, 3]
    assert match(index, B).block_ids == [0, 1, 12, 13]
    assert sorted(index.all_block_ids()) == [0, 1, 2, 3, 12, 13]


def test_ids_the_index_already_holds_are_not_returned_as_redundant():
    index = shared_tree()
    c = prompt(1, 2, 3, 4, 5)
    matched = match(index, c).block_ids
    assert insert(index, c, [*matched, 20]) == []
    assert match(index, c).block_ids == [0, 1, 2, 3, 20]


def test_inserting_a_prefix_of_a_cached_run_adds_nothing_and_splits_off_the_used_blocks():
    index = RadixIndex(BS)
    insert(index, A, [0, 1, 2, 3])
    assert insert(index, A[: 2 * BS], [7, 8]) == [7, 8]
    assert (index.num_cached_blocks, index.num_nodes) == (4, 2)
    (head,) = index.root.children.values()
    assert (head.num_blocks, [c.num_blocks for c in head.children.values()]) == (2, [2])


def test_match_ending_inside_a_run_splits_it_and_locks_only_the_matched_blocks():
    index = RadixIndex(BS)
    insert(index, A, [0, 1, 2, 3])
    result = match(index, A, num_blocks=2)
    assert (result.num_blocks, result.block_ids) == (2, [0, 1])
    assert index.num_nodes == 2 and result.last_node.num_blocks == 2
    index.lock(result.last_node)
    index.check_integrity()
    assert index.num_evictable_blocks == 2
    assert index.evict(4) == [2, 3]
    index.unlock(result.last_node)
    assert index.num_evictable_blocks == 2


def test_a_hit_refreshes_only_the_blocks_it_used():
    # [1 2 3 4] then [5 6]; a hit on [1 2] leaves [3 4] older than [5 6]: it goes first
    index = RadixIndex(BS)
    insert(index, A, [0, 1, 2, 3])
    insert(index, prompt(5, 6), [4, 5])
    match(index, A, num_blocks=2)
    assert _eviction_order(index) == [3, 2, 5, 4, 1, 0]
    index.check_integrity()


def test_peek_prefix_ending_inside_a_run_splits_nothing():
    index = RadixIndex(BS)
    insert(index, A, [0, 1, 2, 3])
    result = index.peek_prefix(keys(A)[:2], A)
    assert (result.num_blocks, result.last_node.num_blocks, index.num_nodes) == (2, 4, 1)


class Recorder(EventSink):
    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def emit(self, event: KVEvent) -> None:
        self.events.append(event)


def test_a_split_on_a_hit_emits_no_event_and_keeps_the_locks():
    sink = Recorder()
    index = RadixIndex(BS, events=sink)
    insert(index, A, [0, 1, 2, 3])
    held = match(index, A).last_node
    index.lock(held)
    assert len(sink.events) == 1
    head = match(index, A, num_blocks=1).last_node
    assert len(sink.events) == 1 and head is not held and held.parent is head
    assert (head.ref_cnt, held.ref_cnt, index.num_evictable_blocks) == (1, 1, 0)
    index.unlock(held)
    index.check_integrity()
    assert index.num_evictable_blocks == 4


def _used_tree(policy: str) -> RadixIndex:
    """shared_tree's runs under `policy`, with a hit on [1 2 3 4] to give it some history."""
    index = RadixIndex(BS, make_policy(policy, 16))
    insert(index, A, [0, 1, 2, 3])
    insert(index, B, [10, 11, 12, 13])
    insert(index, prompt(5, 6), [20, 21])
    match(index, A)
    return index


def _eviction_order(index: RadixIndex) -> list[int]:
    return [b for _ in range(index.num_cached_blocks) for b in index.evict(1)]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_peek_prefix_finds_what_match_prefix_finds_and_records_nothing(policy):
    peeked, control = _used_tree(policy), _used_tree(policy)
    spy = mock.Mock(wraps=peeked.policy)
    peeked.policy = spy
    for tokens, num_blocks in ((B, None), (A, 3), (prompt(5, 6, 7), None), (prompt(9), None)):
        got = peeked.peek_prefix(keys(tokens)[:num_blocks], tokens)
        want = match(control, tokens, num_blocks)
        assert (got.num_blocks, got.block_ids) == (want.num_blocks, want.block_ids)
        # the same run, which match splits where the hit ends and peek leaves whole
        head = want.last_node.block_ids.tolist()
        assert got.last_node.block_ids.tolist()[: len(head)] == head
    assert spy.mock_calls == []
    peeked.policy = spy._mock_wraps
    control = _used_tree(policy)  # the matches above recorded hits on the control
    assert _eviction_order(peeked) == _eviction_order(control)


def test_a_key_hit_with_different_tokens_is_a_miss():
    index = RadixIndex(BS)
    insert(index, A, [0, 1, 2, 3])
    other = A.copy()
    other[2 * BS + 1] = 99  # block 2 differs, but we pass A's keys
    result = index.match_prefix(keys(A), other)
    assert (result.num_blocks, result.block_ids) == (2, [0, 1])
    other[0] = 99
    assert index.match_prefix(keys(A), other).last_node is index.root


def test_a_lookup_key_collision_is_never_stored_over_the_cached_block():
    index = RadixIndex(BS)
    insert(index, A, [0, 1, 2, 3])
    other = A.copy()
    other[BS] = 99  # block 1 differs but claims A's keys
    assert index.insert(keys(A), other, [0, 5, 6, 7]) == [5, 6, 7]
    index.check_integrity()
    assert match(index, A).block_ids == [0, 1, 2, 3]
    assert index.num_cached_blocks == 4


def test_truncated_keys_that_collide_keep_prompts_apart():
    hasher = BlockHasher(HASHER.namespace, key_bytes=1)
    first_seen: dict[bytes, int] = {}
    for t in range(257):
        key = hasher.hash_blocks(prompt(t))[0]
        if key in first_seen:
            break
        first_seen[key] = t
    x, y = prompt(first_seen[key], 5), prompt(t, 5)
    index = RadixIndex(BS)
    assert index.insert(hasher.hash_blocks(x), x, [0, 1]) == []
    assert index.match_prefix(hasher.hash_blocks(y), y).num_blocks == 0
    assert index.insert(hasher.hash_blocks(y), y, [2, 3]) == [2, 3]
    assert index.match_prefix(hasher.hash_blocks(x), x).block_ids == [0, 1]
    index.check_integrity()


def test_locked_path_is_not_evicted_and_unlocking_releases_it():
    index = shared_tree()
    result = match(index, A)
    index.lock(result.last_node)
    assert index.num_evictable_blocks == 2
    assert index.evict(10) == [12, 13]
    index.check_integrity()
    assert index.evict(10) == []
    index.unlock(result.last_node)
    assert index.num_evictable_blocks == 4
    assert index.evict(10) == [2, 3, 0, 1]  # the leaf goes before its parent
    assert (index.num_cached_blocks, index.num_nodes) == (0, 0)
    index.check_integrity()


def test_partial_eviction_trims_a_leaf_from_its_tail():
    index = RadixIndex(BS)
    insert(index, A, [0, 1, 2, 3])
    assert index.evict(1) == [3]
    index.check_integrity()
    assert match(index, A).block_ids == [0, 1, 2]
    assert index.evict(2) == [1, 2]
    assert (index.num_cached_blocks, index.num_nodes) == (1, 1)
    assert insert(index, A, [0, 7, 8, 9]) == []  # the evicted tail can come back
    assert match(index, A).block_ids == [0, 7, 8, 9]


def test_eviction_follows_the_policy():
    index = RadixIndex(BS, "lru")
    insert(index, prompt(1, 2), [0, 1])
    insert(index, prompt(3, 4), [2, 3])
    match(index, prompt(1, 2))  # a hit makes [1 2] the most recently used
    assert index.evict(2) == [2, 3]
    insert(index, prompt(3, 4), [2, 3])
    insert(index, prompt(1, 2), [4, 5])  # storing it again refreshes [1 2] too
    assert index.evict(2) == [2, 3]
    lfu = RadixIndex(BS, LFUPolicy())
    insert(lfu, prompt(1), [0])
    insert(lfu, prompt(2), [1])
    match(lfu, prompt(1))
    match(lfu, prompt(1))
    match(lfu, prompt(2))
    assert lfu.evict(1) == [1]


def test_on_evict_sees_the_blocks_and_their_path_before_they_leave():
    index = shared_tree()
    seen = []

    def on_evict(node: TreeNode, start: int, ids: list[int]) -> None:
        upto = start + len(ids)
        tokens = index.path_token_ids(node, upto)
        seen.append((node.start + start, ids, tokens.tolist(), index.path_keys(node, upto)))

    assert index.evict(3, on_evict) == [2, 3, 13]
    assert seen == [
        (2, [2, 3], A.tolist(), keys(A)),
        (3, [13], B.tolist(), keys(B)),
    ]
    assert index.path_block_ids(match(index, B).last_node) == [0, 1, 12]


def test_split_of_a_locked_run_keeps_both_parts_locked():
    index = RadixIndex(BS)
    insert(index, A, [0, 1, 2, 3])
    held = match(index, A).last_node
    index.lock(held)
    insert(index, B, [0, 1, 12, 13])
    assert index.num_nodes == 3
    assert held.parent is not None and (held.parent.ref_cnt, held.ref_cnt) == (1, 1)
    assert index.num_evictable_blocks == 2
    assert index.evict(10) == [12, 13]
    index.unlock(held)
    index.check_integrity()
    assert index.evict(10) == [2, 3, 0, 1]


def test_unlock_without_lock_raises():
    index = RadixIndex(BS)
    insert(index, A, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="not locked"):
        index.unlock(match(index, A).last_node)


def test_locking_an_evicted_node_raises():
    index = RadixIndex(BS)
    insert(index, A, [0, 1, 2, 3])
    node = match(index, A).last_node
    index.evict(4)
    with pytest.raises(ValueError, match="not in this index"):
        index.lock(node)


def test_locking_the_root_after_a_miss_is_allowed():
    index = RadixIndex(BS)
    result = match(index, A)
    index.lock(result.last_node)
    index.unlock(result.last_node)
    index.check_integrity()


def test_invalid_arguments_raise_with_what_to_fix():
    index = RadixIndex(BS)
    with pytest.raises(ValueError, match="2 block ids for 4 keys"):
        index.insert(keys(A), A, [0, 1])
    with pytest.raises(ValueError, match="4 blocks need 16"):
        index.match_prefix(keys(A), A[:10])
    with pytest.raises(ValueError, match="16-byte"):
        index.match_prefix([b"short"], A)
    with pytest.raises(ValueError, match="block_size"):
        RadixIndex(0)
    with pytest.raises(ValueError, match="choose one of"):
        RadixIndex(BS, "mru")
    with pytest.raises(TypeError, match="policy"):
        RadixIndex(BS, 3)  # type: ignore[arg-type]


def test_check_integrity_detects_broken_ref_counts():
    index = shared_tree()
    result = match(index, A)
    index.lock(result.last_node)
    result.last_node.ref_cnt = 2  # more than its parent's
    with pytest.raises(IntegrityError, match="ref_cnt"):
        index.check_integrity()


def test_check_integrity_detects_a_block_id_held_twice():
    index = RadixIndex(BS)
    insert(index, A, [0, 1, 2, 3])
    index.insert(keys(B), B, [0, 1, 2, 9])
    with pytest.raises(IntegrityError, match="held twice"):
        index.check_integrity()
