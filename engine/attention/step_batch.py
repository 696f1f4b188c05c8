"""What one paged step's attention reads and writes, built once per step from its rows and
shared by every layer (engine/attention/paged.py).

The rows (step_row.py) are flattened in order into one sequence of T tokens. Each new
token's K/V goes to one slot (block, offset) of its row's table; a token in a shared leading
block writes the runner's scratch block instead (a cached block is read only). Decode rows
(one query each) are read as one padded batch of tables with an additive bias, the leading
blocks they all share read once; prefill chunks are read one by one under a causal mask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.attention.step_row import Row
from kvstore.units import cdiv

if TYPE_CHECKING:
    from engine.attention.decode_mirror import DecodeMirror


@dataclass
class PrefillRow:
    """A prefill chunk of the step: its queries, its blocks and its causal mask."""

    offset: int  # first query index in the flattened batch
    num_new: int
    table: torch.Tensor  # [blocks] long
    context: int  # keys attended: positions [0, context)
    mask: torch.Tensor | None  # [num_new, context] bool, causal with the row's offset; None
    # when the row starts at position 0 (plain causal: SDPA skips the masked half)
    start: int = 0  # position of the first query


@dataclass(frozen=True)
class Reads:
    """What one row group reads for one window: key blocks and which keys each query sees."""

    tables: torch.Tensor  # [blocks] (a prefill row) or [B, blocks] (decode rows) long
    context: int  # keys read: the first `context` positions of the tables' blocks
    mask: torch.Tensor  # [n, context] bool (prefill) or [B, 1, 1, context] float 0/-inf


@dataclass
class StepBatch:
    """Everything a step's attention needs, built once and shared by every layer."""

    write_blocks: torch.Tensor  # [T] long: the block each new token's K/V goes to
    write_offsets: torch.Tensor  # [T] long: its offset inside the block
    prefills: list[PrefillRow]
    num_tokens: int
    # the decode rows' reads, None without decode rows (`_add_decode`)
    decode_index: torch.Tensor | None = None  # [B] long: query index of each one-token row
    decode_shared: torch.Tensor | None = None  # [k] long: leading blocks every decode row shares
    decode_tables: torch.Tensor | None = None  # [B, w] long: each row's blocks past k, padded
    decode_bias: torch.Tensor | None = None  # [B, 1, 1, w * block_size] float32: 0 or -inf
    decode_rows: list[Row] = field(default_factory=list)
    block_size: int = 1
    scratch_block: int = 0
    reads: dict[tuple, Reads] = field(default_factory=dict)  # per (row group, window), lazily
    max_window: int | None = None  # the widest window every row still holds (None: any)
    mirror: DecodeMirror | None = None  # the one decode row's contiguous K/V (decode_mirror.py)
    # a hybrid model's window plane: block id -> slot ([num_blocks] long), the widest window
    # its rows' window parts still cover
    # waits until a layer's K/V of blocks still loading from a tier is in the pool
    # (kvstore/tiers/layered.py); None: nothing is loading
    layer_wait: Callable[[int], None] | None = None
    slot_map: torch.Tensor | None = None
    max_plane_window: int | None = None
    all_decode: bool = False  # every token is a decode row's, row i's at query i (a graph's)
    _plane_writes: torch.Tensor | None = None

    def plane_writes(self) -> torch.Tensor:
        """The window-plane slot each new token's K/V goes to."""
        if self._plane_writes is None:
            self._plane_writes = self.slot_map[self.write_blocks]  # type: ignore[index]
        return self._plane_writes

    def plane_reads(self, reads: Reads, key: tuple) -> Reads:
        """`reads` through the slot map (a window-plane layer's)."""
        key = ("plane", *key)
        if key not in self.reads:
            tables = self.slot_map[reads.tables]  # type: ignore[index]
            self.reads[key] = Reads(tables, reads.context, reads.mask)
        return self.reads[key]

    def prefill_reads(self, i: int, window: int | None) -> Reads:
        """Prefill row i's blocks and mask under `window` (None: every earlier position)."""
        key = ("prefill", i, window)
        if key not in self.reads:
            self.reads[key] = _prefill_reads(self.prefills[i], window, self.block_size)
        return self.reads[key]

    def decode_reads(self, window: int | None) -> Reads:
        """The decode rows' blocks (no shared prefix split) and bias under `window`."""
        key = ("decode", window)
        if key not in self.reads:
            device = self.write_blocks.device
            self.reads[key] = _decode_reads(
                self.decode_rows, window, self.block_size, self.scratch_block, device
            )
        return self.reads[key]


