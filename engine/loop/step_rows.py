"""One step's rows and what their forward returns: which rows sample, which gather every
position's logits, and the rows whose tier blocks were still loading when the forward ran
(kvstore/tiers/layered.py): the forward waits for each of their layers, and a row whose
blocks did not all verify is dropped from the step's results and computed again."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from engine.attention.step_row import Row
from engine.loop.request import Request
from engine.loop.scheduler import Scheduled
from kvstore.block_tables import BlockTables
from kvstore.tiers.layered import waits


class StepRows(NamedTuple):
    rows: list[Scheduled]
    fed: list[list[int]]  # the tokens each row feeds
    sample: list[int]  # rows that finish their tokens: their last position's logits, first
    full: list[int]  # rows gathering prompt logprobs: every fed position's logits, after

    @classmethod
    def of(cls, rows: list[Scheduled], wants: Callable[[Request, int], bool]) -> StepRows:
        """The rows' tokens, a pending one (still on the device: engine/loop/overlap.py)
        as a 0 the runner replaces."""
        fed = [_fed(row) for row in rows]
        sample = [
            i for i, row in enumerate(rows) if row.start + row.num_new == row.request.num_tokens
        ]
        full = [i for i, row in enumerate(rows) if wants(row.request, row.start)]
        return cls(rows, fed, sample, full)

    def forward_args(self, row: Callable[[Scheduled], Row]) -> tuple:
        """`PagedRunner.forward`'s arguments: the rows (`row` makes each), their tokens, the
        sampling and full rows, and the per-layer wait for blocks still loading."""
        pending = [r.request.state.blocks.pending for r in self.rows]
        wait = waits(p.load for p in pending if p is not None)
        return [row(r) for r in self.rows], self.fed, self.sample, self.full, wait

    def settle(
        self, tables: BlockTables, logits: torch.Tensor, retry: Callable[[Request], None]
    ) -> tuple[StepRows, torch.Tensor]:
        """Settle the rows' loads (`BlockTables.settle`). Returns the rows whose results
        stand and their logits (in `forward`'s order); each request whose load did not
        verify goes to `retry`: nothing it computed this step may be used."""
        failed = [
            i for i, row in enumerate(self.rows) if not tables.settle(row.request.state.blocks)
        ]
        if not failed:
            return self, logits
        kept = self._without(set(failed), logits)
        for i in failed:
            retry(self.rows[i].request)
        return kept

    def _without(self, drop: set[int], logits: torch.Tensor) -> tuple[StepRows, torch.Tensor]:
        keep = [i for i in range(len(self.rows)) if i not in drop]
        at = {old: new for new, old in enumerate(keep)}
        logit_rows = [j for j, i in enumerate(self.sample) if i not in drop]
        offset = len(self.sample)
        for i in self.full:
            n = self.rows[i].num_new
            if i not in drop:
                logit_rows.extend(range(offset, offset + n))
            offset += n
        kept = StepRows(
            [self.rows[i] for i in keep],
            [self.fed[i] for i in keep],
            [at[i] for i in self.sample if i not in drop],
            [at[i] for i in self.full if i not in drop],
        )
        return kept, logits[logit_rows]


def _fed(row: Scheduled) -> list[int]:
    tokens = row.request.token_slice(row.start, row.start + row.num_new)
    return tokens + [0] * (row.num_new - len(tokens))


def settle_early(
    rows: list[Scheduled], tables: BlockTables, retry: Callable[[Request], None], isolated: bool
) -> list[Scheduled]:
    """Settle before the forward the loads whose unverified bytes could reach another row's
    results (NaN under a mask is still NaN): every row's when the runner does not keep rows
    apart (`isolated` False: a step cache attends every key under a finite mask), else
    those of rows that write a cached block's position (the write goes to the scratch block,
    which decode rows read as padding). Returns the rows that stay; each whose load did not
    verify goes to `retry`."""
    kept = []
    for row in rows:
        blocks = row.request.state.blocks
        shared = row.start < blocks.num_shared_blocks * tables.block_size
        if blocks.pending is not None and (shared or not isolated) and not tables.settle(blocks):
            retry(row.request)
            continue
        kept.append(row)
    return kept
