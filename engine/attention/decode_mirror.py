"""One decoding request's K/V kept contiguous, so one-request decode steps read it in place.

A paged step reads each row's keys through its block table: one gather of the row's blocks
per layer per step (on a 2-core CPU about 2 ms of a 63 ms SmolLM2 decode step at 250 tokens,
measured in-process). With one client there is one row: `DecodeMirror` keeps that request's
K/V in one buffer, built from the pool once (one gather of every layer) and then appended by
each step's new token, so attention reads a view of it and gathers nothing.

The pool is written as always and stays the source of truth; the mirror is a read cache of
it, outside the pool's memory budget: at most a quarter of the pool's positions (a longer
request reads the pool), and a device out of memory for it reads the pool too.

It holds positions [0, length) of the request whose `SeqBlocks` is `seq`; a step uses it
only when its one row is that request's and starts at `length`, else the mirror is built
again from the pool. That is enough: the blocks a running request holds are written only by
its own steps (blocks it shares are never written), so between two consecutive steps of one
request its K/V in the pool cannot change; a preempted request comes back with a new `seq`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.step_row import Row
from kvstore.units import cdiv

_MIN_CAPACITY = 256  # positions; the buffer doubles past it
POOL_SHARE = 4  # the mirror holds at most 1/POOL_SHARE of the pool's positions


class DecodeMirror:
    """Contiguous K/V of the one request of one-row decode steps, for one runner's pool."""

    def __init__(self, kv: torch.Tensor):
        self.kv = kv  # [num_blocks, layers, 2, kv_heads, block_size, head_dim]
        self.buffer: torch.Tensor | None = None  # [layers, 2, kv_heads, capacity, head_dim]
        self.seq: object | None = None  # the request (its SeqBlocks) held, None: nothing
        self.length = 0  # positions [0, length) are held
        self.builds = 0  # times the mirror was built from the pool
        _, _, _, _, block_size, _ = kv.shape
        self.max_positions = kv.shape[0] * block_size // POOL_SHARE  # bounds its memory

    def for_step(self, rows: Sequence[Row]) -> DecodeMirror | None:
        """The mirror, ready for a step of `rows` if it decodes one request alone: holding
        positions [0, row.start) of its request, room for the new token included. None (the
        step reads the pool, and may write the mirrored request's K/V: the mirror is
        dropped) for any other step, a request longer than the mirror may be, or a device
        without the memory for it."""
        row = rows[0]
        single = len(rows) == 1 and row.num_new == 1 and not row.num_dropped
        if not single or row.seq is None or row.end > self.max_positions:
            self.invalidate()
            return None
        try:
            if row.seq is not self.seq or row.start != self.length:
                self._rebuild(row)
            self._reserve(row.end)
        except (torch.OutOfMemoryError, MemoryError):  # a device short of memory: the pool path
            self.invalidate()
            self.buffer = None
            return None
        return self

    def advance(self, row: Row) -> None:
        """The step ran: its token's K/V was written to every layer's buffer."""
        self.length = row.end

    def invalidate(self) -> None:
        self.seq, self.length = None, 0

    def write(self, layer: int, position: int, new: torch.Tensor) -> torch.Tensor:
        """Write one token's K/V (new [2, kv_heads, head_dim]) at `position`; returns the
        layer's K/V up to it: [2, kv_heads, position + 1, head_dim] (a view)."""
        assert self.buffer is not None
        buf = self.buffer[layer]
        buf[:, :, position] = new.to(buf.dtype)
        return buf[:, :, : position + 1]

    def _rebuild(self, row: Row) -> None:
        self.invalidate()
        bs = self.kv.shape[4]
        num_blocks = cdiv(row.start, bs)
        self._reserve(max(row.end, num_blocks * bs))
        if num_blocks:
            assert self.buffer is not None
            table = torch.as_tensor(list(row.block_table[:num_blocks]), device=self.kv.device)
            blocks = self.kv.index_select(0, table)  # [n, layers, 2, kv_heads, bs, head_dim]
            layers, _, heads, _, dim = self.buffer.shape
            flat = blocks.permute(1, 2, 3, 0, 4, 5).reshape(layers, 2, heads, -1, dim)
            self.buffer[:, :, :, : num_blocks * bs] = flat
        self.seq, self.length = row.seq, row.start
        self.builds += 1

    def _reserve(self, positions: int) -> None:
        """A buffer of at least `positions` positions (its content kept)."""
        old = self.buffer
        if old is not None and old.shape[3] >= positions:
            return
        capacity = max(_MIN_CAPACITY, 1 << (positions - 1).bit_length())
        _, layers, _, heads, _, dim = self.kv.shape
        shape = (layers, 2, heads, capacity, dim)
        new = torch.empty(shape, dtype=self.kv.dtype, device=self.kv.device)
        if old is not None:
            new[:, :, :, : old.shape[3]] = old
        self.buffer = new
