"""What a lookup returns: a locked cached prefix (`CacheHit`) and its K/V (`KVPrefix`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from hashing import BlockHash
from kvstore.index import TreeNode
from kvstore.layout import LayerKV


class KVPrefix(NamedTuple):
    num_tokens: int
    layers: list[LayerKV]  # per layer (K, V): [1, kv_heads, num_tokens, head_dim]


@dataclass
class CacheHit:
    """A locked cached prefix of a prompt. Release it with `PrefixCache.release`."""

    num_prompt_tokens: int
    num_cached_tokens: int
    block_ids: list[int | None]  # None: a block a sliding-window hit does not need
    tier_tokens: dict[str, int] = field(default_factory=dict)  # cached tokens by source tier
    node: TreeNode | None = None
    keys: list[BlockHash] = field(default_factory=list)  # lookup keys of the prompt's blocks
    released: bool = False
    window_from: int = 0  # a hybrid model's hit holds window parts of block_ids[window_from:]
