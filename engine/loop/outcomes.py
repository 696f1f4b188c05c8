"""How an engine's requests resolve: a step's sampled tokens, and a request that stops,
fails, is cancelled or gives way in a full queue.

Whichever way a request ends, the scheduler lets it go, its `on_done` (its metrics) runs
before its future resolves (whoever sees the result also sees it counted), and a finished
request's partly filled last block stays for the next turn.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from engine.loop.group import orphans, unreleased_leader
from engine.loop.logprobs import record_output, result_logprobs
from engine.loop.request import (
    GenerateResult,
    QueueFullError,
    Request,
    RequestCancelled,
    Sampler,
    StopChecker,
)

if TYPE_CHECKING:
    from engine.loop.scheduler import Scheduler
    from engine.model.loading import LoadedModel
    from kvstore.block_tables import BlockTables

log = logging.getLogger("kvstore.engine")


class Outcomes:
    """The ends of one engine's requests, on its scheduler and block tables; with
    `cache_generated` False a request's generated tokens are never kept."""

    def __init__(
        self,
        model: LoadedModel,
        scheduler: Scheduler,
        tables: BlockTables,
        cache_generated: bool,
    ):
        self.model = model
        self.scheduler = scheduler
        self.tables = tables
        self.cache_generated = cache_generated

    def started(self, request: Request) -> bool:
        """Mark a request's first step; False if its future was cancelled meanwhile."""
        if request.scheduled is not None:
            return True
        request.scheduled = time.perf_counter()
        if request.future.set_running_or_notify_cancel():
            return True
        self.scheduler.finish(request)
        for branch in orphans(request):
            self.fail(branch, RequestCancelled("its group was cancelled"))
        return False

    def sample(self, requests: list[Request], logits: torch.Tensor) -> None:
        """Each request's next token from its row of `logits` [len(requests), vocab]; a
        request it stops finishes; one that asks gets its token's logprobs. A group's leader
        whose prompt is now computed releases its group, whose other sequences sample their
        first token from its row."""
        requests, logits = self._with_branches(requests, logits)
        greedy = logits.argmax(dim=-1).tolist()
        for i, request in enumerate(requests):
            if request.sampler is None:
                request.sampler = Sampler(request.params)
            token = greedy[i] if request.params.temperature == 0 else request.sampler(logits[i])
            if request.params.logprobs is not None:  # before the token is emitted
                record_output(request, logits[i], token)
            if request.cumulative_logprob is not None:  # best_of's ranking
                request.cumulative_logprob += float(torch.log_softmax(logits[i], -1)[token])
            self.deliver(request, token)

    def deliver(self, request: Request, token: int) -> None:
        """A request's next token: emitted (a failing callback ends it), then its stop
        rules; one it stops finishes."""
        try:
            request.emit(token)
        except BaseException as e:  # a cancelled request or a failing callback
            self.fail(request, e)
            return
        done = self._stop(request)
        if done is not None:
            self._finish(request, *done)

    def _with_branches(
        self, requests: list[Request], logits: torch.Tensor
    ) -> tuple[list[Request], torch.Tensor]:
        """`requests` and `logits`, with the other sequences of groups released now and
        their leaders' rows (engine/loop/group.py): the last prompt position's logits."""
        branches, rows = [], []
        for i, request in enumerate(requests):
            group = unreleased_leader(request)
            if group is None or request.state is None:
                continue
            self.scheduler.release_group(group)
            for branch in list(group.waiting):
                if self.started(branch):  # (its future may have been cancelled)
                    branches.append(branch)
                    rows.append(i)
        if not branches:
            return requests, logits
        return requests + branches, torch.cat([logits, logits[rows]])

    def _stop(self, request: Request) -> tuple[str, str] | None:
        state = request.state  # None: a group's sequence at its first token, not admitted
        stop = None if state is None else state.stop
        if stop is None:
            stop = StopChecker(request.params, self.model.eos_token_ids, self.model.tokenizer)
            if state is not None:
                state.stop = stop
        return stop(request.output)

    def _finish(self, request: Request, reason: str, text: str) -> None:
        self._keep_tail(request)
        self.scheduler.finish(request)
        result = GenerateResult(
            prompt_tokens=len(request.token_ids),
            cached_tokens=request.reported_cached(request.num_cached_tokens),
            output_token_ids=list(request.output),
            text=text,
            ttft_s=request.first_token - request.scheduled,
            finish_reason=reason,
            cached_by_tier=request.cached_by_tier,
            queue_s=request.scheduled - request.arrival,
            **result_logprobs(request),
        )
        self.done(request, result)
        request.future.set_result(result)

    def _keep_tail(self, request: Request) -> None:
        """The finished request's partly filled last block stays for the next turn."""
        state = request.state
        if state is None:
            return
        limit = state.num_computed  # K/V is written up to here (the last token is not fed)
        if not self.cache_generated:
            limit = min(limit, len(request.token_ids))
        self.tables.keep_tail(state.blocks, request.token_slice(0, limit))

    def done(self, request: Request, result: GenerateResult | None) -> None:
        """The request's `on_done` (its metrics), before its future resolves. A failing
        callback is logged, never kept from the caller."""
        if request.on_done is not None:
            try:
                request.on_done(request, result)
            except Exception:
                log.exception("on_done of a request failed")

    def fail(self, request: Request, error: BaseException) -> None:
        """End a request with `error` (waiting or running), and a group leader's branches
        that never started with it."""
        self.scheduler.finish(request)
        future = request.future
        self.done(request, None)
        if not future.done() and (future.running() or future.set_running_or_notify_cancel()):
            future.set_exception(error)
        for branch in orphans(request):
            self.fail(branch, error)

    def dropped(self, request: Request) -> None:
        """A waiting request was cancelled: it ends, and so do a group leader's branches (a
        request that ran before, preempted since, fails: its future is running)."""
        if request.future.cancel():
            self.done(request, None)
        elif not request.future.done():
            self.fail(request, RequestCancelled("the client went away"))
        for branch in orphans(request):
            branch.cancelled = True
            self.fail(branch, RequestCancelled("its group was cancelled"))

    def displaced(self, requests: list[Request], bound: int | None) -> None:
        """A tenant over its share of a full queue gave way: its newest waiting requests
        fail with QueueFullError (429)."""
        for request in requests:
            request.displaced = True
            busy = f"{bound} requests are waiting, the most of them from its tenant"
            self.fail(request, QueueFullError(busy))
