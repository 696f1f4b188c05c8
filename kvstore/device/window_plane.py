"""The window plane of a hybrid model's pool: the K/V of its sliding-window layers, in slots
of their own.

A hybrid model (Gemma 2 and 3, gpt-oss, Qwen 2 with `max_window_layers`) mixes full layers,
whose queries read the whole prefix, with window layers, whose queries read only the last W
positions. A block's full layers' part stays as long as the block; its window layers' part
(a slot here) is needed only while some query can still see it. So a block id names two
parts: the full part at `BlockPool.kv[block_id]` and, while held, the window part at
`kv[slot[block_id]]`.

`ref_cnt[block_id]` counts the block's owners that hold its window part: the slot goes back
to the free list when that count reaches 0 (the last such owner let go: `drop`), or when the
block itself is freed. A block never gets a window part back once it let go of it, except by
`fill`, which copies another block's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

NO_SLOT = -1  # in `slot`: the block holds no window part (a numpy array cannot hold None)


class WindowPlaneError(ValueError):
    """A window part was taken or dropped that the block does not hold (an accounting bug)."""


class WindowPlane:
    """Window-layer slots for the blocks of one pool."""

    def __init__(
        self,
        num_blocks: int,
        num_slots: int,
        storage: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    ):
        # rows: a row per slot (what `fill` copies and `zero` clears); kv [num_slots,
        # window_layers, 2, kv_heads, block_size, head_dim], a quantized plane's values;
        # scales [num_slots, window_layers, 2, kv_heads, block_size] or None
        self.rows, self.kv, self.scales = storage
        self.num_slots = num_slots
        self.slot = np.full(num_blocks, NO_SLOT, dtype=np.int64)
        self.ref_cnt = np.zeros(num_blocks, dtype=np.int32)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def held(self, block_ids: Sequence[int]) -> np.ndarray:
        """Which of the blocks hold their window part (bool per block)."""
        return self.slot[np.asarray(block_ids, dtype=np.int64)] != NO_SLOT

    def assign(self, block_ids: Sequence[int]) -> None:
        """Give fresh blocks a slot each, held by their one owner."""
        if len(block_ids) > len(self._free):
            raise WindowPlaneError(f"need {len(block_ids)} window slots, {self.num_free} free")
        for block_id in block_ids:
            if self.slot[block_id] != NO_SLOT:
                raise WindowPlaneError(f"block {block_id} holds a window part already")
            self.slot[block_id] = self._free.pop()
            self.ref_cnt[block_id] = 1

    def take(self, block_ids: Sequence[int]) -> None:
        """One more owner holds each block's window part."""
        for block_id in block_ids:
            if self.slot[block_id] == NO_SLOT:
                raise WindowPlaneError(f"block {block_id} holds no window part to take")
            self.ref_cnt[block_id] += 1

    def drop(self, block_ids: Sequence[int]) -> int:
        """One owner lets go of each block's window part; returns the slots freed."""
        freed = 0
        for block_id in block_ids:
            if self.ref_cnt[block_id] <= 0:
                raise WindowPlaneError(f"block {block_id}: its window part is not held")
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                freed += self._release(block_id)
        return freed

    def on_free(self, block_id: int) -> None:
        """The block went back to the pool: so does its slot, whoever still counted on it."""
        self.ref_cnt[block_id] = 0
        self._release(block_id)

    def _release(self, block_id: int) -> int:
        slot = int(self.slot[block_id])
        if slot == NO_SLOT:
            return 0
        self.slot[block_id] = NO_SLOT
        self._free.append(slot)
        return 1

    def fill(self, block_id: int, source: int) -> bool:
        """Give `block_id`, which lost its window part, a copy of `source`'s (same keys: the
        same K/V), held by one owner. False when no slot is free."""
        if self.slot[block_id] != NO_SLOT or self.slot[source] == NO_SLOT or not self._free:
            return False
        self.assign([block_id])
        self.rows[int(self.slot[block_id])].copy_(self.rows[int(self.slot[source])])
        return True

    def slots(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The slots of blocks that all hold their window part (long, on the plane's device)."""
        slots = self.slot[np.asarray(block_ids, dtype=np.int64)]
        if (slots == NO_SLOT).any():
            missing = [b for b, s in zip(block_ids, slots, strict=True) if s == NO_SLOT]
            raise WindowPlaneError(f"blocks {missing[:8]} hold no window part")
        return torch.from_numpy(slots).to(self.kv.device)

    def slot_map(self, filler_block: int) -> torch.Tensor:
        """Block id -> slot for every block, `filler_block`'s slot where a block holds none
        (keys a window layer never sees: its mask hides them). [num_blocks] long."""
        return torch.from_numpy(self.slot_array(filler_block)).to(self.kv.device)

    def slot_array(self, filler_block: int) -> np.ndarray:
        """`slot_map` on the host: [num_blocks] int64."""
        filler = int(self.slot[filler_block])
        if filler == NO_SLOT:
            raise WindowPlaneError(f"filler block {filler_block} holds no window part")
        return np.where(self.slot == NO_SLOT, filler, self.slot).astype(np.int64, copy=False)

    def free_slots(self) -> list[int]:
        return list(self._free)
