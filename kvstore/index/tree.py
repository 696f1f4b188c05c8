"""The radix tree's node: a path-compressed run of cached blocks (see `kvstore.index`), the
two cuts of a run (split in two where prompts diverge, trim its tail on eviction), and the
events that describe runs."""

from __future__ import annotations

from array import array
from typing import NamedTuple

import numpy as np

from hashing import HASH_BYTES
from kvstore.fleet.events import BlockRemoved, BlockStored

__all__ = [
    "HOLE",
    "MatchResult",
    "TreeNode",
    "cut_tail",
    "removed_event",
    "run_tag",
    "snapshot_events",
    "split_run",
    "stored_event",
]


# a position of a run whose K/V the index dropped (a sliding-window cache's hole, see
# `RadixIndex.punch`): its key and tokens stay, so paths through it still match
HOLE = -1


class TreeNode:
    """A run of cached blocks. `ref_cnt` > 0 means locked (in use): never evicted.
    `block_ids[i]` is HOLE where the index holds no K/V for the run's block i. `owner`: who
    the run's blocks are counted against (a tenant; the index does not read it)."""

    __slots__ = (
        "block_ids",
        "children",
        "evictable",
        "id",
        "keys",
        "num_held",
        "owner",
        "parent",
        "ref_cnt",
        "start",
        "tokens",
    )

    def __init__(
        self,
        node_id: int,
        parent: TreeNode | None,
        start: int,
        keys: bytes,
        tokens: bytes,
        block_ids: array,
        owner: str = "",
    ):
        self.id = node_id  # the node's key in the eviction policy
        self.owner = owner
        self.parent = parent  # None for the root and for evicted (detached) nodes
        self.children: dict[bytes, TreeNode] = {}
        self.start = start  # number of blocks before this node on its path
        self.keys = keys  # [num_blocks * 16] block hashes
        self.tokens = tokens  # [num_blocks * block_size] token ids as LE uint32 bytes
        self.block_ids = block_ids  # array('q'), [num_blocks]
        self.num_held = count_held(block_ids)  # blocks that are not holes
        self.ref_cnt = 0
        self.evictable = False

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def ids(self, lo: int = 0, hi: int | None = None) -> list[int | None]:
        """Block ids of the run's blocks [lo:hi], None for a hole."""
        ids = self.block_ids[lo:hi].tolist()
        return ids if self.num_held == self.num_blocks else [hole_to_none(b) for b in ids]

    def held(self, lo: int = 0, hi: int | None = None) -> list[int]:
        """The block ids the run holds in [lo:hi] (holes left out)."""
        ids = self.block_ids[lo:hi].tolist()
        return ids if self.num_held == self.num_blocks else [b for b in ids if b != HOLE]

    def key(self, i: int) -> bytes:
        return self.keys[i * HASH_BYTES : (i + 1) * HASH_BYTES]

    def tail_start(self, want: int) -> int:
        """Where a tail of the run holding `want` blocks starts (0: the whole run)."""
        if self.num_held <= want:
            return 0
        if self.num_held == self.num_blocks:
            return self.num_blocks - want
        held = np.flatnonzero(np.frombuffer(self.block_ids, dtype=np.int64) != HOLE)
        return int(held[-want])

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, start={self.start}, n={self.num_blocks}, ref={self.ref_cnt})"
        )


def count_held(block_ids: array) -> int:
    return len(block_ids) - block_ids.count(HOLE)


def hole_to_none(block_id: int) -> int | None:
    return None if block_id == HOLE else block_id


class MatchResult(NamedTuple):
    num_blocks: int
    block_ids: list[int | None]  # in prefix order; None where the index holds a hole
    last_node: TreeNode  # deepest node matched (the root when nothing matched)


def split_run(node: TreeNode, k: int, head_id: int, token_bytes: int) -> TreeNode:
    """Cut `node`'s run after k blocks: a new node (`head_id`) takes blocks [:k] and node's
    place under its parent, and node keeps the rest under it (so handles to `node` stay
    valid). The head inherits node's ref_cnt. `token_bytes`: one block's token id bytes."""
    kw, tw = HASH_BYTES, token_bytes
    parent = node.parent
    assert parent is not None
    head = TreeNode(
        head_id, parent, node.start, node.keys[: k * kw], node.tokens[: k * tw],
        node.block_ids[:k], node.owner,
    )  # fmt: skip
    head.ref_cnt = node.ref_cnt
    head.children[node.key(k)] = node
    parent.children[head.key(0)] = head
    node.parent = head
    node.start += k
    node.keys, node.tokens = node.keys[k * kw :], node.tokens[k * tw :]
    node.block_ids = node.block_ids[k:]
    node.num_held -= head.num_held
    return head


def cut_tail(node: TreeNode, start: int, token_bytes: int) -> int:
    """Drop blocks [start:] of `node`'s run; returns how many of them it held."""
    dropped = count_held(node.block_ids[start:])
    node.keys = node.keys[: start * HASH_BYTES]
    node.tokens = node.tokens[: start * token_bytes]
    node.block_ids = node.block_ids[:start]
    node.num_held -= dropped
    return dropped


def run_tag(keys: bytes) -> int:
    """Content fingerprint of a run (its first block key) for policies with ghost history."""
    return int.from_bytes(keys[:8], "little")


def _split_keys(keys: bytes) -> list[bytes]:
    return [keys[i : i + HASH_BYTES] for i in range(0, len(keys), HASH_BYTES)]


def stored_event(node: TreeNode, block_size: int) -> BlockStored:
    """The event of `node`'s whole run entering the index (its parent is already there)."""
    parent = node.parent
    parent_key = parent.key(parent.num_blocks - 1) if parent and parent.num_blocks else None
    tokens = np.frombuffer(node.tokens, dtype="<u4").tolist()
    return BlockStored(_split_keys(node.keys), parent_key, tokens, block_size)


def removed_event(node: TreeNode, start: int) -> BlockRemoved:
    """The event of blocks [start:] of `node`'s run leaving the index."""
    return BlockRemoved(_split_keys(node.keys[start * HASH_BYTES :]))


def snapshot_events(root: TreeNode, block_size: int) -> list[BlockStored]:
    """Every run under `root` as a stored event, parents before children."""
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(stored_event(node, block_size))
        stack += node.children.values()
    return out
