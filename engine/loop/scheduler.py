"""Continuous batching: which requests run in the next step, and how many tokens each feeds.

Waiting requests are fair across tenants (round-robin, FIFO within a tenant) and bounded.
Each step, under a token budget: every running request feeds its next tokens (one when
decoding; a chunk of its prompt when prefilling, so a long prompt never stalls decodes), then
waiting requests are admitted while the budget, `max_num_seqs` and the pool allow. Admission
looks the prompt up (cached blocks enter the request's table by reference) and needs free or
evictable blocks for the rest of the prompt. When a running request cannot get a block, the
newest running request is preempted: its committed blocks stay cached, the rest return to the
pool, and it waits at the head of its tenant's queue to resume from the cache.

A group of sequences of one prompt (engine/loop/group.py) is admitted as one unit: its
leader only with room for every branch, the other branches together once the leader's
prompt is computed, before any waiting request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from engine.loop.group import SequenceGroup, branch_blocks
from engine.loop.logprobs import PromptLogprobCache
from engine.loop.request import (
    InvalidRequestError,
    Request,
    RequestCancelled,
    StopChecker,
)
from engine.loop.scheduler_config import SchedulerConfig
from engine.loop.wait_queue import WaitQueue
from kvstore.block_tables import BlockTables, SeqBlocks


@dataclass(eq=False)
class Running:
    """A request's engine state while admitted."""

    blocks: SeqBlocks
    num_computed: int  # leading tokens whose K/V is in the blocks
    stop: StopChecker | None = None


class Scheduled(NamedTuple):
    request: Request
    start: int  # first position fed
    num_new: int  # tokens fed this step


class _CachedKeys(NamedTuple):
    num_tokens: int
    keys: set[bytes]


class QueueStats(NamedTuple):
    waiting: int
    running: int
    waiting_by_tenant: dict[str | None, int]
    queued_tokens: int = 0  # prompt tokens to prefill (waiting: past its prefix when queued)
    running_tokens: int = 0  # K/V tokens held by running requests


def all_tokens(request: Request) -> list[int]:
    """The tokens whose K/V the request needs: prompt and output so far."""
    return request.token_slice(0, request.num_tokens)


