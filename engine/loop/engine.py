"""The engine: continuous batching over the paged pool, on unchanged HF transformers models.

One loop thread runs steps. Each step the scheduler picks rows (decode tokens and prefill
chunks under a token budget), the runner does one forward over them with attention reading
K/V through the rows' block tables in the pool, each row that finished its tokens samples
one, full blocks are committed to the radix index in place, and finished requests resolve.
A model the paged attention hook cannot serve (its self-test fails) is served one request at
a time on the per-request path (`engine.loop.sequential`), which the log says once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

import torch

from engine.loop.accounting import check_blocks
from engine.loop.graph import GraphConfig
from engine.loop.group import SequenceGroup
from engine.loop.logprobs import PromptLogprobCache, check_logprobs
from engine.loop.outcomes import Outcomes
from engine.loop.overlap import DeviceTokens, Overlap
from engine.loop.prompt import prompt_ids
from engine.loop.request import (
    EngineClosedError,
    GenerateResult,
    InvalidRequestError,
    Prompt,
    Request,
    SamplingParams,
    TokenCallback,
)
from engine.loop.runner import PagedRunner
from engine.loop.scheduler import QueueStats, Scheduler
from engine.loop.scheduler_config import SchedulerConfig
from engine.loop.sequential import SequentialPath
from engine.loop.startup import cache_for, refuse_per_request, start_runner, unpaged_refusal
from engine.loop.step import Stepper
from engine.loop.sync_paths import PrefillResult, SyncPaths
from engine.loop.threads import LoopCalls, ThreadConfig, ThreadGovernor
from engine.model.linear import LinearConfig
from engine.model.loading import LoadedModel
from hashing import validate_salt
from kvstore.block_tables import BlockTables
from kvstore.config import CacheConfig
from kvstore.fleet.events import EventSink

log = logging.getLogger("kvstore.engine")
T = TypeVar("T")


class Engine:
    """Generates with prefix caching through one `PrefixCache` for the model's namespace."""

    def __init__(
        self,
        model: LoadedModel,
        cache_config: CacheConfig,
        cache_generated: bool = True,
        scheduler_config: SchedulerConfig | None = None,
        events: EventSink | None = None,
        linear_config: LinearConfig | None = None,
        prompt_logprob_blocks: int | None = None,
        thread_config: ThreadConfig | None = None,
        graph_config: GraphConfig | None = None,
    ):
        """`events` gets the device index's block events (kvstore/fleet/events.py);
        `linear_config` says how steps compute the model's linear layers
        (engine/model/linear.py); `prompt_logprob_blocks`: how many blocks' prompt
        logprobs are kept for requests that hit them (engine/loop/logprobs.py; None: its
        default); `thread_config` how many threads they run (engine/loop/threads.py);
        `graph_config` whether decode steps replay captured graphs (engine/loop/graph.py)."""
        self.model = model
        self.cache_config = cache_config
        self.cache_generated = cache_generated
        kernel = (linear_config or LinearConfig()).resolve(model.model)
        # the cache binds the config's codec and tenant salt into the namespace
        namespace = model.namespace(cache_config.block_size)
        self.cache = cache_for(model, cache_config, namespace, events)
        self.tables = BlockTables(self.cache)
        self.prompt_logprobs = PromptLogprobCache.of(cache_config, prompt_logprob_blocks)
        steps = scheduler_config or SchedulerConfig()
        self.scheduler = Scheduler(steps, self.tables, self.prompt_logprobs)
        self.sequential = SequentialPath(model, self.cache, cache_generated)
        self.outcomes = Outcomes(model, self.scheduler, self.tables, cache_generated)
        self.device_tokens = DeviceTokens(self.scheduler.config.max_num_seqs, model.device)
        self.overlap = Overlap(self.device_tokens, self.outcomes.deliver, self.outcomes.fail)
        self._forward_lock = threading.Lock()  # one forward pass at a time
        self._cond = threading.Condition()
        self._closed = False
        self._calls = LoopCalls(self._cond)  # synchronous paths, run on the loop thread
        self.thread_config = thread_config or ThreadConfig()
        self.graph_config = graph_config or GraphConfig()
        self.governor: ThreadGovernor | None = None  # the loop thread's, once it started
        # the runner starts (packs, self-tests) on the loop thread, which then runs every
        # step: one thread does the model's parallel work (engine/loop/threads.py)
        self.stepper: Stepper | None = None  # the loop's steps, once its runner started
        self.runner, self.fallback_reason = self._start_loop(kernel)
        paged, why = self.runner is not None, self.fallback_reason
        refusal = unpaged_refusal(self.cache.pool, paged, model.name, why)
        if refusal is not None:
            self.close()
            raise refusal
        self.sync = SyncPaths(
            runner=self.runner, tables=self.tables, sequential=self.sequential, calls=self._calls,
            forward_lock=self._forward_lock, refuse=self._refusal, encode=self.encode,
        )  # fmt: skip
        self._log_start()

    def _start_loop(self, kernel: str) -> tuple[PagedRunner | None, str | None]:
        """Start the loop thread; the runner it started, or None and why not."""
        started: Future = Future()
        threads = self.thread_config.threads or torch.get_num_threads()
        self._worker = threading.Thread(
            target=self._main, args=(started, threads, kernel), name="kvstore-engine", daemon=True
        )
        self._calls.thread = self._worker
        self._worker.start()
        try:
            return started.result()
        except BaseException:
            self.cache.close()  # its tier writer and stores
            raise

    def _log_start(self) -> None:
        """Say once what serves the model less well than it might: dense linear layers, or
        one request at a time."""
        note = None if self.runner is None else self.runner.linear_note
        if note is not None:
            log.warning("model %s: %s; its linear layers run dense", self.model.name, note)
        if self.runner is None:
            log.warning(
                "model %s: paged attention unavailable (%s); serving one request at a time",
                self.model.name,
                self.fallback_reason,
            )

    @property
    def linear_kernel(self) -> str:
        """`onednn` when the engine's work runs packed linears (engine/model/linear.py), else
        `dense` (asked, given way, or the per-request fallback: the model's own layers)."""
        return "onednn" if self.runner is not None and self.runner.linears is not None else "dense"

    @property
    def mode(self) -> str:
        """`paged` (continuous batching) or `sequential` (one request at a time)."""
        return "sequential" if self.runner is None else "paged"

    # --- requests -------------------------------------------------------------------------

    def encode(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Validated token ids of a prompt (text is tokenized with the model's tokenizer)."""
        return prompt_ids(self.model, prompt, params)

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str = "",
        on_token: TokenCallback | None = None,
        tenant: str = "",
    ) -> Future:
        """Queue one request; the future resolves to a `GenerateResult`.

        `cache_salt` narrows cache sharing to requests with the same salt. `on_token(id)` is
        called from the engine thread for each generated token, as soon as it is sampled; an
        exception it raises ends the request (the future gets it).
        Device blocks the request adds count against `tenant`'s quota (tenant_quota_blocks).
        """
        params = params or SamplingParams()
        ids = self.encode(prompt, params)
        request = Request(ids, params, cache_salt, tenant or None, on_token)
        return self.add_request(request).future

    def generate(
        self,
        prompts: str | Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        cache_salt: str = "",
    ) -> list[GenerateResult]:
        """Generate for each prompt (a str or a list of token ids); thread-safe."""
        params = params or SamplingParams()
        if isinstance(prompts, str):
            prompts = [prompts]
        if any(isinstance(p, int) for p in prompts):
            raise InvalidRequestError("prompts is a list of prompts; wrap token ids in a list")
        all_ids = [self.encode(prompt, params) for prompt in prompts]  # all valid before queueing
        requests = self.add_requests([Request(ids, params, cache_salt) for ids in all_ids])
        return [r.future.result() for r in requests]

    def add_request(self, request: Request, max_waiting: int | None = None) -> Request:
        """Queue a request with validated token ids; `QueueFullError` when `max_waiting`
        requests already wait."""
        return self.add_requests([request], max_waiting)[0]

    def add_requests(
        self, requests: list[Request], max_waiting: int | None = None
    ) -> list[Request]:
        """Queue requests at once (they can share their first step)."""
        for request in requests:
            check_logprobs(request.params, batched=self.runner is not None)
            try:
                validate_salt(request.cache_salt)
            except ValueError as e:
                raise InvalidRequestError(f"cache_salt: {e}") from None
            ids, salt = request.token_ids, request.cache_salt
            request.keys = self.cache.block_keys(ids, salt, request.keys)  # hashed once
            request.expected_cached_tokens = self.cache.peek(ids, salt, request.keys)
        displaced: list[Request | None] = []
        try:
            with self._cond:
                if self._closed:
                    raise EngineClosedError("engine is closed")
                for request in requests:
                    displaced.append(self.scheduler.add(request, max_waiting))
                self._cond.notify()
        finally:
            self.outcomes.displaced([r for r in displaced if r is not None], max_waiting)
        return requests

    def add_group(self, group: SequenceGroup, max_waiting: int | None = None) -> SequenceGroup:
        """Queue the sequences of one prompt as a unit (engine/loop/group.py): the leader
        now, the others once its prompt is computed. `InvalidRequestError` (field `n`) for a
        group that could never run at once. The per-request fallback runs them one by one."""
        if self.runner is None:
            self.add_requests(group.dissolve(), max_waiting)
            return group
        refusal = group.refusal(self.tables, self.scheduler.config.max_num_seqs)
        if refusal is not None:
            raise refusal
        self.add_requests([group.leader], max_waiting)
        return group

    def cancel(self, request: Request) -> None:
        """Stop a request: a waiting one is dropped, a running one ends before its next step."""
        request.cancelled = True
        with self._cond:
            dropped = self.scheduler.waiting.remove(request)
            self._cond.notify()
        if dropped:
            self.outcomes.dropped(request)

    def queue_stats(self) -> QueueStats:
        return self.scheduler.stats()

    @property
    def alive(self) -> bool:
        return self._worker.is_alive()

    # --- synchronous paths, on the loop thread (engine/loop/sync_paths.py) ------------------------

    def run(
        self,
        token_ids: list[int],
        params: SamplingParams,
        cache_salt: str = "",
        on_token: TokenCallback | None = None,
        tenant: str = "",
    ) -> GenerateResult:
        """One request, synchronously, on the per-request path (validated token ids)."""
        refuse_per_request(self.cache.pool)
        return self.sync.run(token_ids, params, cache_salt, on_token, tenant)

    def prefill(self, token_ids: list[int], cache_salt: str = "") -> PrefillResult:
        """Lookup, load and prefill of validated token ids; stores nothing."""
        return self.sync.prefill(token_ids, cache_salt)

    def prefill_logits(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, int]:
        """Last-position logits ([vocab], float32) and cached_tokens; stores the prompt's blocks."""
        return self.sync.prefill_logits(token_ids)

    def on_loop(self, function: Callable[[], T], step_kernels: bool = True) -> T:
        """`function()` on the loop thread, between steps (`SyncPaths.on_loop`)."""
        return self.sync.on_loop(function, step_kernels)

    def _refusal(self) -> EngineClosedError | None:
        return EngineClosedError("the engine is closed") if self._closed else None

    # --- the loop -------------------------------------------------------------------------

    def _idle(self) -> bool:
        scheduler = self.scheduler
        return scheduler.waiting.size == 0 and not scheduler.running and not scheduler.released

    def _main(self, started: Future, threads: int, kernel: str) -> None:
        """The loop thread: start the runner (`started` gets it, or the error), then loop."""
        try:
            torch.set_num_threads(threads)  # the creator's, not a new thread's default
            if self.model.device.type == "cuda":  # streams and events of the model's GPU
                torch.cuda.set_device(self.model.device)
            if self.model.device.type == "cpu":
                self.governor = ThreadGovernor(self.thread_config, threads)
            started_runner = start_runner(
                self.model, self.tables, kernel, self.cache.observe_prefill,
                self.graph_config, self.device_tokens.sampled,
            )  # fmt: skip
            runner = started_runner[0]
            if runner is not None:
                self.stepper = Stepper(
                    scheduler=self.scheduler, runner=runner, tables=self.tables,
                    outcomes=self.outcomes, overlap=self.overlap, cache=self.cache,
                    prompt_logprobs=self.prompt_logprobs, forward_lock=self._forward_lock,
                    cache_generated=self.cache_generated,
                )  # fmt: skip
            if self.governor is not None:  # sized by the load while the runner started
                self.governor.start()
            started.set_result(started_runner)
        except BaseException as e:
            started.set_exception(e)
            return
        try:
            self._loop()
        finally:  # however the loop ends, no synchronous call is left waiting on it
            with self._cond:
                self._closed = True
                self._calls.close(EngineClosedError("the engine's loop has stopped"))

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._idle() and not self._calls.pending:
                    self._cond.wait()
                calls = self._calls.take()
                if self._closed and self._idle() and not calls:
                    return
            if self.governor is not None:
                self.governor.tick()
            if calls:  # a synchronous path sees every token delivered
                self._guarded(self.overlap.drain)
            self._calls.run(calls)
            if not self._idle():
                self._guarded(self.stepper.step if self.stepper else self._serve_one)

    def _guarded(self, work: Callable[[], object]) -> None:
        """`work()`; a bug must not kill the loop silently: what ran fails with it."""
        try:
            work()
        except Exception:
            log.exception("engine step failed")
            released = [r for group in self.scheduler.released for r in group.waiting]
            for request in [*self.scheduler.running, *released]:
                self.outcomes.fail(request, RuntimeError("engine step failed"))

    def _serve_one(self) -> None:
        """The fallback: the next fair request runs alone, start to finish."""
        self.sequential.serve(self.scheduler.waiting.pop(), self.outcomes, self._forward_lock)

    # --- lifecycle ----------------------------------------------------------------------------

    def stats(self) -> dict:
        return self.cache.stats()

    def check_integrity(self) -> None:
        """The cache's invariants, and every block's references exactly its owners': the
        index, tails, the scratch block, running tables, lent blocks (engine/loop/
        accounting.py); AssertionError naming the first fault. Runs between steps."""
        self.on_loop(lambda: check_blocks(self.cache, self.scheduler, self._reserved()))

    def _reserved(self) -> set[int]:
        return set() if self.runner is None or self.runner.closed else {self.runner.scratch_block}

    def close(self, cancel_waiting: bool = False) -> None:
        """Stop accepting requests; finish the running ones (and the waiting ones, unless
        `cancel_waiting`: they fail with EngineClosedError); close the cache. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            waiting = self.scheduler.waiting.drain() if cancel_waiting else []
            self._cond.notify_all()
        for request in waiting:
            self.outcomes.fail(request, EngineClosedError("the server is shutting down"))
        self._worker.join()
        if self.runner is not None:
            self.runner.close()
            self.tables.release([self.runner.scratch_block])
        self.cache.tails.clear()  # nothing will go on from them: the pool holds no request's
        try:  # every block back where it belongs, or the log says which is not
            check_blocks(self.cache, self.scheduler, set())
        except AssertionError as e:
            log.error("block accounting at shutdown: %s", e)
        self.cache.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
