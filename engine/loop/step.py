"""One continuous-batching step of the engine's loop: schedule rows, run one forward over
them, settle loads from the tiers, deliver the previous step's pending tokens, commit the
blocks the forward filled, and sample (on the device when the step allows:
engine/loop/overlap.py). `Engine` (engine/loop/engine.py) owns the loop thread and calls
`Stepper.step` while there is work."""

from __future__ import annotations

import threading
import time

import torch

from engine.attention.step_row import Row, blocks_row
from engine.loop.logprobs import PromptLogprobCache
from engine.loop.outcomes import Outcomes
from engine.loop.overlap import Overlap, runs_ahead
from engine.loop.request import RequestCancelled
from engine.loop.retain import retain_prompt
from engine.loop.runner import PagedRunner
from engine.loop.scheduler import Scheduled, Scheduler
from engine.loop.step_rows import StepRows, settle_early
from kvstore.block_tables import BlockTables
from kvstore.cache import PrefixCache


class Stepper:
    """The steps of one engine, over its scheduler, runner, tables and outcomes."""

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        runner: PagedRunner,
        tables: BlockTables,
        outcomes: Outcomes,
        overlap: Overlap,
        prompt_logprobs: PromptLogprobCache,
        cache: PrefixCache,
        forward_lock: threading.Lock,
        cache_generated: bool,
    ):
        self.scheduler, self.runner, self.tables = scheduler, runner, tables
        self.outcomes, self.overlap = outcomes, overlap
        self.prompt_logprobs, self.cache = prompt_logprobs, cache
        self.forward_lock = forward_lock
        self.cache_generated = cache_generated
        self.async_scheduling = bool(scheduler.config.async_scheduling)

    def step(self) -> None:
        for request in list(self.scheduler.running):
            if request.cancelled:
                self.outcomes.fail(request, RequestCancelled("the client went away"))
        scheduled = self.scheduler.schedule(self.outcomes.fail)
        rows = [row for row in scheduled if self.outcomes.started(row.request)]
        rows = settle_early(rows, self.tables, self.scheduler.retry, self.runner.isolates_rows)
        if not rows:  # nothing could be admitted now (all waiting on blocks or on tokens)
            if not self.overlap.drain():
                time.sleep(0.001)
            return
        step = StepRows.of(rows, self.prompt_logprobs.wants)
        feed = self.overlap.feed([row.request for row in rows])
        with self.forward_lock:
            logits = self.runner.forward(*step.forward_args(self._row), feed=feed)
        step, logits = step.settle(self.tables, logits, self.scheduler.retry)
        self.overlap.drain()  # the previous step's tokens, while this one runs
        self._sampled(step, logits)

    def _sampled(self, step: StepRows, logits: torch.Tensor) -> None:
        """After the forward: commit what it computed, then sample. Rows whose request
        ended on the token just delivered are dropped."""
        sample, rows = step.sample, step.rows
        self.prompt_logprobs.record_rows([rows[i] for i in step.full], logits[len(sample) :])
        for row in rows:
            if row.request.state is not None:
                self._computed(row)
        live = [j for j, i in enumerate(sample) if not rows[i].request.future.done()]
        requests = [rows[sample[j]].request for j in live]
        logits = logits[: len(sample)] if len(live) == len(sample) else logits[live]
        if not requests:
            return
        if self.async_scheduling and runs_ahead(requests, bool(step.full)):
            self.overlap.launch(requests, logits)
        else:
            self.outcomes.sample(requests, logits)

    def _row(self, row: Scheduled) -> Row:
        blocks = row.request.state.blocks
        return blocks_row(blocks, row.start, row.num_new, self.runner.scratch_block)

    def _computed(self, row: Scheduled) -> None:
        """K/V of the row's tokens is written: commit the blocks that became full."""
        state = row.request.state
        state.num_computed = row.start + row.num_new
        limit = state.num_computed
        if not self.cache_generated:
            limit = min(limit, len(row.request.token_ids))
            state.blocks.commit_end = len(row.request.token_ids)
        if limit // self.tables.block_size > state.blocks.num_committed:  # a block filled
            self.tables.commit(state.blocks, row.request.token_slice(0, limit), limit)
        self.tables.slide(state.blocks, state.num_computed)  # a window model's old blocks
        if row.request.retention:
            retain_prompt(self.cache, row.request, row.start, row.num_new)