class Scheduler:
    """Plans steps over `tables`; the engine loop is its only caller besides `add`/`stats`."""

    def __init__(
        self,
        config: SchedulerConfig,
        tables: BlockTables,
        prompt_logprobs: PromptLogprobCache | None = None,
    ):
        """`prompt_logprobs`: where requests that want prompt logprobs cut their lookups
        (engine/loop/logprobs.py); None: one that keeps no summaries."""
        self.config = config.for_device(tables.pool.device)
        self.tables = tables
        self.prompt_logprobs = prompt_logprobs or PromptLogprobCache(tables.block_size, 0)
        self.waiting = WaitQueue()
        self.running: list[Request] = []
        self.released: deque[SequenceGroup] = deque()  # groups whose branches go next

    def add(self, request: Request, bound: int | None = None) -> Request | None:
        """Queue `request`; returns a request displaced to make room (see WaitQueue.push)."""
        return self.waiting.push(request, bound)

    def stats(self) -> QueueStats:
        """Queue sizes and the work in them (read from any thread: lists are copied)."""
        waiting = self.waiting.candidates()
        queued = sum(len(r.token_ids) - r.expected_cached_tokens for r in waiting)
        held = 0
        for request in list(self.running):
            state = request.state
            if state is not None:
                held += state.num_computed
                queued += max(0, len(request.token_ids) - state.num_computed)
        by_tenant = self.waiting.by_tenant()
        return QueueStats(len(waiting), len(self.running), by_tenant, queued, held)

    def schedule(self, reject: Callable[[Request, BaseException], None]) -> list[Scheduled]:
        """The next step's rows: running requests first (oldest first), then admissions.
        `reject(request, error)` ends a waiting request that can never run."""
        budget, rows = self.config.max_num_batched_tokens, []
        for request in list(self.running):
            if budget == 0:
                break
            if request.state is None:  # preempted earlier in this loop
                continue
            row = self._continue(request, budget)
            if row is not None:
                rows.append(row)
                budget -= row.num_new
        while self.released and budget > 0:
            admitted = self._admit_branches(self.released[0], budget, reject)
            if admitted is None:
                return rows  # no room for them yet: every waiting request waits behind them
            self.released.popleft().return_lent(self.tables)
            rows += [row for row in admitted if row.num_new]
            budget -= sum(row.num_new for row in admitted)
        if self.released or not self.waiting.size:
            return rows
        pending = self._pending_keys()
        prefilling = any(row.num_new > 1 for row in rows)  # then a new prompt must fit whole
        for request in self.waiting.candidates():
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if request.num_pending:  # preempted with a token still on the device: next step
                break
            if request.cancelled or request.future.cancelled():
                self.waiting.remove(request)
                reject(request, RequestCancelled("cancelled while waiting"))
                continue
            if not pending.isdisjoint(self._keys(request)):
                continue  # another request is computing its blocks: it waits, then hits them
            row = self._admit(request, budget, reject, whole_only=prefilling)
            if row is None:
                break  # not now: later requests wait behind it
            if row.num_new:
                rows.append(row)
                budget -= row.num_new
                pending |= self._pending(request)
                prefilling |= row.num_new > 1
        return rows

    def _keys(self, request: Request) -> set[bytes]:
        """Lookup keys of the full blocks of a waiting request's tokens (kept while waiting)."""
        tokens = all_tokens(request)
        if request.key_set is None or request.key_set.num_tokens != len(tokens):
            request.key_set = _CachedKeys(len(tokens), set(self._extend_keys(request, tokens)))
        return request.key_set.keys

    def _extend_keys(self, request: Request, tokens: list[int]) -> list[bytes]:
        """The request's block keys (hashed when it was added), extended to `tokens`: its
        prompt and the output it had when preempted."""
        if len(request.keys) < len(tokens) // self.tables.block_size:
            request.keys = self.tables.keys_of(tokens, request.cache_salt, request.keys)
        return request.keys

    def _pending(self, request: Request) -> set[bytes]:
        """Keys of the prompt blocks a running request will still commit."""
        blocks, state = request.state.blocks, request.state
        if state.num_computed >= len(request.token_ids):
            return set()
        return set(blocks.keys[blocks.num_committed :])

    def _pending_keys(self) -> set[bytes]:
        pending: set[bytes] = set()
        for request in self.running:
            pending |= self._pending(request)
        return pending

    def _continue(self, request: Request, budget: int) -> Scheduled | None:
        """The request's next row (None: preempted, or nothing to feed: its pending token is
        its last, `max_new_tokens`)."""
        state: Running = request.state
        if request.num_pending and len(request.output) + 1 >= request.params.max_new_tokens:
            return None
        start = state.num_computed
        num_new = min(request.num_tokens - start, budget)
        while (fitted := self.tables.fit(state.blocks, start + num_new, start, num_new)) is None:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is request:
                return None
        return Scheduled(request, start, fitted)

    def preempt(self, request: Request, retry: bool = False) -> None:
        """Release a running request's blocks; it resumes from the cache later. `retry`:
        nothing it computed counts (tier blocks it read did not verify): it is admitted
        again as if for the first time, its cached tokens counted anew."""
        self.running.remove(request)
        self.tables.close(request.state.blocks)
        request.state = None
        request.num_preemptions += 0 if retry else 1
        self.waiting.push(request, front=True)

    def retry(self, request: Request) -> None:
        request.num_load_retries += 1  # its next lookup loads whole: it cannot fail twice
        self.preempt(request, retry=True)

    def _admit(
        self,
        request: Request,
        budget: int,
        reject: Callable[[Request, BaseException], None],
        whole_only: bool = False,
    ) -> Scheduled | None:
        """Admit a waiting request: its row, a row of no tokens if it was rejected, or None
        if the pool has no room for it now, or if `whole_only` (the step already prefills)
        and the rest of its prompt does not fit in `budget`."""
        tokens = all_tokens(request)
        if whole_only and len(tokens) - self._probe(request, tokens) > budget:
            return None
        need = self.tables.blocks_for(len(tokens) + 1)  # the prompt and a first decode slot
        if need > self.tables.pool.num_blocks - 1:
            self.waiting.remove(request)
            reject(request, _too_long(len(tokens), self.tables))
            return Scheduled(request, 0, 0)
        keys = self._extend_keys(request, tokens)
        blocks, start = self._open(request, tokens, keys)
        state = Running(blocks, start)
        num_new = min(len(tokens) - state.num_computed, budget)
        need += branch_blocks(request, self.tables)  # a group's leader: room for all
        room = self.tables.num_available() >= need - len(blocks.block_table)
        fitted = None
        if room or not self.running:  # every block of the prompt; a first step's worth of
            # a hybrid model's window parts
            fitted = self.tables.fit(blocks, len(tokens), state.num_computed, num_new)
        if fitted is None:
            self.tables.close(blocks)  # not now: it stays at the head of its queue
            return None
        num_new = fitted
        if not self.waiting.take(request):  # cancelled or displaced while it was looked up
            self.tables.close(blocks)
            return Scheduled(request, 0, 0)
        self._start(request, state)
        return Scheduled(request, state.num_computed, num_new)

    def _start(self, request: Request, state: Running) -> None:
        """An admitted request runs from `state`."""
        request.state = state
        self.running.append(request)
        if request.num_preemptions == 0:  # a whole-prompt hit counts every prompt token
            blocks = state.blocks
            request.num_cached_tokens = min(blocks.num_cached_tokens, len(request.token_ids))
            request.cached_by_tier = dict(blocks.tier_tokens)

    # --- groups (engine/loop/group.py) --------------------------------------------------------

    def release_group(self, group: SequenceGroup) -> None:
        """Its leader's prompt is computed (and committed): the other branches are admitted
        next, before any waiting request."""
        group.release(self.tables)
        self.released.append(group)

    def _admit_branches(
        self, group: SequenceGroup, budget: int, reject: Callable[[Request, BaseException], None]
    ) -> list[Scheduled] | None:
        """Admit a released group's branches together (all or none): their rows (a row may
        feed no token, when the budget ran out), or None when the batch or the pool cannot
        take them all now."""
        for request in [r for r in group.waiting if r.cancelled]:
            reject(request, RequestCancelled("cancelled while waiting"))  # (leaves `waiting`)
        branches = group.waiting
        if len(self.running) + len(branches) > self.config.max_num_seqs:
            return None
        if branches and not self._branches_fit(group):
            return None
        opened: list[tuple[Request, SeqBlocks]] = []
        try:  # a branch that fails to open leaves no table of the others open
            for request in branches:
                opened.append((request, self._open_branch(request, group)))
            states = [self._fit_branch(r, blocks, budget) for r, blocks in opened]
        except BaseException:
            for _, blocks in opened:
                self.tables.close(blocks)
            raise
        if any(state is None for state, _ in states):
            for _, blocks in opened:
                self.tables.close(blocks)
            return None
        rows = []
        for (request, _), (state, num_new) in zip(opened, states, strict=True):
            self._start(request, state)
            rows.append(Scheduled(request, state.num_computed, min(num_new, budget)))
            budget -= rows[-1].num_new
        group.waiting = []
        return rows

    def _branches_fit(self, group: SequenceGroup) -> bool:
        """A probe before any lookup: the pool can give each waiting branch its blocks past
        the prompt's cached ones (its prompt, first token and next decode slot)."""
        leader, bs = group.leader, self.tables.block_size
        prompt = leader.token_ids
        cached = self.tables.cache.peek(prompt, leader.cache_salt, leader.keys) // bs
        need = self.tables.blocks_for(len(prompt) + 2) - cached
        return self.tables.num_available() >= need * len(group.waiting)

    def _open_branch(self, request: Request, group: SequenceGroup) -> SeqBlocks:
        tokens = all_tokens(request)
        keys = self._extend_keys(request, tokens)
        salt, tenant = request.cache_salt, request.tenant or ""
        return self.tables.open(tokens, salt, tenant, keys=keys, lent=group.lent)

    def _fit_branch(
        self, request: Request, blocks: SeqBlocks, budget: int
    ) -> tuple[Running | None, int]:
        """A branch's state and the tokens its first row may feed (None: no room)."""
        num_tokens = request.num_tokens
        state = Running(blocks, min(blocks.num_cached_tokens, num_tokens - 1))
        num_new = max(1, min(num_tokens - state.num_computed, budget))
        fitted = self.tables.fit(blocks, num_tokens, state.num_computed, num_new)
        return (None, 0) if fitted is None else (state, fitted)

    def _probe(self, request: Request, tokens: list[int]) -> int:
        """The first position the request would feed, probed without a lookup (a request
        that waits is not counted a hit): past its device-pool prefix, as far as `_open`
        would look up."""
        keys = self._extend_keys(request, tokens)
        plan = self.prompt_logprobs.plan(request, keys)
        limit = len(tokens) if plan is None else plan.limit
        n = limit // self.tables.block_size
        cached = self.tables.cache.peek(tokens[:limit], request.cache_salt, keys[:n])
        return min(cached, len(tokens) - 1) if plan is None else max(cached - 1, 0)

    def _open(
        self, request: Request, tokens: list[int], keys: list[bytes]
    ) -> tuple[SeqBlocks, int]:
        """The request's block table from a lookup, and the first position to feed. A
        request gathering prompt logprobs looks up only the blocks whose logprobs it can
        have without their logits (engine/loop/logprobs.py)."""
        salt, tenant = request.cache_salt, request.tenant or ""
        plan = self.prompt_logprobs.plan(request, keys)
        if plan is None:
            layered = request.num_load_retries == 0
            blocks = self.tables.open(tokens, salt, tenant, keys=keys, layered=layered)
            return blocks, min(blocks.num_cached_tokens, len(tokens) - 1)
        n = plan.limit // self.tables.block_size
        blocks = self.tables.open(tokens[: plan.limit], salt, tenant, keys=keys[:n])
        # as a whole lookup's: every block's key (others wait for the blocks it computes),
        # and its prompt's length (what a window model keeps for a repeat)
        blocks.keys, blocks.num_prompt_tokens = list(keys), len(tokens)
        return blocks, self.prompt_logprobs.admitted(request, plan, blocks.num_cached_tokens)

    def finish(self, request: Request) -> None:
        """Take a finished (or failed) request out, running or waiting (preempted before its
        pending token ended it); its committed blocks stay cached."""
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if request.state is not None:
            self.tables.close(request.state.blocks)
            request.state = None
        group = request.group
        if group is not None and request in group.waiting:  # a group's, never admitted
            group.waiting.remove(request)


def _too_long(num_tokens: int, tables: BlockTables) -> BaseException:
    usable = (tables.pool.num_blocks - 1) * tables.block_size
    return InvalidRequestError(
        f"the request needs {num_tokens + 1} tokens of KV; the device pool holds {usable} "
        "(raise --device-blocks / --device-cache-gb or shorten the prompt)"
    )
