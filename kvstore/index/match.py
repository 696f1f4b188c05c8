"""Comparing a query prompt with cached runs, run by run with bytes slices (a few C-level
comparisons per run, not a Python loop per block or token)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hashing import HASH_BYTES, as_token_array
from kvstore.index.tree import TreeNode

__all__ = ["num_equal", "num_matching", "pack_query"]


def pack_query(
    keys: Sequence[bytes], token_ids: np.ndarray, block_size: int
) -> tuple[int, bytes, bytes]:
    """(n, keys joined, the token ids of the n blocks as LE uint32 bytes) of a query of n
    block keys; raises ValueError on a key of the wrong size or too few token ids."""
    n = len(keys)
    joined = b"".join(keys)
    if len(joined) != HASH_BYTES * n:
        raise ValueError(f"every key must be a {HASH_BYTES}-byte block hash")
    tokens = as_token_array(token_ids)
    if len(tokens) < n * block_size:
        raise ValueError(f"token_ids has {len(tokens)} tokens; {n} blocks need {n * block_size}")
    return n, joined, tokens[: n * block_size].tobytes()


def num_matching(
    node: TreeNode, keys: bytes, tokens: bytes, pos: int, n: int, token_bytes: int
) -> int:
    """How many blocks of `node`'s run equal blocks pos.. of the packed query of n blocks
    (keys and tokens). `token_bytes`: one block's token id bytes."""
    m = len(node.block_ids)
    size = min(m, n - pos)
    kw, tw = HASH_BYTES, token_bytes
    qk = keys[pos * kw : (pos + size) * kw]
    qt = tokens[pos * tw : (pos + size) * tw]
    nk = node.keys if size == m else node.keys[: size * kw]
    nt = node.tokens if size == m else node.tokens[: size * tw]
    if qk == nk and qt == nt:
        return size
    return min(num_equal(qk, nk, kw), num_equal(qt, nt, tw))


def num_equal(a: bytes, b: bytes, width: int) -> int:
    """Number of leading equal items (of `width` bytes) of two equally long byte strings."""
    if a == b:
        return len(a) // width
    diff = np.flatnonzero(np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8))
    return int(diff[0]) // width