def build_step(
    rows: Sequence[Row], block_size: int, scratch_block: int, device: torch.device
) -> StepBatch:
    """The write slots and read tables of `rows`, flattened in order."""
    blocks, offsets, prefills = [], [], []
    decode_rows: list[tuple[int, Row]] = []
    offset = 0
    for row in rows:
        positions = torch.arange(row.start, row.end)
        table = torch.as_tensor(list(row.block_table), dtype=torch.long)
        if len(table) * block_size < row.end:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {row.end} tokens")
        block_index = positions // block_size
        target = table[block_index]
        target[block_index < row.num_shared_blocks] = scratch_block  # a cached block: read only
        blocks.append(target)
        offsets.append(positions % block_size)
        if row.num_new == 1:
            decode_rows.append((offset, row))
        else:
            prefills.append(_prefill(offset, row, table, device))
        offset += row.num_new
    batch = StepBatch(
        write_blocks=torch.cat(blocks).to(device),
        write_offsets=torch.cat(offsets).to(device),
        prefills=prefills,
        num_tokens=offset,
        decode_rows=[row for _, row in decode_rows],
        block_size=block_size,
        scratch_block=scratch_block,
    )
    if decode_rows:
        _add_decode(batch, decode_rows, block_size, scratch_block, device)
    bs = block_size
    held = [row.start + 1 - row.num_dropped * bs for row in rows if row.num_dropped]
    batch.max_window = min(held) if held else None
    held = [row.start + 1 - row.num_window_dropped * bs for row in rows if row.num_window_dropped]
    batch.max_plane_window = min(held) if held else None
    return batch


def _prefill(offset: int, row: Row, table: torch.Tensor, device: torch.device) -> PrefillRow:
    mask = None
    if row.start:
        keys = torch.arange(row.end)
        queries = torch.arange(row.start, row.end)
        mask = (keys.unsqueeze(0) <= queries.unsqueeze(1)).to(device)  # [num_new, end]
    return PrefillRow(
        offset=offset,
        num_new=row.num_new,
        table=table.to(device),
        context=row.end,
        mask=mask,
        start=row.start,
    )


def _prefill_reads(row: PrefillRow, window: int | None, block_size: int) -> Reads:
    """From the first block holding a key some query sees; mask [num_new, context]."""
    first = 0 if window is None else max(0, row.start - window + 1) // block_size
    device = row.table.device
    keys = torch.arange(first * block_size, row.context, device=device)
    queries = torch.arange(row.start, row.context, device=device).unsqueeze(1)
    mask = keys <= queries
    if window is not None:
        mask &= keys > queries - window
    return Reads(row.table[first:], row.context - first * block_size, mask)


def _decode_reads(
    rows: list[Row],
    window: int | None,
    block_size: int,
    scratch_block: int,
    device: torch.device,
    skip: int = 0,
) -> Reads:
    """Each row's blocks from the first one its window reaches (or from block `skip`, which
    every row shares and which are read apart), padded with the scratch block; bias
    [B, 1, 1, width * block_size]: 0 where the row's query sees the key."""
    firsts = [skip if window is None else max(0, r.end - window) // block_size for r in rows]
    used = [cdiv(r.end, block_size) for r in rows]
    width = max(u - f for u, f in zip(used, firsts, strict=True))
    tables = torch.full((len(rows), width), scratch_block, dtype=torch.long)
    for i, (row, first, last) in enumerate(zip(rows, firsts, used, strict=True)):
        tables[i, : last - first] = torch.as_tensor(list(row.block_table[first:last]))
    keys = torch.tensor(firsts).unsqueeze(1) * block_size + torch.arange(width * block_size)
    ends = torch.tensor([row.end for row in rows]).unsqueeze(1)  # the query sits at end - 1
    seen = keys < ends
    if window is not None:
        seen &= keys >= ends - window
    bias = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))
    return Reads(tables.to(device), width * block_size, bias[:, None, None, :].to(device))


def _shared_prefix(rows: list[Row], block_size: int) -> int:
    """Leading blocks that every row's table holds (the same block ids: read once for all);
    each row keeps at least the block of its own last position."""
    if len(rows) < 2:
        return 0
    limit = min((row.end - 1) // block_size for row in rows)
    first = rows[0].block_table
    k = 0
    while k < limit and all(row.block_table[k] == first[k] for row in rows[1:]):
        k += 1
    return k


def _add_decode(
    batch: StepBatch,
    decode_rows: list[tuple[int, Row]],
    block_size: int,
    scratch_block: int,
    device: torch.device,
) -> None:
    rows = [row for _, row in decode_rows]
    k = _shared_prefix(rows, block_size)
    own = _decode_reads(rows, None, block_size, scratch_block, device, skip=k)
    batch.decode_index = torch.tensor([offset for offset, _ in decode_rows], device=device)
    if k:
        batch.decode_shared = torch.as_tensor(list(rows[0].block_table[:k])).to(device)
    batch.decode_tables, batch.decode_bias = own.tables, own.mask
