"""Block tables of running requests: the device pool as an engine's KV memory.

A request `open`s a `SeqBlocks` (a lookup: its cached prefix enters the table by reference,
no copy; a kept partial block that goes on from it is copied into a block of its own),
`grow`s it with fresh pool blocks as its tokens are computed, `commit`s full blocks to the
radix index in place (hashing only the new blocks, continuing the lookup's chain), hands its
partly filled last block to the cache's tails when it ends (`keep_tail`), and `close`s it
(drops its references; committed blocks stay cached). While it runs, it may lend that block
(`lend_tail`) to requests that go on from the same tokens (a group's other sequences), whose
`open` copies it.

With a sliding-window cache (`PrefixCache(window=...)`), `slide` drops the blocks that fell
out of the request's window during decode: the table's leading `num_dropped` entries become
None, so a request holds at most the window's blocks plus the one it writes. A hybrid model's
request (`PrefixCache(window=..., window_layers=...)`) keeps every block's full layers and
holds the window layers' part of blocks [num_window_dropped, num_window_end) only: two
block tables in one, the window layers' read through the pool's slot map. `grow` gives
blocks their window parts as the steps that compute them come (`compute_to`), and `slide`
lets go of those that left the window.

Invariants (checked by `PrefixCache.check_integrity`, since every block here is counted by
the pool's ref counts): a block in a table holds one reference of that request; a committed
block also one of the index; a block referenced by the index or by two requests is never
written: the engine writes only past `num_shared_blocks` and past the committed blocks, which
are full, so nothing is written there again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hashing import BlockHash, as_token_array
from kvstore.cache import PrefixCache
from kvstore.device.seq_blocks import SeqBlocks
from kvstore.device.tails import LentTail
from kvstore.metrics import DEVICE_TIER
from kvstore.units import cdiv

__all__ = ["BlockTables", "LentTail", "SeqBlocks"]


class BlockTables:
    """Opens, grows, commits and closes request block tables over one `PrefixCache`."""

    def __init__(self, cache: PrefixCache):
        self.cache = cache
        self.held = cache.held  # the cache's API for blocks a caller holds (kvstore/device/held.py)
        self.kind = cache.kind  # the model's attention kind (kvstore/attention/)
        self.pool = cache.pool
        self.block_size = cache.block_size
        self.punch_align = cache.device_index.punch_align  # a window slides whole tier chunks

    def open(
        self,
        token_ids: Sequence[int] | np.ndarray,
        cache_salt: str,
        tenant: str,
        whole_prompt: bool = True,
        keys: Sequence[BlockHash] = (),
        lent: LentTail | None = None,
        layered: bool = False,
    ) -> SeqBlocks:
        """Look up the longest cached prefix of token_ids (of token_ids[:-1] unless
        `whole_prompt`; `keys`: their block keys, when hashed already); its blocks enter
        the table. The partly filled block after them is copied from `lent` (a running
        request's, `lend_tail`) when the hit ends where it starts, else from a kept tail.
        `layered`: tier blocks may still be loading (`seq.pending`, `PrefixCache.lookup`):
        a forward waits for each layer, and its output counts only if `settle` is True."""
        hit = self.cache.lookup(token_ids, cache_salt, tenant, whole_prompt, keys, layered)
        self.held.hold(hit)  # the hit's lock and a reference to its blocks are the table's
        n = len(hit.block_ids)
        dropped = next((i for i, b in enumerate(hit.block_ids) if b is not None), n)
        seq = SeqBlocks(
            cache_salt=cache_salt,
            tenant=tenant,
            block_table=list(hit.block_ids),
            num_shared_blocks=n,
            num_cached_tokens=hit.num_cached_tokens,
            tier_tokens=dict(hit.tier_tokens),
            keys=list(hit.keys),
            num_committed=n if hit.pending is None else hit.pending.start,
            node=hit.node,
            num_dropped=dropped,
            num_prompt_tokens=len(token_ids),
            num_window_dropped=hit.window_from,
            num_window_end=n,
            pending=hit.pending,
        )
        looked_up = token_ids if whole_prompt else token_ids[:-1]
        try:
            if lent is not None and lent.start == n * self.block_size:
                tail = self.cache.tails.copy(lent)
            else:
                tail = self.cache.tails.take(cache_salt, as_token_array(looked_up), n)
        except BaseException:
            self.close(seq)  # the hit's references and lock, which the table took
            raise
        if tail is not None:  # a fresh block of ours, the tail's K/V copied in: writable
            seq.block_table.append(tail.block_id)
            seq.num_cached_tokens += tail.num_tokens
            seq.tier_tokens[DEVICE_TIER] = seq.tier_tokens.get(DEVICE_TIER, 0) + tail.num_tokens
        return seq

    def keep_tail(self, seq: SeqBlocks, token_ids: Sequence[int] | np.ndarray) -> bool:
        """At a request's end, before `close`: its last, partly filled block becomes a tail
        of the cache (kvstore/device/tails.py), for a request that goes on from these tokens.
        `token_ids`: the tokens whose K/V the table holds that later lookups may reuse. Only
        when every full block before it is committed (a lookup can then hit them)."""
        m, r = divmod(len(token_ids), self.block_size)
        if not self.cache.tails.capacity or not self._partial_block(seq, m, r):
            return False
        block, seq.block_table[m] = seq.block_table[m], None  # `close` skips it: the tail's
        self.cache.tails.put(seq.cache_salt, as_token_array(token_ids), block)
        return True

    def lend_tail(self, seq: SeqBlocks, num_tokens: int) -> LentTail | None:
        """While a request runs: lend its partly filled block at position `num_tokens` (one
        more reference, no copy) to requests that repeat its first `num_tokens` tokens (a
        group's branches), which copy it (`open(..., lent=...)`). The request only writes
        past those positions, never in them. Give it back with `return_lent`.
        None when there is none to lend (a whole number of blocks, a block not committed
        before it, or an attention kind that keeps no tails)."""
        m, r = divmod(num_tokens, self.block_size)
        if not self.kind.keeps_tails or not self._partial_block(seq, m, r):
            return None
        block = seq.block_table[m]
        self.held.share([block])  # type: ignore[list-item]
        return LentTail(block, m * self.block_size, r)  # type: ignore[arg-type]

    def return_lent(self, lent: LentTail) -> None:
        """Give back the reference `lend_tail` took (its inverse: one reference less)."""
        self.held.free([lent.block_id])

    def _partial_block(self, seq: SeqBlocks, m: int, r: int) -> bool:
        """Whether block m of the table holds r (>= 1) positions a lookup can go on to: every
        full block before it is committed (a lookup then hits them), and it is the table's own."""
        whole_before = seq.num_committed == m and not seq.num_dropped
        in_table = seq.num_shared_blocks <= m < len(seq.block_table)
        return not seq.closed and r > 0 and whole_before and in_table

    def keys_of(
        self,
        token_ids: Sequence[int] | np.ndarray,
        cache_salt: str,
        known: Sequence[BlockHash] = (),
    ) -> list[BlockHash]:
        """Lookup keys of the full blocks of token_ids (what `open` would look up), hashing
        only those past `known`."""
        return self.cache.block_keys(token_ids, cache_salt, known)

    def num_available(self) -> int:
        """Blocks a request could get now: free, or cached and unlocked (evictable)."""
        return self.held.num_available()

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def grow(self, seq: SeqBlocks, num_tokens: int, compute_to: int | None = None) -> bool:
        """Make the table hold `num_tokens` positions, evicting unlocked cached blocks as
        needed; False (and nothing taken) when the pool cannot give enough. Blocks a model's
        window layers hold apart (a hybrid model's) get those parts up to position
        `compute_to` (default `num_tokens`): the positions the next step computes."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        reach = self.blocks_for(num_tokens if compute_to is None else compute_to)
        if not self.kind.has_room(seq, reach, self.held):
            return False  # (before any block is taken: a grow short of parts evicts none)
        ids = []
        if need > 0:
            whole = not self.kind.splits_blocks  # (else `reach` gives the parts)
            ids = self.held.allocate(need, all_or_none=True, window=whole)
            if not ids:
                return False
            # attention reads the last block whole (masked past the row's end): it must hold
            # no NaN from earlier use or never-written memory; those before it get written
            self.pool.zero(ids[-1:])
            seq.block_table.extend(ids)
        if not self.kind.reach(seq, reach, self.held):
            if ids:
                del seq.block_table[-len(ids) :]
                self.held.free(ids, window=False)
            return False
        return True

    def fit(self, seq: SeqBlocks, num_tokens: int, start: int, num_new: int) -> int | None:
        """`grow` for a step that computes `num_new` positions from `start`: how many it
        can (the attention kind may shrink a step by halves to what it can hold), or None
        when the pool cannot give even one."""
        if not self.kind.splits_blocks and len(seq.block_table) * self.block_size >= num_tokens:
            return num_new  # (a decode step's usual case: the table holds it already)
        num_new = self.kind.fit_step(seq, start, num_new)
        while not self.grow(seq, num_tokens, start + num_new):
            if not self.kind.shrinks_steps or num_new <= 1:
                return None
            num_new = (num_new + 1) // 2
        return num_new

    def commit(self, seq: SeqBlocks, token_ids: Sequence[int] | np.ndarray, num_tokens: int) -> int:
        """Give the index every full block of token_ids[:num_tokens] not committed yet (their
        K/V must be written). Returns the number of blocks the index kept."""
        n = min(num_tokens // self.block_size, len(seq.block_table))
        if n <= seq.num_committed or seq.num_committed < seq.num_dropped:
            return 0  # (a path cannot go on past a block the request dropped uncommitted)
        if seq.pending is not None:
            return 0  # blocks still loading come first, once they verify (`settle`)
        tokens = as_token_array(token_ids[: n * self.block_size])
        if len(seq.keys) < n:  # only blocks past the keys it carries (output, a chunk's end)
            seq.keys = self.cache.scopes.get(seq.cache_salt).keys(tokens, seq.keys)
        done = self.held.commit(
            keys=seq.keys[:n],
            token_ids=tokens,
            block_ids=seq.block_table[:n],  # type: ignore[arg-type]
            start=seq.num_committed,
            cache_salt=seq.cache_salt,
            tenant=seq.tenant,
            node=seq.node,
        )
        seq.node, seq.num_committed = done.node, done.num_blocks
        if done.num_blocks < n:  # the tenant is at its quota: commits stop here
            seq.commit_end = done.num_blocks * self.block_size
        return done.kept

    def slide(self, seq: SeqBlocks, num_computed: int) -> int:
        """Let go of what no query from position `num_computed` on sees (the attention
        kind decides what: nothing, whole blocks, or window parts), and of the index's
        copies of those committed (`HeldBlocks.punch`, which keeps those before a branch
        point). The index also keeps the window before the prompt's end, where the same
        prompt, sent again, hits. Returns how many blocks slid."""
        if seq.closed or not self.kind.slides:
            return 0
        limit, align = self._chunk_start(seq), self.punch_align  # write-back gets whole chunks
        lo, hi = self.kind.slide(seq, num_computed, limit, align, self.held)
        self._punch_committed(seq, lo, min(hi, seq.num_committed))
        return hi - lo

    def _punch_committed(self, seq: SeqBlocks, lo: int, hi: int) -> None:
        """Drop the index's copies of committed blocks [lo, hi), but the prompt's window."""
        if seq.node is None or lo >= hi:
            return
        keep_lo, keep_hi = self._prompt_window(seq)
        for a, b in ((lo, min(hi, keep_lo)), (max(lo, keep_hi), hi)):
            if a < b:
                self.held.punch(seq.node, a, b)

    def _prompt_window(self, seq: SeqBlocks) -> tuple[int, int]:
        """Blocks a later lookup of the same prompt needs (with or without its last token)."""
        n, window = seq.num_prompt_tokens, self.kind.window_blocks or 0
        align = self.punch_align
        lo = (max(0, n - 1) // self.block_size - window) // align * align
        return lo, cdiv(n // self.block_size, align) * align

    def _chunk_start(self, seq: SeqBlocks) -> int:
        """The first block of the tier chunk still being filled: its blocks stay until it is
        whole and written (entries of `chunk_blocks` blocks). Slides stop before it."""
        n, end = self.punch_align, seq.commit_end
        if n == 1 or (end is not None and seq.num_committed >= end // self.block_size):
            return len(seq.block_table)  # (nothing more is committed: no chunk to wait for)
        return seq.num_committed // n * n

    def reserve(self, n: int) -> list[int]:
        """Up to n zeroed blocks held outside any table (an engine's scratch, a self-test);
        the cache's stats count them as `reserved`."""
        ids = self.held.reserve(n)
        self.pool.zero(ids)
        return ids

    def release(self, block_ids: list[int]) -> None:
        """Return blocks taken with `reserve`."""
        self.held.unreserve(block_ids)

    def settle(self, seq: SeqBlocks) -> bool:
        """Wait for the table's layer-by-layer load (`open(layered=True)`) and commit the
        blocks that verified. False if some did not: what a forward computed on them must
        be dropped and computed again (close the table and open a new one)."""
        pending, seq.pending = seq.pending, None
        if pending is None:
            return True
        done, got = self.cache.promoter.settle(  # type: ignore[union-attr]
            pending, seq.keys, seq.block_table, seq.node, self.held.commit
        )
        seq.node, seq.num_committed = done.node, done.num_blocks
        return got == pending.load.num_blocks

    def close(self, seq: SeqBlocks) -> None:
        """Drop the request's references and lock (after its load ends). Idempotent."""
        if not seq.closed:
            self.settle(seq)
            ids = [b for b in seq.block_table if b is not None]
            self.held.drop(seq.node, ids, self.kind.windows_held(seq))
        seq.closed, seq.node, seq.block_table = True, None, []
