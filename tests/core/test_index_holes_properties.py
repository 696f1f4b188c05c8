"""Randomized insert / match / lock / punch / evict sequences on an index with holes (a
sliding-window cache's), against a plain reference: a dict from token prefixes to a block id,
or None for a hole. check_integrity() runs after every step, and every block id handed to the
index is, at every step, either held by it or given back exactly once."""

from __future__ import annotations

import numpy as np
from hypothesis import event, given, settings
from hypothesis import strategies as st

from hashing import BlockHasher, Namespace
from kvstore.index import RadixIndex, TreeNode
from kvstore.index.holes import widen

BS = 2
HASHER = BlockHasher(Namespace("holes-model", "float32", 1, 1, 4, BS))
BASES = [
    [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2], [2, 0], [2, 1]],
    [[0, 0], [0, 1], [0, 2], [2, 2], [2, 2], [1, 1], [0, 0], [0, 0]],
]
blocks = st.lists(st.integers(0, 2), min_size=BS, max_size=BS)
prompts = st.builds(
    lambda base, cut, tail: base[:cut] + tail,
    st.sampled_from(BASES),
    st.integers(1, 8),
    st.lists(blocks, max_size=2),
)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), prompts, st.integers(0, 3)),
        st.tuples(st.just("match"), prompts, st.booleans()),
        st.tuples(st.just("match"), prompts, st.just(True)),
        st.tuples(st.just("punch"), st.integers(0, 99), st.integers(0, 4), st.integers(1, 8),
                  st.integers(0, 3), st.sampled_from([1, 2])),
        st.tuples(st.just("punch"), st.integers(0, 99), st.integers(0, 4), st.integers(1, 8),
                  st.integers(0, 3), st.sampled_from([1, 2])),
        st.tuples(st.just("unlock"), st.integers(0, 99)),
        st.tuples(st.just("evict"), st.integers(0, 12)),
    ),
    min_size=8,
    max_size=40,
)  # fmt: skip


class Holes:
    def __init__(self) -> None:
        self.index = RadixIndex(BS)
        self.ref: dict[tuple, int | None] = {}  # cached prefix -> its block id, None: a hole
        self.handed = 0
        self.returned: set[int] = set()
        self.held: list[TreeNode] = []

    def give_back(self, ids: list[int]) -> None:
        assert not set(ids) & self.returned, "a block given back twice"
        assert len(set(ids)) == len(ids)
        self.returned |= set(ids)

    @staticmethod
    def tokens(prompt: list[list[int]]) -> np.ndarray:
        return np.array([t for block in prompt for t in block], dtype=np.uint32)

    def prefix(self, tokens: np.ndarray, n: int) -> tuple:
        return tuple(tokens[: n * BS].tolist())

    def insert(self, prompt: list[list[int]], lead_none: int) -> None:
        """The caller holds no block for its first `lead_none` blocks (it dropped them)."""
        tokens = self.tokens(prompt)
        n = len(prompt)
        ids: list[int | None] = [None] * min(lead_none, n)
        ids += list(range(self.handed, self.handed + n - len(ids)))
        self.handed += n - min(lead_none, n)
        expected = []
        for i, block_id in enumerate(ids):
            p = self.prefix(tokens, i + 1)
            if p not in self.ref:
                self.ref[p] = block_id
            elif block_id is not None and self.ref[p] is None:
                self.ref[p] = block_id  # a hole filled
                event("an insert filled a hole")
            elif block_id is not None and self.ref[p] != block_id:
                expected.append(block_id)
        unkept = self.index.insert(HASHER.hash_blocks(tokens), tokens, ids)
        assert unkept == expected
        self.give_back(unkept)

    def match(self, prompt: list[list[int]], lock: bool) -> None:
        tokens = self.tokens(prompt)
        result = self.index.match_prefix(HASHER.hash_blocks(tokens), tokens)
        want = []
        for i in range(len(prompt)):
            p = self.prefix(tokens, i + 1)
            if p not in self.ref:
                break
            want.append(self.ref[p])
        assert result.block_ids == want and result.num_blocks == len(want)
        if None in want:
            event("a match through a hole")
        if lock and want:
            self.index.lock(result.last_node)
            self.held.append(result.last_node)

    def punch(self, which: int, lo: int, span: int, keep: int, align: int) -> None:
        if not self.held:
            return
        node = self.held[which % len(self.held)]
        tokens = self.index.path_token_ids(node)
        n = len(tokens) // BS
        kept = set()
        for k in range(1, n + 1):  # a branch point: two or more one-block extensions
            p = self.prefix(tokens, k)
            if sum(1 for q in self.ref if len(q) == len(p) + BS and q[: len(p)] == p) > 1:
                a, b = widen(k, keep, align)
                kept |= set(range(a, b))
        want = []
        for i in range(lo, min(lo + span, n)):
            p = self.prefix(tokens, i + 1)
            if i not in kept and self.ref[p] is not None:
                want.append(self.ref[p])
                self.ref[p] = None
        freed = self.index.punch(node, lo, lo + span, keep, align)
        assert freed == want
        event(f"punch freed {'some' if freed else 'none'}, kept a branch window {bool(kept)}")
        self.give_back(freed)

    def unlock(self, i: int) -> None:
        if self.held:
            self.index.unlock(self.held.pop(i % len(self.held)))

    def evict(self, num_blocks: int) -> None:
        locked = {id(n) for n in self.held}
        evictable = self.index.num_evictable_blocks

        def on_evict(node: TreeNode, start: int, ids: list[int]) -> None:
            assert id(node) not in locked
            tokens = self.index.path_token_ids(node)
            first = len(tokens) // BS - node.num_blocks + start
            last = len(tokens) // BS
            gone = [self.ref.pop(self.prefix(tokens, i + 1)) for i in range(first, last)]
            assert [b for b in gone if b is not None] == ids
            if None in gone:
                event("evicted a run with holes")

        freed = self.index.evict(num_blocks, on_evict)
        assert len(freed) == min(num_blocks, evictable)
        self.give_back(freed)

    def check(self) -> None:
        self.index.check_integrity()
        held = [b for b in self.ref.values() if b is not None]
        assert sorted(self.index.all_block_ids()) == sorted(held)
        assert self.index.num_cached_blocks == len(held)
        assert len(held) + len(self.returned) == self.handed  # nothing lost, nothing leaked
        for node in self.held:
            assert node.ref_cnt >= 1


@settings(max_examples=300, deadline=None)
@given(steps)
def test_an_index_with_holes_agrees_with_the_reference(ops: list[tuple]) -> None:
    harness = Holes()
    for name, *args in ops:
        getattr(harness, name)(*args)
        harness.check()
    while harness.held:
        harness.unlock(0)
    harness.evict(harness.index.num_cached_blocks + 1)
    harness.check()
    assert harness.index.num_cached_blocks == 0 and len(harness.returned) == harness.handed
