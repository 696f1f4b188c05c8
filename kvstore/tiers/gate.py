"""The read gate: a lookup reads a spill tier only when fetching its blocks beats computing
their tokens again.

Both sides are measured, never configured: a tier's effective bandwidth (payload bytes over
the seconds its whole reads took: the round trip, the copy and the verification) and the
engine's prefill throughput (prompt tokens over the seconds its prefill forwards took). Each
figure is the median of the last `WINDOW` observations: one slow read on a busy machine
moves nothing, a tier that stays slow is seen as slow within three reads.

Reading `n` blocks costs `n x bytes_per_block / bandwidth`, computing them `n x block_size /
tokens_per_s`. A tier is skipped only when the read is predicted to cost `MIN_LOSS_S` more
than the compute: a tier about as fast as the model stays read (it keeps the device warm for
the next turn), and a lookup too small to matter is never refused. A tier nothing has
measured yet is read (that measures it), and so is one skipped for `reprobe_s` (a tier that
sped up is seen again). Skipping never changes an output: the skipped tokens are computed,
as on a miss."""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

from kvstore.metrics import CacheMetrics

WINDOW = 5  # observations a figure is the median of
MIN_LOSS_S = 0.002  # a read predicted to lose less than this to computing is still made
MIN_PREFILL_TOKENS = 64  # smaller prefills are mostly fixed cost: they would understate it


class Rate:
    """The median of the last WINDOW observed rates (amount / seconds)."""

    def __init__(self) -> None:
        self._rates: deque[float] = deque(maxlen=WINDOW)

    def observe(self, amount: float, seconds: float) -> None:
        self._rates.append(amount / seconds)

    @property
    def value(self) -> float | None:
        """Amount per second; None before anything was observed."""
        return statistics.median(self._rates) if self._rates else None


class ReadGate:
    """Per tier: read it, or compute its blocks' tokens instead (thread-safe)."""

    def __init__(
        self,
        bytes_per_block: int,
        block_size: int,
        metrics: CacheMetrics,
        enabled: bool = True,
        reprobe_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.bytes_per_block, self.block_size = bytes_per_block, block_size
        self.metrics, self.enabled, self.reprobe_s, self.clock = metrics, enabled, reprobe_s, clock
        self._lock = threading.Lock()
        self._prefill = Rate()  # tokens per second
        self._tiers: dict[str, Rate] = {}  # payload bytes per second
        self._last_read: dict[str, float] = {}  # the clock when a tier was last read

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A prefill forward computed `num_tokens` prompt tokens in `seconds`."""
        if num_tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            with self._lock:
                self._prefill.observe(num_tokens, seconds)

    def observe_read(self, tier: str, num_blocks: int, seconds: float) -> None:
        """A whole read of `num_blocks` blocks from `tier` took `seconds`."""
        if num_blocks > 0 and seconds > 0:
            with self._lock:
                self._tiers.setdefault(tier, Rate()).observe(
                    num_blocks * self.bytes_per_block, seconds
                )

    def allows(self, tier: str, num_blocks: int) -> bool:
        """Whether to read up to `num_blocks` blocks of `tier` now (the read is then
        expected to be observed)."""
        with self._lock:
            now = self.clock()
            if self.enabled and self._loses(tier, num_blocks) and not self._due(tier, now):
                return False
            self._last_read[tier] = now
            return True

    def skipped(self, tier: str, num_blocks: int) -> None:
        """A lookup computed `num_blocks` blocks `tier` held instead of reading them."""
        self.metrics.inc("tier_read_skipped_total", tier=tier)
        self.metrics.inc("tier_read_skipped_blocks_total", num_blocks, tier=tier)

    def _loses(self, tier: str, num_blocks: int) -> bool:
        """Reading the blocks is predicted to take MIN_LOSS_S longer than computing them
        (False while either side is unmeasured; under the lock)."""
        rate, tokens_per_s = self._tiers.get(tier), self._prefill.value
        bandwidth = rate.value if rate is not None else None
        if bandwidth is None or tokens_per_s is None:
            return False
        fetch = num_blocks * self.bytes_per_block / bandwidth
        return fetch - num_blocks * self.block_size / tokens_per_s > MIN_LOSS_S

    def _due(self, tier: str, now: float) -> bool:
        """The tier was last read `reprobe_s` ago or more: read it again to measure it."""
        return now - self._last_read.get(tier, now) >= self.reprobe_s

    def snapshot(self) -> dict:
        """The figures the decisions use: prefill tokens/s, each tier's bytes/s (None: not
        measured yet), and per block the seconds each costs."""
        with self._lock:
            tokens_per_s = self._prefill.value
            bandwidth = {tier: rate.value for tier, rate in self._tiers.items()}
        compute = None if tokens_per_s is None else self.block_size / tokens_per_s
        fetch = {t: None if b is None else self.bytes_per_block / b for t, b in bandwidth.items()}
        return {
            "enabled": self.enabled,
            "prefill_tokens_per_s": tokens_per_s,
            "bandwidth_bytes_per_s": bandwidth,
            "block_compute_s": compute,
            "block_fetch_s": fetch,
        }
