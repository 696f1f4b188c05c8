"""Block tables of running requests: the device pool as an engine's KV memory.

A request `open`s a `SeqBlocks` (a lookup: its cached prefix enters the table by reference,
no copy), `grow`s it with fresh pool blocks as its tokens are computed, `commit`s full
blocks to the radix index in place (hashing only the new blocks, continuing the lookup's
chain), and `close`s it (drops its references; committed blocks stay cached).

Invariants (checked by `PrefixCache.check_integrity`, since every block here is counted by
the pool's ref counts): a block in a table holds one reference of that request; a committed
block also one of the index; a block referenced by the index or by two requests is never
written: the engine writes only past `num_shared_blocks` and past the committed blocks, which
are full, so nothing is written there again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hashing import BlockHash, as_token_array
from kvstore.cache import PrefixCache
from kvstore.tree import TreeNode


@dataclass(eq=False)
class SeqBlocks:
    """One request's blocks: table[i] holds positions [i * block_size, (i + 1) * block_size)."""

    salt: str
    owner: str
    block_table: list[int]
    num_shared_blocks: int  # leading blocks that came from the cache: read only
    num_cached_tokens: int  # tokens the lookup found (num_shared_blocks * block_size)
    tier_tokens: dict[str, int]  # cached tokens by source tier
    keys: list[BlockHash] = field(default_factory=list)  # lookup keys, keys[i] of block i
    num_committed: int = 0  # leading blocks given to the index
    node: TreeNode | None = None  # the locked index node of the committed path
    closed: bool = False


class BlockTables:
    """Opens, grows, commits and closes request block tables over one `PrefixCache`."""

    def __init__(self, cache: PrefixCache):
        self.cache = cache
        self.pool = cache.pool
        self.block_size = cache.block_size

    def open(
        self,
        token_ids: Sequence[int] | np.ndarray,
        salt: str,
        owner: str,
        whole_prompt: bool = True,
    ) -> SeqBlocks:
        """Look up the longest cached prefix of token_ids (of token_ids[:-1] unless
        `whole_prompt`); its blocks enter the table."""
        cache = self.cache
        hit = cache.lookup(token_ids, salt=salt, owner=owner, whole_prompt=whole_prompt)
        with cache._lock:
            self.pool.incref(hit.block_ids)
            hit.released = True  # its lock now belongs to the SeqBlocks
        n = len(hit.block_ids)
        return SeqBlocks(
            salt, owner, list(hit.block_ids), n, hit.num_cached_tokens, dict(hit.tier_tokens),
            list(hit.keys), n, hit.node,
        )  # fmt: skip

    def keys_of(self, token_ids: Sequence[int] | np.ndarray, salt: str) -> list[BlockHash]:
        """Lookup keys of the full blocks of token_ids (what `open` would look up)."""
        return self.cache.hasher_for(salt).hash_blocks(as_token_array(token_ids))

    def num_available(self) -> int:
        """Blocks a request could get now: free, or cached and unlocked (evictable)."""
        with self.cache._lock:
            return self.pool.num_free_blocks + self.cache.index.num_evictable_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, seq: SeqBlocks, num_tokens: int) -> bool:
        """Make the table hold `num_tokens` positions, evicting unlocked cached blocks as
        needed; False (and nothing taken) when the pool cannot give enough."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        with self.cache._lock:
            if self.pool.num_free_blocks + self.cache.index.num_evictable_blocks < need:
                return False
            ids = self.cache._allocate(need)
            if len(ids) < need:
                self.pool.free(ids)
                return False
        # attention reads the last block whole (masked past the row's end): it must hold no
        # NaN from earlier use or from never-written memory; the blocks before it get written
        self.pool.kv[ids[-1]].zero_()
        seq.block_table.extend(ids)
        return True

    def commit(self, seq: SeqBlocks, token_ids: Sequence[int] | np.ndarray, num_tokens: int) -> int:
        """Give the index every full block of token_ids[:num_tokens] not committed yet (their
        K/V must be written). Returns the number of blocks the index kept."""
        n = min(num_tokens // self.block_size, len(seq.block_table))
        if n <= seq.num_committed:
            return 0
        tokens = as_token_array(token_ids[: n * self.block_size])
        self._extend_keys(seq, tokens, n)
        cache = self.cache
        with cache._lock:
            n = min(n, seq.num_committed + max(cache._quota_left(seq.owner), 0))
            if n <= seq.num_committed:
                return 0
            kept = self._insert(seq, tokens, n)
        cache.metrics.inc("stored_blocks_total", kept)
        return kept

    def _extend_keys(self, seq: SeqBlocks, tokens: np.ndarray, n: int) -> None:
        if len(seq.keys) < n:
            hasher = self.cache.hasher_for(seq.salt)
            parent = seq.keys[-1] if seq.keys else None
            seq.keys += hasher.hash_blocks(tokens, parent=parent, start_block=len(seq.keys))

    def _insert(self, seq: SeqBlocks, tokens: np.ndarray, n: int) -> int:
        """Insert blocks [num_committed, n) and move the lock to the new path (lock held)."""
        cache, start = self.cache, seq.num_committed
        keys, ids = seq.keys[:n], seq.block_table[:n]
        new = ids[start:]
        self.pool.incref(new)  # the index's reference; the request keeps its own
        cache._track(keys, seq.salt, seq.owner)
        new_set = set(new)
        unkept = [b for b in cache.index.insert(keys, tokens, ids) if b in new_set]
        self.pool.free(unkept)  # cached already by another request: ours stays private
        cache._owner_blocks[seq.owner] += len(new) - len(unkept)
        match = cache.index.match_prefix(keys, tokens)
        cache.index.lock(match.last_node)
        if seq.node is not None:
            cache.index.unlock(seq.node)
        seq.node, seq.num_committed = match.last_node, n
        if cache.tiers:  # write-through: an independent copy of whole chunks, taken now
            scope = cache.tiers.scope(cache.hasher_for(seq.salt))
            targets = cache.tiers.targets("write-through")
            cache.tiers.submit_from_pool(scope, targets, keys, tokens, start, ids, self.pool)
        return len(new) - len(unkept)

    def reserve(self, n: int) -> list[int]:
        """Up to n zeroed blocks held outside any table (an engine's scratch, a self-test)."""
        with self.cache._lock:
            ids = self.cache._allocate(n)
        self.pool.kv[ids] = 0
        return ids

    def release(self, block_ids: list[int]) -> None:
        """Return blocks taken with `reserve`."""
        with self.cache._lock:
            self.pool.free(block_ids)

    def close(self, seq: SeqBlocks) -> None:
        """Drop the request's references and lock. Idempotent."""
        if seq.closed:
            return
        with self.cache._lock:
            if seq.node is not None:
                self.cache.index.unlock(seq.node)
            self.pool.free(seq.block_table)
        seq.closed, seq.node, seq.block_table = True, None, []
