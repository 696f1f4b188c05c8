"""`SeqBlocks`: one running request's block table and where its commits and slides stand
(kvstore/block_tables.py opens, grows, commits, slides and closes it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hashing import BlockHash
from kvstore.hits import PendingLoad
from kvstore.index import TreeNode


@dataclass(eq=False)
class SeqBlocks:
    """One request's blocks: table[i] holds positions [i * block_size, (i + 1) * block_size)."""

    cache_salt: str
    tenant: str
    block_table: list[int | None]  # None: a block the request no longer holds (a window's)
    num_shared_blocks: int  # leading blocks that came from the cache: read only
    num_cached_tokens: int  # tokens the lookup found (shared blocks, and a tail's tokens)
    tier_tokens: dict[str, int]  # cached tokens by source tier
    keys: list[BlockHash] = field(default_factory=list)  # lookup keys, keys[i] of block i
    num_committed: int = 0  # leading blocks given to the index
    node: TreeNode | None = None  # the locked index node of the committed path
    num_dropped: int = 0  # leading table entries that are None
    num_prompt_tokens: int = 0  # the tokens `open` looked up
    num_window_dropped: int = 0  # a hybrid model's: leading blocks without window parts
    num_window_end: int = 0  # a hybrid model's: blocks from here on have none yet
    commit_end: int | None = None  # tokens past which nothing is committed (None: no end)
    closed: bool = False
    pending: PendingLoad | None = None  # blocks still loading from a tier (`settle` them)

    def readable_table(self, filler: int) -> list[int]:
        """The table with `filler` (a block nobody reads) where the request holds none."""
        if not self.num_dropped:
            return self.block_table  # type: ignore[return-value]
        return [filler] * self.num_dropped + self.block_table[self.num_dropped :]  # type: ignore[list-item]
