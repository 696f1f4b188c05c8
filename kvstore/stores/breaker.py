"""Circuit breaker: stop calling a failing backend, probe it again after a cooldown.

Every state change is logged as a warning on the `kvstore.tiers` logger: a tier that stops
answering turns its hits into misses, and the user must be told.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
log = logging.getLogger("kvstore.tiers")


def describe(error: BaseException | None) -> str:
    """One line naming an error: `ConnectionError: Error 111 connecting to ...`."""
    if error is None:
        return "unknown error"
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _failures(n: int) -> str:
    return "1 failure" if n == 1 else f"{n} failures"


class CircuitBreaker:
    """Opens after `failures` consecutive failures; after `cooldown_s` lets one probe through
    (half-open); the probe's success closes it, its failure reopens it for another cooldown.

    Usage: `if breaker.allow(): try call; breaker.record_success() / record_failure(error)`.
    `name` (the tier) prefixes the warnings logged at each state change.
    """

    def __init__(
        self,
        failures: int = 3,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        name: str = "tier",
    ):
        if not isinstance(failures, int) or failures < 1:
            raise ValueError(f"failures must be an int >= 1, got {failures!r}")
        if cooldown_s <= 0:
            raise ValueError(f"cooldown_s must be > 0, got {cooldown_s!r}")
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.name = name
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probing = False
        self.times_opened = 0

    @property
    def state(self) -> str:
        with self._lock:
            if self._state == OPEN and self._clock() - self._opened_at >= self.cooldown_s:
                return HALF_OPEN
            return self._state

    def allow(self) -> bool:
        """May a call go to the backend now? In half-open, only one probe at a time."""
        with self._lock:
            if self._state == CLOSED:
                return True
            change = None
            if self._state == OPEN:
                if self._clock() - self._opened_at < self.cooldown_s:
                    return False
                self._state = HALF_OPEN
                change = self._change(OPEN)
            allowed, self._probing = not self._probing, True
        self._warn(change)
        return allowed

    def record_success(self) -> None:
        with self._lock:
            before = self._state
            self._state, self._consecutive, self._probing = CLOSED, 0, False
            change = self._change(before)
        self._warn(change)

    def record_failure(self, error: BaseException | None = None) -> None:
        """One failed call; `error` (what failed) goes into the warning if this opens it."""
        change = None
        with self._lock:
            self._consecutive += 1
            self._probing = False
            if self._state == HALF_OPEN or self._consecutive >= self.failures:
                before = self._state
                if before != OPEN:
                    self.times_opened += 1
                self._state, self._opened_at = OPEN, self._clock()
                change = self._change(before, error)
        self._warn(change)

    def reset(self) -> None:
        """Close the breaker and forget failures (tests, admin)."""
        self.record_success()

    def _warn(self, change: str | None) -> None:
        if change is not None:
            log.warning("%s tier: %s", self.name, change)

    def _change(self, before: str, error: BaseException | None = None) -> str | None:
        """What to say about the change from `before` to the current state; None if none."""
        if before == self._state:
            return None
        cooldown = f"{self.cooldown_s:g} s"
        if self._state == CLOSED:
            return "circuit breaker closed: the tier answers again"
        if self._state == HALF_OPEN:
            return "circuit breaker half-open: one call probes the tier"
        if before == HALF_OPEN:
            return (
                f"circuit breaker open again: the probe failed ({describe(error)}); "
                f"next probe in {cooldown}"
            )
        return (
            f"circuit breaker open after {_failures(self._consecutive)} in a row "
            f"(last: {describe(error)}): lookups miss the tier and writes to it are dropped "
            f"for {cooldown}, then one call probes it"
        )
