"""Reading the tree back: the runs from the root to a node and the keys, token ids and block
ids along them (a write-back tier reads an evicted run's prompt), and the blocks every run
holds (the accounting checks)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np

from hashing import HASH_BYTES
from kvstore.index.tree import TreeNode

__all__ = ["held_by_owner", "held_ids", "path_block_ids", "path_keys", "path_to", "path_token_ids"]


def path_to(root: TreeNode, node: TreeNode) -> list[TreeNode]:
    """The runs from `root` (excluded) down to `node` (included), root side first."""
    path = []
    while node is not root:
        path.append(node)
        if node.parent is None:
            raise ValueError(f"{node!r} is detached from the index")
        node = node.parent
    return path[::-1]


def _joined(path: list[TreeNode], field: str, width: int, upto: int | None) -> bytes:
    """The runs' `field` bytes (`width` a block), the last run's cut after `upto` blocks."""
    parts = [getattr(n, field) for n in path]
    if parts and upto is not None:
        parts[-1] = parts[-1][: upto * width]
    return b"".join(parts)


def path_keys(path: list[TreeNode], upto: int | None) -> list[bytes]:
    joined = _joined(path, "keys", HASH_BYTES, upto)
    return [joined[i : i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES)]


def path_token_ids(path: list[TreeNode], token_bytes: int, upto: int | None) -> np.ndarray:
    """uint32 token ids; `token_bytes` is the bytes of one block's token ids."""
    joined = _joined(path, "tokens", token_bytes, upto)
    return np.frombuffer(joined, dtype="<u4").copy()


def path_block_ids(path: list[TreeNode], upto: int | None) -> list[int | None]:
    """None for a hole."""
    ids: list[int | None] = []
    for n in path[:-1]:
        ids += n.ids()
    return ids + (path[-1].ids(0, upto) if path else [])


def held_ids(nodes: Iterable[TreeNode]) -> list[int]:
    """Every block id the runs hold (holes left out)."""
    ids: list[int] = []
    for node in nodes:
        ids += node.held()
    return ids


def held_by_owner(nodes: Iterable[TreeNode]) -> Counter[str]:
    """Blocks the runs hold, per run owner (`TreeNode.owner`)."""
    owned: Counter[str] = Counter()
    for node in nodes:
        owned[node.owner] += node.num_held
    return owned
