"""The attention-kind contract, and full attention, the kind every other one refines.

A model's attention decides which cached blocks are worth anything: a full-attention layer's
query reads the whole prefix, a sliding-window layer's only its last W positions, and a
hybrid model has both kinds of layers. One `AttentionKind` per cache decides, in its own
class: what a hit is, which references the index and a hit hold, what a running request
lets go of as its window slides, and which blocks a tier write may read. The cache, its
held-blocks API and the block tables call it and carry no per-kind branch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from hashing import BlockHash
from kvstore.device.pool import BlockPool
from kvstore.device.seq_blocks import SeqBlocks
from kvstore.hits import CacheHit
from kvstore.index import MatchResult, RadixIndex, TreeNode
from kvstore.layout import LayerKV

Relock = Callable[[list[BlockHash], np.ndarray, TreeNode | None], MatchResult]
Span = Callable[[TreeNode, int, int], None]  # blocks [lo, hi) of a node's path
# blocks of a node's path the index dropped, and the owner (tenant) each was counted against
Forget = Callable[[list[str], list[int]], None]


class Held(Protocol):
    """What a running request's side of a kind calls: the cache's API for blocks a caller
    holds (`HeldBlocks`, kvstore/device/held.py), each call under the cache's lock."""

    def free(self, block_ids: Sequence[int], window: bool = True) -> None: ...
    def window_room(self, n: int) -> int: ...
    def assign_windows(self, block_ids: Sequence[int]) -> bool: ...
    def drop_window(self, block_ids: Sequence[int]) -> None: ...


class AttentionKind(ABC):
    """How one kind of attention caches. The defaults are what every layer reading the
    whole prefix needs; a kind refines what differs. Every method runs under the cache's
    lock."""

    window: int | None = None  # tokens a query sees back; None: the whole prefix
    window_blocks: int | None = None  # blocks a hit must hold before its point
    # a block's layers are held in parts: a request holds the window layers' part of only
    # the blocks its window sees (a hybrid model's window plane)
    splits_blocks: bool = False
    # write-back tiers are written at commit: a block loses a part long before eviction,
    # and an entry holds every layer
    writes_back_at_commit: bool = False

    def __init__(self, pool: BlockPool, index: RadixIndex):
        self.pool, self.index = pool, index

    @property
    def keeps_tails(self) -> bool:
        """Whether finished requests' partial last blocks are kept (kvstore/device/tails.py): not
        when requests let go of blocks as they decode."""
        return self.window is None

    # --- references -------------------------------------------------------------------------

    def index_take(self, block_ids: Sequence[int]) -> None:
        """The index takes a reference to each block it caches."""
        self.pool.incref(block_ids)

    def index_free(self, block_ids: Sequence[int]) -> None:
        """Undo `index_take` (evicted blocks, or duplicates the index did not keep)."""
        self.pool.free(block_ids)

    def hit_take(self, block_ids: Sequence[int | None]) -> list[int]:
        """A hit takes a reference to each of its blocks (None: a hole); returns the blocks
        whose window parts it holds too (a hybrid model's)."""
        self.pool.incref([b for b in block_ids if b is not None], window=False)
        return []

    def room(self, n: int) -> int:
        """How many of n fresh blocks the pool can give with every part they need."""
        return n

    def window_room(self, n: int) -> int:
        """Window slots a caller can have, freeing up to n only the index holds (a hybrid
        model's window plane; none without one)."""
        return 0

    def assign_windows(self, block_ids: Sequence[int]) -> bool:
        """Give a caller's blocks their window parts, all or none (a hybrid model's)."""
        return True

    def punch(
        self, node: TreeNode, lo: int, hi: int, align: int, write_back: Span, forget: Forget
    ) -> int:
        """A running request at `node` slid past blocks [lo, hi) of its path: the index lets
        go of what no later hit needs there, in whole `align`-block chunks (`write_back`
        first hands whole blocks to write-back tiers; `forget` accounts and frees blocks the
        index dropped). Returns the number of blocks (or window parts) let go of."""
        raise ValueError("punch() needs a cache built with a window")

    # --- hits -------------------------------------------------------------------------------

    @abstractmethod
    def usable_blocks(self, block_ids: Sequence[int | None]) -> int:
        """The longest prefix of a device match a hit can use, in blocks."""

    def promote_from(self, block_ids: list[int | None], windows: list[int]) -> int:
        """The block a promotion from the tiers starts at (a hit holding `windows`)."""
        return len(block_ids)

    def readable(self, block_ids: list[int | None], windows: list[int]) -> list[int | None]:
        """A hit's blocks a tier write may read (None: skip its chunk)."""
        return block_ids

    @abstractmethod
    def cut(self, hit: CacheHit, windows: list[int], tokens: np.ndarray, relock: Relock) -> None:
        """Cut a hit holding `windows` to its longest usable prefix, letting go of the rest
        (`relock` moves its index lock to a shorter path)."""

    def gather(self, hit: CacheHit) -> list[LayerKV]:
        """Per-layer K/V of a hit's blocks, contiguous."""
        return self.pool.gather(hit.block_ids, hit.window_from)  # type: ignore[arg-type]

    def copies_whole(self, hit: CacheHit) -> bool:
        """Whether every layer of every block of the hit is held (a caller may copy them)."""
        return True

    # --- stores -----------------------------------------------------------------------------

    def refill(self, block_ids: Sequence[int], layers: Sequence[LayerKV]) -> None:
        """A caller stored K/V over a cached path: blocks missing a part may take it back."""
        return None

    def after_insert(
        self, keys: list[BlockHash], tokens: np.ndarray, start: int, new: Sequence[int]
    ) -> None:
        """An insert found some of the caller's blocks `new` (keys[start:]) cached already."""
        return None

    def stats(self) -> dict[str, int]:
        """The kind's own figures for `PrefixCache.stats()["device"]`."""
        return {}

    def check(self, cached: Sequence[int]) -> None:
        """The kind's own invariants over the index's blocks (`check_integrity`)."""
        return None

    # --- a running request (kvstore/block_tables.py), called without the lock ---

    shrinks_steps: bool = False  # a step the kind cannot hold may shrink by halves
    slides: bool = False  # `slide` may let something go (else a step's call is skipped)

    def fit_step(self, seq: SeqBlocks, start: int, num_new: int) -> int:
        """A step of `num_new` positions from `start`, cut to what the kind can hold before
        any block is taken back for it."""
        return num_new

    def has_room(self, seq: SeqBlocks, end_block: int, held: Held) -> bool:
        """Whether the parts blocks [.., end_block) still need can be had (nothing taken)."""
        return True

    def reach(self, seq: SeqBlocks, end_block: int, held: Held) -> bool:
        """Give the table's blocks before `end_block` the parts a step needs, all or none."""
        return True

    def slide(
        self, seq: SeqBlocks, num_computed: int, limit: int, align: int, held: Held
    ) -> tuple[int, int]:
        """Let go of what no query from position `num_computed` on sees, not past block
        `limit`, in whole `align`-block chunks; returns the blocks [lo, hi) that slid
        (lo == hi: none)."""
        return 0, 0

    def windows_held(self, seq: SeqBlocks) -> list[int] | None:
        """The blocks whose window parts the request holds at its end (None: every one)."""
        return None


class FullAttention(AttentionKind):
    """Every layer reads the whole prefix: a hit is every matched block, nothing slides."""

    def usable_blocks(self, block_ids: Sequence[int | None]) -> int:
        return len(block_ids)

    def cut(self, hit: CacheHit, windows: list[int], tokens: np.ndarray, relock: Relock) -> None:
        return None
