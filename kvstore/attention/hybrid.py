"""The index side of a hybrid model's window plane (kvstore/device/window_plane.py).

A hybrid model's cache never drops a block's full layers while the block is cached: its
full layers' queries read the whole prefix. What slides out of a running request's window is
the block's window layers' part, which the request lets go of and the index too (but the
window before a branch point or a prompt's end, as a window-only cache keeps). So a cached
block either holds both parts or only its full part; `IndexWindows.punched` lists the latter.

Hit rule: a prefix of P blocks is a hit when its blocks are cached (full parts: the index
path) and the last ceil(W / block_size) of them still hold their window parts
(`window_prefix` over the window plane).

When window slots run short, the window parts only the index holds go first, least recently
hit first (`reclaim`); their blocks' full parts stay cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from hashing import BlockHash
from kvstore.attention.base import AttentionKind, Forget, Held, Relock, Span
from kvstore.attention.sliding import cut_tier_tokens, slid_to, window_prefix
from kvstore.device.pool import BlockPool
from kvstore.device.seq_blocks import SeqBlocks
from kvstore.hits import CacheHit
from kvstore.index import RadixIndex, TreeNode
from kvstore.layout import LayerKV
from kvstore.units import cdiv


class IndexWindows:
    """Which cached blocks the index holds without their window part; the index's references
    taken and dropped with the right part. The caller holds the cache's lock."""

    def __init__(self, pool: BlockPool, index: RadixIndex):
        if pool.window is None:
            raise ValueError("IndexWindows needs a pool with a window plane")
        self.pool, self.plane, self.index = pool, pool.window, index
        self.punched: set[int] = set()  # cached blocks whose window part the index let go
        # cached blocks whose window part the index holds, least recently hit first
        self._held: OrderedDict[int, None] = OrderedDict()

    def take(self, block_ids: Sequence[int]) -> None:
        """The index takes a reference to each block, with its window part if it has one."""
        held = self.plane.held(block_ids)
        with_part = [b for b, h in zip(block_ids, held, strict=True) if h]
        without = [b for b, h in zip(block_ids, held, strict=True) if not h]
        self.pool.incref(with_part)
        self.pool.incref(without, window=False)
        self._held.update(dict.fromkeys(with_part))
        self.punched.update(without)

    def free(self, block_ids: Sequence[int]) -> None:
        """The index lets go of each block (evicted, or a duplicate it did not keep)."""
        without = [b for b in block_ids if b in self.punched]
        with_part = [b for b in block_ids if b not in self.punched]
        self.punched.difference_update(without)
        for b in with_part:
            del self._held[b]
        self.pool.free(without, window=False)
        self.pool.free(with_part)

    def punch(self, block_ids: Sequence[int]) -> list[int]:
        """The index lets go of the window part of each block (it keeps the full part);
        returns the blocks it let go of (those it still held)."""
        ids = [b for b in dict.fromkeys(block_ids) if b not in self.punched]
        for b in ids:
            del self._held[b]
        self.punched.update(ids)
        self.pool.drop_window(ids)
        return ids

    def refill(self, block_ids: Sequence[int], layers: Sequence[LayerKV]) -> None:
        """A caller's K/V of a cached path (`block_ids`; block i holds positions from
        i * block_size): its blocks without their window part get one, slots permitting."""
        wanted = [(i, b) for i, b in enumerate(block_ids) if b in self.punched]
        wanted = wanted[: self.room(len(wanted))]
        for i, b in wanted:
            self.pool.assign_window([b])  # the index's
            try:
                self.pool.scatter([b], layers, start_token=i * self.pool.block_size)
            except BaseException:  # a quantized pool refuses an inf or a NaN: still punched
                self.pool.drop_window([b])
                raise
            self.punched.discard(b)
            self._held[b] = None

    def room_at_most(self) -> int:
        """Window slots a caller could have now: free, or held by the index alone."""
        reclaimable = sum(self.plane.ref_cnt[b] == 1 for b in self._held)
        return self.plane.num_free + int(reclaimable)

    def room(self, n: int) -> int:
        """Free window slots, after taking back up to what n needs from those only the
        index holds (`reclaim`)."""
        if n > self.plane.num_free:
            self.reclaim(n - self.plane.num_free)
        return self.plane.num_free

    def cut(
        self, block_ids: Sequence[int], windows: Sequence[int], window_blocks: int
    ) -> tuple[int, int]:
        """A hit of `block_ids` holding the window parts of `windows`, cut to its usable
        prefix: (its point, its first window block). It keeps the window parts of blocks
        [first, point) (counted as hit), lets go of the others and of the blocks past the
        point (their references: a hit holds every block's full part)."""
        point = self.hit_point(block_ids, window_blocks, windows)
        first = max(0, point - window_blocks)
        keep = set(block_ids[first:point])
        self.pool.drop_window([b for b in windows if b not in keep])
        self.pool.free(block_ids[point:], window=False)
        self.touch(block_ids[first:point])
        return point, first

    def touch(self, block_ids: Sequence[int]) -> None:
        """A hit used these blocks' window parts: they go last when slots run short."""
        for b in block_ids:
            if b in self._held:
                self._held.move_to_end(b)

    def fill(self, index_ids: Sequence[int], caller_ids: Sequence[int]) -> int:
        """After an insert found keys cached: each index block that let go of its window part
        gets a copy of the caller's block for the same key (its K/V for the same tokens),
        slots permitting (`room`). Returns how many were filled."""
        caller_ids = caller_ids[: len(index_ids)]
        self.room(sum(b in self.punched for b in index_ids))
        filled = 0
        for b, c in zip(index_ids, caller_ids, strict=True):
            if b != c and b in self.punched and self.plane.fill(b, c):
                self.punched.discard(b)
                self._held[b] = None
                filled += 1
        return filled

    def reclaim(self, n: int) -> int:
        """Free up to n window slots that only the index holds (no running request's or
        hit's window sees them), least recently hit first; returns how many were freed."""
        ids = []
        for b in self._held:
            if len(ids) == n:
                break
            if self.plane.ref_cnt[b] == 1:
                ids.append(b)
        return len(self.punch(ids))

    def hit_point(
        self, block_ids: Sequence[int], window_blocks: int, held: Sequence[int] | None = None
    ) -> int:
        """The longest prefix of a matched path a hybrid model can use, in blocks: the window
        parts of its last `window_blocks` blocks are held (now, or in `held`)."""
        if held is None:
            mask = self.plane.held(block_ids)
        else:
            held_set = set(held)
            mask = [b in held_set for b in block_ids]
        masked = [b if h else None for b, h in zip(block_ids, mask, strict=True)]
        return window_prefix(masked, window_blocks)

    def check(self, cached: Sequence[int]) -> None:
        """Invariants: a cached block holds its window part unless punched; every slot is
        free or a block's, once; no block counts more window owners than owners."""
        plane, cached_set = self.plane, set(cached)
        if not self.punched <= cached_set:
            raise AssertionError("a punched block is not cached")
        if set(self._held) != cached_set - self.punched:
            raise AssertionError("the index's window parts are not its cached, unpunched blocks")
        holding = list(cached_set - self.punched)
        if holding and not plane.held(holding).all():
            raise AssertionError("a cached block lost the window part the index holds")
        slots = [int(s) for s in plane.slot if s >= 0] + plane.free_slots()
        if sorted(slots) != list(range(plane.num_slots)):
            raise AssertionError("window slots: free + assigned != total, or one twice")
        if ((plane.ref_cnt > 0) != (plane.slot >= 0)).any():
            raise AssertionError("a window slot without an owner, or an owner without a slot")
        if (plane.ref_cnt > self.pool.ref_cnt).any():
            raise AssertionError("a block has more window owners than owners")


