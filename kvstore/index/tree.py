"""The radix tree's node: a path-compressed run of cached blocks (see `kvstore.index`)."""

from __future__ import annotations

from array import array
from typing import NamedTuple

import numpy as np

from hashing import HASH_BYTES

__all__ = ["MatchResult", "TreeNode", "num_equal", "run_tag"]


class TreeNode:
    """A run of cached blocks. `ref_cnt` > 0 means locked (in use): never evicted."""

    __slots__ = (
        "block_ids",
        "children",
        "evictable",
        "id",
        "keys",
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
    ):
        self.id = node_id  # the node's key in the eviction policy
        self.parent = parent  # None for the root and for evicted (detached) nodes
        self.children: dict[bytes, TreeNode] = {}
        self.start = start  # number of blocks before this node on its path
        self.keys = keys  # [num_blocks * 16] block hashes
        self.tokens = tokens  # [num_blocks * block_size] token ids as LE uint32 bytes
        self.block_ids = block_ids  # array('q'), [num_blocks]
        self.ref_cnt = 0
        self.evictable = False

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def key(self, i: int) -> bytes:
        return self.keys[i * HASH_BYTES : (i + 1) * HASH_BYTES]

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, start={self.start}, n={self.num_blocks}, ref={self.ref_cnt})"
        )


class MatchResult(NamedTuple):
    num_blocks: int
    block_ids: list[int]  # in prefix order
    last_node: TreeNode  # deepest node matched (the root when nothing matched)


def run_tag(keys: bytes) -> int:
    """Content fingerprint of a run (its first block key) for policies with ghost history."""
    return int.from_bytes(keys[:8], "little")


def num_equal(a: bytes, b: bytes, width: int) -> int:
    """Number of leading equal items (of `width` bytes) of two equally long byte strings."""
    if a == b:
        return len(a) // width
    diff = np.flatnonzero(np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8))
    return int(diff[0]) // width
