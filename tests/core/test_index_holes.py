"""Holes in the radix index (a sliding-window cache): punched blocks keep their keys and
tokens, so paths through them match; counts, locks and eviction count held blocks only;
a later insert of the same blocks fills the holes; a branch point keeps its window."""

from test_index import BS, insert, match, prompt

from kvstore.attention import window_prefix
from kvstore.index import RadixIndex

LONG = prompt(1, 2, 3, 4, 5, 6)


def chain() -> tuple[RadixIndex, object]:
    index = RadixIndex(BS)
    insert(index, LONG, [10, 11, 12, 13, 14, 15])
    node = match(index, LONG).last_node
    index.lock(node)
    return index, node


def test_a_punched_path_still_matches_with_none_where_the_blocks_were() -> None:
    index, node = chain()
    assert index.punch(node, 0, 4, keep=2) == [10, 11, 12, 13]
    index.check_integrity()
    result = match(index, LONG)
    assert (result.num_blocks, result.block_ids) == (6, [None] * 4 + [14, 15])
    assert (index.num_cached_blocks, index.num_evictable_blocks) == (2, 0)
    assert sorted(index.all_block_ids()) == [14, 15]
    assert index.path_block_ids(node) == [None] * 4 + [14, 15]


def test_unlocking_a_punched_path_makes_only_its_held_blocks_evictable() -> None:
    index, node = chain()
    index.punch(node, 0, 3, keep=2)
    index.unlock(node)
    assert index.num_evictable_blocks == 3
    assert index.evict(2) == [14, 15]  # from the tail, holes skipped
    assert index.evict(5) == [13]
    index.check_integrity()
    assert (index.num_cached_blocks, index.num_nodes) == (0, 0)


def test_inserting_the_blocks_again_fills_the_holes() -> None:
    index, node = chain()
    index.punch(node, 0, 4, keep=2)
    unkept = insert(index, LONG, [20, 21, 22, 23, 24, 25])
    assert unkept == [24, 25]  # the index held those positions already
    assert match(index, LONG).block_ids == [20, 21, 22, 23, 14, 15]
    assert (index.num_cached_blocks, index.num_evictable_blocks) == (6, 0)


def test_a_caller_without_a_block_leaves_a_hole_a_hole() -> None:
    index, node = chain()
    index.punch(node, 0, 2, keep=2)
    assert insert(index, LONG, [None, None, 32, 33, 34, 35]) == [32, 33, 34, 35]
    assert match(index, LONG).block_ids == [None, None, 12, 13, 14, 15]


def test_a_branch_point_keeps_the_window_before_it() -> None:
    index, node = chain()
    other = prompt(1, 2, 3, 9)  # branches after block 3
    insert(index, other, [10, 11, 12, 40])
    freed = index.punch(node, 0, 5, keep=2)
    index.check_integrity()
    assert freed == [10, 13, 14]  # blocks 1 and 2 are the window before the branch
    assert match(index, other).block_ids == [None, 11, 12, 40]
    assert match(index, LONG).block_ids == [None, 11, 12, None, None, 15]


def test_a_split_run_keeps_its_holes_on_both_sides() -> None:
    index, node = chain()
    index.punch(node, 0, 3, keep=2)
    insert(index, prompt(1, 2, 8), [None, None, 50])  # splits the run after block 2
    index.check_integrity()
    assert match(index, prompt(1, 2, 8)).block_ids == [None, None, 50]
    assert match(index, LONG).block_ids == [None, None, None, 13, 14, 15]
    assert index.num_cached_blocks == 4


def test_the_window_rule_takes_the_longest_prefix_whose_window_is_held() -> None:
    assert window_prefix([1, 2, 3, 4], 2) == 4
    assert window_prefix([None, None, 3, 4], 2) == 4
    assert window_prefix([None, None, None, 4], 2) == 0
    assert window_prefix([1, 2, None, 4], 2) == 2  # [1 2] is its own whole window
    assert window_prefix([None, 2, 3, None, 5], 2) == 3
    assert window_prefix([], 2) == 0


def test_the_window_before_a_branch_reaches_back_into_earlier_runs() -> None:
    index = RadixIndex(BS)
    for n in range(1, 7):  # committed a block at a time: one run per block
        insert(index, LONG[: n * BS], [10, 11, 12, 13, 14, 15][:n])
    other = prompt(1, 2, 3, 4, 9)  # branches after block 4, a run of one block
    insert(index, other, [10, 11, 12, 13, 40])
    node = match(index, LONG).last_node
    index.lock(node)
    assert index.punch(node, 0, 6, keep=2) == [10, 11, 14, 15]
    assert match(index, other).block_ids == [None, None, 12, 13, 40]


def test_kept_windows_widen_to_whole_chunks() -> None:
    index, node = chain()
    insert(index, prompt(1, 2, 3, 9), [10, 11, 12, 40])  # branch after block 3
    assert index.punch(node, 0, 6, keep=1, align=2) == [10, 11, 14, 15]  # keeps 2, 3
