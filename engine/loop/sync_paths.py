"""The engine's synchronous single-request paths: `run` (the per-request path), `prefill`
and `prefill_logits` (paged when the model is), and `on_loop` (a caller's own model work),
each handed to the loop thread and waited for (engine/loop/threads.py). An object `Engine` owns."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import torch

from engine.attention.step_row import blocks_row
from engine.loop.request import GenerateResult, Prompt, SamplingParams, TokenCallback
from kvstore.block_tables import SeqBlocks
from kvstore.tiers.layered import waits

if TYPE_CHECKING:
    from engine.loop.runner import PagedRunner
    from engine.loop.sequential import SequentialPath
    from engine.loop.threads import LoopCalls
    from kvstore.block_tables import BlockTables

T = TypeVar("T")


class PrefillResult(NamedTuple):
    logits: torch.Tensor  # [vocab] float32, last prompt position
    cached_tokens: int
    cached_by_tier: dict[str, int]


class PoolExhaustedError(RuntimeError):
    """The device pool cannot hold a synchronous prefill now (running requests hold it)."""


class SyncPaths:
    """An engine's synchronous paths, each handed to its loop thread and waited for. The
    engine owns it and gives it what they use: its runner (None: the per-request path
    only), block tables and per-request path, its loop's calls, the lock that keeps one
    forward at a time, why the loop takes no more calls (`refuse`) and how a prompt becomes
    validated token ids (`encode`)."""

    def __init__(
        self,
        runner: PagedRunner | None,
        tables: BlockTables,
        sequential: SequentialPath,
        calls: LoopCalls,
        forward_lock: threading.Lock,
        refuse: Callable[[], BaseException | None],
        encode: Callable[[Prompt, SamplingParams], list[int]],
    ):
        self.runner = runner
        self.tables = tables
        self.sequential = sequential
        self._calls = calls
        self._forward_lock = forward_lock
        self._refuse = refuse
        self._encode = encode

    def run(
        self,
        token_ids: list[int],
        params: SamplingParams,
        cache_salt: str = "",
        on_token: TokenCallback | None = None,
        tenant: str = "",
    ) -> GenerateResult:
        """One request, synchronously, on the per-request path (validated token ids), on the
        loop thread and its linear kernels."""

        def run() -> GenerateResult:
            with self._forward_lock:
                return self.sequential.run(token_ids, params, cache_salt, on_token, tenant)

        return self.on_loop(run)

    def prefill(self, token_ids: list[int], cache_salt: str = "") -> PrefillResult:
        """Lookup, load and prefill of the rest of validated token ids (the last token is always
        computed); stores nothing. Paged when the model is, else on a DynamicCache."""
        return self._prefill(token_ids, cache_salt, store=False)

    def prefill_logits(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, int]:
        """Last-position logits ([vocab], float32) and cached_tokens; stores the prompt's blocks."""
        ids = self._encode(list(token_ids), SamplingParams(max_new_tokens=1))
        pre = self._prefill(ids, "", store=True)
        return pre.logits, pre.cached_tokens

    def _prefill(self, ids: list[int], salt: str, store: bool) -> PrefillResult:
        return self._calls.call(lambda: self._prefill_here(ids, salt, store), self._refuse)

    def on_loop(self, function: Callable[[], T], step_kernels: bool = True) -> T:
        """`function()` on the engine's loop thread, between steps: model work of the
        caller's own (a reference, a benchmark's baseline) in the process's one OpenMP team
        (engine/loop/threads.py); with `step_kernels`, on the linear kernels of the engine's
        steps too (engine/model/linear.py), else on the model's own. The caller's grad and
        inference modes go with it. `function` must not wait on the engine (a request's
        result, `close`): the loop runs nothing else meanwhile."""
        packed = step_kernels and self.runner is not None
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

        def run() -> T:
            kernels = self.runner.linear_step() if packed else nullcontext()
            with torch.inference_mode(inference), torch.set_grad_enabled(grad), kernels:
                return function()

        return self._calls.call(run, self._refuse)

    def _prefill_here(self, ids: list[int], salt: str, store: bool) -> PrefillResult:
        if self.runner is None:
            with self._forward_lock, torch.inference_mode():
                pre = self.sequential.prefill(ids, salt)
                if store:
                    self.sequential.store(ids, [], pre, salt)
            return PrefillResult(
                logits=pre.logits,
                cached_tokens=pre.cached_tokens,
                cached_by_tier=pre.cached_by_tier,
            )
        for layered in (True, False):  # the second: tier blocks of the first did not verify
            seq = self.tables.open(ids, salt, "", whole_prompt=False, layered=layered)
            if not store:
                seq.commit_end = 0  # (nothing is committed: slides need not wait for a chunk)
            try:
                start = seq.num_cached_tokens
                logits = self._forward_here(seq, ids, start, store)
                if not self.tables.settle(seq):
                    continue
                if store:
                    self.tables.commit(seq, ids, len(ids))
                return PrefillResult(
                    logits=logits, cached_tokens=start, cached_by_tier=dict(seq.tier_tokens)
                )
            finally:
                self.tables.close(seq)
        raise RuntimeError("a lookup that loads whole left blocks unsettled")

    def _forward_here(
        self, seq: SeqBlocks, ids: list[int], start: int, store: bool
    ) -> torch.Tensor:
        """Last-position logits of ids[start:], in one forward outside the loop (no decode
        mirror: it would drop the loop's); a hybrid model's in the chunks its window slots
        hold, each committed (with `store`) before its window slides on."""
        pos = start
        while True:
            num_new = self.tables.fit(seq, len(ids), pos, len(ids) - pos)
            if num_new is None:
                raise PoolExhaustedError(f"the device pool cannot hold {len(ids)} tokens now")
            row = blocks_row(seq, pos, num_new, self.runner.scratch_block, identified=False)
            wait = waits([seq.pending.load] if seq.pending is not None else [])
            with self._forward_lock:
                logits = self.runner.forward([row], [ids[pos : pos + num_new]], [0], (), wait)[0]
            pos += num_new
            if pos == len(ids):
                return logits
            if store:
                self.tables.commit(seq, ids, pos)
            self.tables.slide(seq, pos)