class HybridAttention(AttentionKind):
    """Full layers and window layers in one model: a block keeps its full layers' part
    while cached and lets go of its window layers' part (a slot of the pool's window plane)
    once no window sees it. A hit is a cached path whose last `window_blocks` blocks still
    hold their window parts; tiers are written whole at commit, while blocks hold both."""

    splits_blocks = True
    shrinks_steps = True
    slides = True
    writes_back_at_commit = True

    def __init__(self, pool: BlockPool, index: RadixIndex, window: int):
        super().__init__(pool, index)
        self.window = window
        self.window_blocks = cdiv(window, pool.block_size)
        self.windows = IndexWindows(pool, index)

    def index_take(self, block_ids: Sequence[int]) -> None:
        self.windows.take(block_ids)

    def index_free(self, block_ids: Sequence[int]) -> None:
        self.windows.free(block_ids)

    def hit_take(self, block_ids: Sequence[int | None]) -> list[int]:
        ids = [b for b in block_ids if b is not None]
        self.pool.incref(ids, window=False)
        if not ids:
            return []
        held = [b for b, h in zip(ids, self.pool.window.held(ids), strict=True) if h]  # type: ignore[union-attr]
        self.pool.window.take(held)  # type: ignore[union-attr]
        return held

    def room(self, n: int) -> int:
        return self.windows.room(n)

    def window_room(self, n: int) -> int:
        return self.windows.room(n)

    def assign_windows(self, block_ids: Sequence[int]) -> bool:
        """Free slots first, then slots only the index holds."""
        if not block_ids:
            return True
        if self.windows.room(len(block_ids)) < len(block_ids):
            return False
        self.pool.assign_window(block_ids)
        return True

    def punch(
        self, node: TreeNode, lo: int, hi: int, align: int, write_back: Span, forget: Forget
    ) -> int:
        """The index lets go of the window parts only (their full parts stay cached; every
        tier wrote them whole when they were committed)."""
        ids = self.index.punchable(node, lo, hi, self.window_blocks, align)
        return len(self.windows.punch(ids))

    def usable_blocks(self, block_ids: Sequence[int | None]) -> int:
        return self.windows.hit_point(block_ids, self.window_blocks)  # type: ignore[arg-type]

    def promote_from(self, block_ids: list[int | None], windows: list[int]) -> int:
        """Past the device match, or at the window before it when window parts missing
        there leave a shorter hit (tier blocks fill them)."""
        n = len(block_ids)
        point = self.windows.hit_point(block_ids, self.window_blocks, windows)  # type: ignore[arg-type]
        return n if point == n else max(0, n - self.window_blocks)

    def readable(self, block_ids: list[int | None], windows: list[int]) -> list[int | None]:
        """Only blocks whose window parts the hit holds: a tier write reads every layer."""
        held = set(windows)
        return [b if b in held else None for b in block_ids]

    def cut(self, hit: CacheHit, windows: list[int], tokens: np.ndarray, relock: Relock) -> None:
        """Keep the window parts of the last window's blocks (of `windows`, those the hit
        took), let go of the others, and of the blocks after the point, whose lock goes too."""
        point, first = self.windows.cut(hit.block_ids, windows, self.window_blocks)  # type: ignore[arg-type]
        if point < len(hit.block_ids):
            hit.node = relock(hit.keys[:point], tokens, hit.node).last_node
        hit.block_ids, hit.window_from = hit.block_ids[:point], first
        hit.num_cached_tokens = point * self.pool.block_size
        hit.tier_tokens = cut_tier_tokens(hit.tier_tokens, hit.num_cached_tokens)

    def copies_whole(self, hit: CacheHit) -> bool:
        return False

    def refill(self, block_ids: Sequence[int], layers: Sequence[LayerKV]) -> None:
        self.windows.refill(block_ids, layers)

    def after_insert(
        self, keys: list[BlockHash], tokens: np.ndarray, start: int, new: Sequence[int]
    ) -> None:
        """Cached blocks that lost their window part get copies of the caller's."""
        self.windows.fill(self.index.peek_prefix(keys, tokens).block_ids[start:], new)

    def stats(self) -> dict[str, int]:
        plane = self.windows.plane
        return {"window_slots_total": plane.num_slots, "window_slots_free": plane.num_free}

    def check(self, cached: Sequence[int]) -> None:
        self.windows.check(cached)

    # --- a running request: two block tables in one --------------------------------------
    # It holds every block's full part, and the window part of blocks
    # [num_window_dropped, num_window_end) only; the window layers read the table through
    # the pool's slot map.

    def fit_step(self, seq: SeqBlocks, start: int, num_new: int) -> int:
        """Cut by halves to what the window slots can hold (free, or held only by the
        index), before any is taken back for it."""
        bs = self.pool.block_size
        need = cdiv(start + num_new, bs) - seq.num_window_end
        if need <= self.pool.window.num_free:  # type: ignore[union-attr]
            return num_new  # (most steps: no scan of the index's window parts)
        room = self.windows.room_at_most()
        while num_new > 1 and cdiv(start + num_new, bs) - seq.num_window_end > room:
            num_new = (num_new + 1) // 2
        return num_new

    def has_room(self, seq: SeqBlocks, end_block: int, held: Held) -> bool:
        """Window slots for the blocks before `end_block` that have none yet (freeing
        slots only the index holds as needed)."""
        need = end_block - seq.num_window_end
        return need <= 0 or held.window_room(need) >= need

    def reach(self, seq: SeqBlocks, end_block: int, held: Held) -> bool:
        end = min(end_block, len(seq.block_table))
        ids = seq.block_table[seq.num_window_end : end]
        if not ids:
            return True
        if not held.assign_windows(ids):  # type: ignore[arg-type]
            return False
        # attention reads the last block whole: no NaN from earlier use in its window part
        self.pool.zero_window(ids[-1:])  # type: ignore[arg-type]
        seq.num_window_end = end
        return True

    def slide(
        self, seq: SeqBlocks, num_computed: int, limit: int, align: int, held: Held
    ) -> tuple[int, int]:
        """The request lets go of the window parts of blocks before the window; their full
        parts stay."""
        bs = self.pool.block_size
        upto = slid_to(seq, num_computed, self.window, bs, limit, align)  # type: ignore[arg-type]
        lo, upto = seq.num_window_dropped, min(upto, seq.num_window_end)
        if upto <= lo:
            return lo, lo
        seq.num_window_dropped = upto
        held.drop_window(seq.block_table[lo:upto])  # type: ignore[arg-type]
        return lo, upto

    def windows_held(self, seq: SeqBlocks) -> list[int] | None:
        return seq.block_table[seq.num_window_dropped : seq.num_window_end]  # type: ignore[return-value]
