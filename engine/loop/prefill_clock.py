"""PrefillClock: the seconds the engine's prefill forwards take, told to the cache's read gate
(kvstore/tiers/gate.py), which weighs each tier read against computing the same tokens.

On a CPU a forward has ended when it returns. On a GPU it has only been queued, and waiting
for it would add the sync per step the loop avoids, so a pair of CUDA events brackets it and
is read once the later one has completed (looked at when the next prefill is timed)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from kvstore.tiers.gate import MIN_PREFILL_TOKENS

Report = Callable[[int, float], None]  # (prompt tokens, seconds)
MAX_PENDING = 16  # GPU timings not read yet; older ones are dropped


class PrefillClock:
    def __init__(self, report: Report, device: torch.device):
        self.report, self.device = report, device
        self._pending: deque[tuple[int, torch.cuda.Event, torch.cuda.Event]] = deque()

    @contextmanager
    def timing(self, num_tokens: int) -> Iterator[None]:
        """Times the forward run in the block, which computes `num_tokens` prompt tokens
        (too few to say anything: not timed)."""
        if num_tokens < MIN_PREFILL_TOKENS:
            yield
            return
        if self.device.type != "cuda":
            start = time.perf_counter()
            yield
            self.report(num_tokens, time.perf_counter() - start)
            return
        self._read_done()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        self._pending.append((num_tokens, begin, end))
        if len(self._pending) > MAX_PENDING:
            self._pending.popleft()

    def _read_done(self) -> None:
        """Report the GPU timings whose forward has completed, oldest first."""
        while self._pending and self._pending[0][2].query():
            num_tokens, begin, end = self._pending.popleft()
            self.report(num_tokens, begin.elapsed_time(end) / 1e3)


def prompt_tokens(num_new: Sequence[int]) -> int:
    """The prefill tokens of a step's rows (a decode row feeds one token)."""
    return sum(n for n in num_new if n > 1)
