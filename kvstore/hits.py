"""What a lookup returns: a locked cached prefix (`CacheHit`) and its K/V (`KVPrefix`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from hashing import BlockHash
from kvstore.index import TreeNode
from kvstore.layout import LayerKV

if TYPE_CHECKING:
    from kvstore.tiers.layered import LayerLoad


class KVPrefix(NamedTuple):
    num_tokens: int
    layers: list[LayerKV]  # per layer (K, V): [1, kv_heads, num_tokens, head_dim]


class PendingLoad(NamedTuple):
    """Blocks [start, start + load.num_blocks) of a hit, promised by the tiers and still on
    their way layer by layer (kvstore/tiers/layered.py): held by the hit, not indexed until
    they verify (`BlockTables.settle`)."""

    load: LayerLoad
    start: int
    cache_salt: str
    tenant: str
    tokens: np.ndarray  # the looked-up tokens (uint32)


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
    pending: PendingLoad | None = None  # a layer-by-layer load of its last blocks
