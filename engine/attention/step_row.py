"""One request's part of a step: what the scheduler hands the runner for each row of a batch.

The runner flattens a step's rows into one sequence (step_batch.py); a row says which
pool blocks hold the request's K/V (its block table, in position order) and which positions
the step feeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.block_tables import SeqBlocks


@dataclass(frozen=True)
class Row:
    """One request's part of a step: `num_new` query tokens ending at position `end` - 1."""

    block_table: Sequence[int]  # the row's pool blocks, in position order
    start: int  # first position fed this step (positions below it are in the blocks)
    num_new: int  # tokens fed this step
    num_shared_blocks: int = 0  # leading blocks entered by reference: never written
    num_dropped: int = 0  # leading blocks a window model's request let go (never read)
    seq: object | None = field(default=None, compare=False)  # the request's identity, if any
    num_window_dropped: int = 0  # a hybrid model's: leading blocks without window parts

    @property
    def end(self) -> int:
        return self.start + self.num_new


def blocks_row(
    blocks: SeqBlocks, start: int, num_new: int, scratch_block: int, identified: bool = True
) -> Row:
    """The row of a request's blocks: its dropped leading entries read the scratch block.
    `identified`: the row carries the request's identity, so a decode mirror may keep its
    K/V (engine/attention/decode_mirror.py); a forward outside the loop leaves it out."""
    return Row(
        block_table=blocks.readable_table(scratch_block),
        start=start,
        num_new=num_new,
        num_shared_blocks=blocks.num_shared_blocks,
        num_dropped=blocks.num_dropped,
        seq=blocks if identified else None,
        num_window_dropped=blocks.num_window_dropped,
    )
