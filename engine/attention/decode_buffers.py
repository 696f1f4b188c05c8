"""The static buffers a captured decode step reads (engine/loop/graph.py), and the step
batch built over them.

A decode graph is captured once per (batch bucket, width bucket) and replayed with new
contents at the same addresses. Everything a decode step's attention needs lives in one
int64 device buffer, laid out as

    [input_ids | positions | write_blocks | write_offsets | context_lens | sources]
                                                                    (max_batch each)
    [slot map: a hybrid pool's block -> window-plane slot]          (num_blocks; else none)
    [tables: bucket x width, row-major]                             (max_batch x max_width)

Each step fills the host copy (pinned on a GPU) with numpy, real rows first and padding after
(a padded row writes the scratch block's slot 0 and reads that one key), and moves the part
the bucket reads to the device in one copy. On a GPU the host copy is refilled only once the
previous copy from it has run (an event): the host may be a step ahead of the device. The
tables region is read as [bucket, width]
with the bucket's own width as its stride, so a step copies only `bucket * width` entries of
it, whatever the largest width. Masks are not copied: the captured step computes them from
`context_lens` on the device (`StaticStepBatch`), so one graph serves every context length
up to its width. A row whose token is still on the device (the previous step's,
engine/loop/overlap.py) names its slot there in `sources` (-1: the host's token), and the
captured step gathers it: no step waits for the host to learn a token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention.step_batch import Reads, StepBatch
from engine.attention.step_row import Row

# input_ids, positions, write_blocks, write_offsets, context_lens, sources
HEADER_FIELDS = 6


class DecodeBuffers:
    """The static inputs of captured decode steps of up to `max_batch` rows reading up to
    `max_width` blocks each."""

    def __init__(
        self,
        max_batch: int,
        max_width: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
        slot_map_size: int = 0,
    ):
        """`slot_map_size`: a hybrid pool's blocks (its window plane's slot map rides along)."""
        self.max_batch, self.max_width = max_batch, max_width
        self.block_size, self.scratch_block = block_size, scratch_block
        self.slot_map_size = slot_map_size
        self.tables_start = HEADER_FIELDS * max_batch + slot_map_size
        size = self.tables_start + max_batch * max_width
        cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=cuda)
        self.device_buffer = torch.zeros(size, dtype=torch.int64, device=device)
        self.copied = torch.cuda.Event() if cuda else None  # the last copy from `host` ran
        self._np = self.host.numpy()
        self.row_index = torch.arange(max_batch, device=device)  # decode rows' query index
        self.key_positions = torch.arange(max_width * block_size, device=device)

    def header(self, field: int, tensor: torch.Tensor | None = None) -> torch.Tensor:
        """Field `field` of the header (0 input_ids ... 5 sources): [max_batch]."""
        buffer = self.device_buffer if tensor is None else tensor
        return buffer[field * self.max_batch : (field + 1) * self.max_batch]

    def tables(self, bucket: int, width: int, tensor: torch.Tensor | None = None) -> torch.Tensor:
        """The block tables a (bucket, width) step reads: [bucket, width] long."""
        buffer = self.device_buffer if tensor is None else tensor
        start = self.tables_start
        return buffer[start : start + bucket * width].view(bucket, width)

    def slot_map(self, tensor: torch.Tensor | None = None) -> torch.Tensor | None:
        """The window plane's slot map a step reads ([num_blocks] long), if any."""
        if not self.slot_map_size:
            return None
        buffer = self.device_buffer if tensor is None else tensor
        start = HEADER_FIELDS * self.max_batch
        return buffer[start : start + self.slot_map_size]

    def input_ids(self, bucket: int, buffer: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """A step's input ids: the host's, or where `sources` names a slot, the device's
        sampled token there. [bucket] long."""
        ids, sources = self.header(0, buffer)[:bucket], self.header(5, buffer)[:bucket]
        return torch.where(sources >= 0, sampled[sources.clamp(min=0)], ids)

    def fill(
        self,
        rows: Sequence[Row],
        token_ids: Sequence[int],
        bucket: int,
        width: int,
        sources: dict[int, int] | None = None,
        slot_map: np.ndarray | None = None,
    ) -> None:
        """Write one-token rows (and their tokens) into the first `bucket` rows of the host
        copy, padding after them, and move what a (bucket, width) step reads to the device.
        `sources`: row -> the slot of its token among the device's sampled tokens;
        `slot_map`: a hybrid pool's. `ValueError` for rows that are not one token each or do
        not fit."""
        n = len(rows)
        if not 0 < n <= bucket <= self.max_batch or width > self.max_width:
            raise ValueError(f"{n} rows do not fit a step of {bucket} x {width} blocks")
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read the host copy
        starts = self._fill_tables(rows, bucket, width)
        ids, positions, blocks, offsets, contexts, source = self._header_views()
        ids[:n], positions[:n] = token_ids, starts
        offsets[:n], contexts[:n] = starts % self.block_size, starts + 1
        ids[n:bucket], positions[n:bucket], offsets[n:bucket] = 0, 0, 0
        contexts[n:bucket], blocks[n:bucket] = 1, self.scratch_block  # padding: scratch slot 0
        source[:bucket] = -1
        for row, slot in (sources or {}).items():
            source[row] = slot
        if slot_map is not None:
            self._np[HEADER_FIELDS * self.max_batch : self.tables_start] = slot_map
        end = self.tables_start + bucket * width
        self.device_buffer[:end].copy_(self.host[:end], non_blocking=True)
        if self.copied is not None:
            self.copied.record(torch.cuda.current_stream(self.device_buffer.device))

    def _fill_tables(self, rows: Sequence[Row], bucket: int, width: int) -> np.ndarray:
        """The rows' tables (scratch past their blocks) and write blocks (scratch for a
        cached block, never written) in the host copy; the rows' first positions."""
        n, bs = len(rows), self.block_size
        fed = [row.num_new for row in rows]
        if fed.count(1) != n:
            raise ValueError(f"a decode row feeds one token, these feed {fed}")
        starts = np.fromiter((row.start for row in rows), dtype=np.int64, count=n)
        used = (starts // bs + 1).tolist()  # blocks each row reads
        if max(used) > width:
            raise ValueError(f"a row reads {max(used)} blocks, the step reads {width}")
        tables = self._np[self.tables_start :][: bucket * width].reshape(bucket, width)
        tables.fill(self.scratch_block)
        blocks = self._header_views()[2]
        for i, (row, u) in enumerate(zip(rows, used, strict=True)):
            tables[i, :u] = row.block_table[:u]
            # a cached block (the whole-prompt hit's last token again) is never written
            blocks[i] = self.scratch_block if u <= row.num_shared_blocks else tables[i, u - 1]
        return starts

    def pad(self, bucket: int, width: int, slot_map: np.ndarray | None = None) -> None:
        """Every row of a (bucket, width) step padding (what a capture runs on: its writes
        go to the scratch block)."""
        row = Row([self.scratch_block], 0, 1, num_shared_blocks=1)
        self.fill([row], [0], bucket, width, slot_map=slot_map)

    def _header_views(self) -> list[np.ndarray]:
        m = self.max_batch
        return [self._np[i * m : (i + 1) * m] for i in range(HEADER_FIELDS)]

    def step_batch(self, bucket: int, width: int, buffer: torch.Tensor) -> StepBatch:
        """The step batch of a (bucket, width) step over `buffer` (the device buffer, as a
        captured step takes it); built inside the step (its masks are device work on
        `context_lens`)."""
        contexts = self.header(4, buffer)[:bucket]
        tables = self.tables(bucket, width, buffer)
        batch = StaticStepBatch(
            write_blocks=self.header(2, buffer)[:bucket],
            write_offsets=self.header(3, buffer)[:bucket],
            prefills=[],
            num_tokens=bucket,
            decode_index=self.row_index[:bucket],
            decode_tables=tables,
            block_size=self.block_size,
            scratch_block=self.scratch_block,
            slot_map=self.slot_map(buffer),
            all_decode=True,
            context_lens=contexts,
            key_positions=self.key_positions[: width * self.block_size],
        )
        batch.decode_bias = batch.decode_reads(None).mask
        return batch


@dataclass
class StaticStepBatch(StepBatch):
    """A decode step's batch whose masks come from device tensors, not from Python rows:
    every row reads its whole table (from block 0), a window being a mask over it."""

    context_lens: torch.Tensor | None = None  # [B] long: row i attends keys [0, context)
    key_positions: torch.Tensor | None = None  # [width * block_size] long: 0, 1, 2, ...
    _reads: dict = field(default_factory=dict)

    def decode_reads(self, window: int | None) -> Reads:
        if window not in self._reads:
            self._reads[window] = Reads(self.decode_tables, self.key_positions.shape[0],
                                        self._bias(window))  # fmt: skip
        return self._reads[window]

    def _bias(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, width * block_size] float32: 0 where the row's query sees the key."""
        ends = self.context_lens.unsqueeze(1)  # the query sits at end - 1
        seen = self.key_positions.unsqueeze(0) < ends
        if window is not None:
            seen &= self.key_positions.unsqueeze(0) >= ends - window
        zero = torch.zeros((), device=seen.device)
        bias = torch.where(seen, zero, torch.full((), float("-inf"), device=seen.device))
        return bias[:, None, None, :]
