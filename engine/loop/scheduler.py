"""Continuous batching: which requests run in the next step, and how many tokens each feeds.

Waiting requests are fair across tenants (round-robin, FIFO within a tenant) and bounded.
Each step, under a token budget: every running request feeds its next tokens (one when
decoding; a chunk of its prompt when prefilling, so a long prompt never stalls decodes), then
waiting requests are admitted while the budget, `max_num_seqs` and the pool allow. Admission
looks the prompt up (cached blocks enter the request's table by reference) and needs free or
evictable blocks for the rest of the prompt. When a running request cannot get a block, the
newest running request is preempted: its committed blocks stay cached, the rest return to the
pool, and it waits at the head of its tenant's queue to resume from the cache.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from engine.loop.logprobs import PromptLogprobCache
from engine.loop.request import (
    InvalidRequestError,
    QueueFullError,
    Request,
    RequestCancelled,
    StopChecker,
)
from kvstore.block_tables import BlockTables, SeqBlocks

# Default tokens per step by device. On a CPU prefill costs the same per token in any batch
# (its matmuls are compute-bound past ~64 rows), so a larger step buys no throughput and only
# delays every token in it: under a burst, 256 lets prompts finish one after another (TTFT
# p50 of 8 simultaneous chat turns: 240 ms at 256, 400 ms at 512; docs/BENCHMARKS.md). An
# accelerator batches prefill nearly for free: 2048, as vLLM uses for online serving.
BATCHED_TOKENS_BY_DEVICE = {"cpu": 256}
BATCHED_TOKENS_ACCELERATOR = 2048


@dataclass(frozen=True)
class SchedulerConfig:
    """Step shape: tokens fed per step (all rows; None: by device) and requests running at
    once."""

    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 32

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if value is None and name == "max_num_batched_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    def for_device(self, device: torch.device) -> SchedulerConfig:
        """This config with the token budget set (the device's default when None)."""
        if self.max_num_batched_tokens is not None:
            return self
        budget = BATCHED_TOKENS_BY_DEVICE.get(device.type, BATCHED_TOKENS_ACCELERATOR)
        return replace(self, max_num_batched_tokens=budget)


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


class WaitQueue:
    """Per-tenant FIFO deques served round-robin; thread-safe."""

    def __init__(self) -> None:
        self._queues: dict[str | None, deque[Request]] = {}
        self._turns: deque[str | None] = deque()  # tenants with waiting requests, next first
        self._lock = threading.Lock()
        self.size = 0

    def push(
        self, request: Request, bound: int | None = None, front: bool = False
    ) -> Request | None:
        """Queue `request`. At the bound, a tenant holding at least two more waiting requests
        than this one's tenant gives up its newest never-started one, which is returned (the
        caller refuses it); otherwise QueueFullError. A flood thus fills its own share, and
        a quiet tenant still gets in."""
        with self._lock:
            displaced = None
            if bound is not None and self.size >= bound:
                displaced = self._displace(request.tenant)
                if displaced is None:
                    raise QueueFullError(f"{self.size} requests are waiting (the bound)")
            queue = self._queues.setdefault(request.tenant, deque())
            if not queue:
                (self._turns.appendleft if front else self._turns.append)(request.tenant)
            (queue.appendleft if front else queue.append)(request)
            self.size += 1
            return displaced

    def _displace(self, tenant: str | None) -> Request | None:
        """Take the newest never-started request of the tenant with the most waiting, if it
        holds at least 2 more than `tenant` (under the lock)."""
        mine = len(self._queues.get(tenant, ()))
        other = max(self._turns, key=lambda t: len(self._queues[t]), default=None)
        queue = self._queues.get(other)
        if other == tenant or queue is None or len(queue) < mine + 2:
            return None
        victim = next((r for r in reversed(queue) if r.scheduled is None), None)
        if victim is not None:
            queue.remove(victim)
            self.size -= 1
        return victim

    def candidates(self) -> list[Request]:
        """Every waiting request in the order they would be popped (round-robin)."""
        with self._lock:
            queues = [list(self._queues[tenant]) for tenant in self._turns]
        depth = max((len(q) for q in queues), default=0)
        return [q[i] for i in range(depth) for q in queues if i < len(q)]

    def take(self, request: Request) -> bool:
        """Pop `request` (a candidate): its tenant's turn goes to the back, as with `pop`.
        False if it left the queue meanwhile (cancelled, or displaced by `push`)."""
        with self._lock:
            queue = self._queues.get(request.tenant)
            if queue is None or request not in queue:
                return False
            queue.remove(request)
            self._turns.remove(request.tenant)
            if queue:
                self._turns.append(request.tenant)
            self.size -= 1
            return True

    def pop(self) -> Request:
        """The head of the tenant whose turn it is; that tenant goes to the back."""
        with self._lock:
            tenant = self._turns.popleft()
            queue = self._queues[tenant]
            request = queue.popleft()
            if queue:
                self._turns.append(tenant)
            self.size -= 1
            return request

    def remove(self, request: Request) -> bool:
        """Take a waiting request out of the queue; False if it is not waiting."""
        with self._lock:
            queue = self._queues.get(request.tenant)
            if queue is None or request not in queue:
                return False
            queue.remove(request)
            if not queue:
                self._turns.remove(request.tenant)
            self.size -= 1
            return True

    def drain(self) -> list[Request]:
        with self._lock:
            out = [r for tenant in self._turns for r in self._queues[tenant]]
            self._queues.clear()
            self._turns.clear()
            self.size = 0
            return out

    def by_tenant(self) -> dict[str | None, int]:
        with self._lock:
            return {t: len(q) for t, q in self._queues.items() if q}


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
        pending = self._pending_keys()
        prefilling = any(row.num_new > 1 for row in rows)  # then a new prompt must fit whole
        for request in self.waiting.candidates():
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
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
        state: Running = request.state
        start = state.num_computed
        num_new = min(request.num_tokens - start, budget)
        while (fitted := self.tables.fit(state.blocks, start + num_new, start, num_new)) is None:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is request:
                return None
        return Scheduled(request, start, fitted)

    def preempt(self, request: Request) -> None:
        """Release a running request's blocks; it resumes from the cache later."""
        self.running.remove(request)
        self.tables.close(request.state.blocks)
        request.state = None
        request.num_preemptions += 1
        self.waiting.push(request, front=True)

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
        request.state = state
        self.running.append(request)
        if request.num_preemptions == 0:  # a whole-prompt hit counts every prompt token
            request.num_cached_tokens = min(blocks.num_cached_tokens, len(request.token_ids))
            request.cached_by_tier = dict(blocks.tier_tokens)
        return Scheduled(request, state.num_computed, num_new)

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
            blocks = self.tables.open(tokens, salt, tenant, keys=keys)
            return blocks, min(blocks.num_cached_tokens, len(tokens) - 1)
        n = plan.limit // self.tables.block_size
        blocks = self.tables.open(tokens[: plan.limit], salt, tenant, keys=keys[:n])
        # as a whole lookup's: every block's key (others wait for the blocks it computes),
        # and its prompt's length (what a window model keeps for a repeat)
        blocks.keys, blocks.num_prompt_tokens = list(keys), len(tokens)
        return blocks, self.prompt_logprobs.admitted(request, plan, blocks.num_cached_tokens)

    def finish(self, request: Request) -> None:
        """Take a finished (or failed) running request out; its committed blocks stay cached."""
        if request in self.running:
            self.running.remove(request)
        if request.state is not None:
            self.tables.close(request.state.blocks)
            request.state = None


def _too_long(num_tokens: int, tables: BlockTables) -> BaseException:
    usable = (tables.pool.num_blocks - 1) * tables.block_size
    return InvalidRequestError(
        f"the request needs {num_tokens + 1} tokens of KV; the device pool holds {usable} "
        "(raise --device-blocks / --device-cache-gb or shorten the prompt)"
    )
