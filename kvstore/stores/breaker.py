"""Circuit breaker: stop calling a failing backend, probe it again after a cooldown."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    """Opens after `failures` consecutive failures; after `cooldown_s` lets one probe through
    (half-open); the probe's success closes it, its failure reopens it for another cooldown.

    Usage: `if breaker.allow(): try call; breaker.record_success() / record_failure()`.
    """

    def __init__(
        self,
        failures: int = 3,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not isinstance(failures, int) or failures < 1:
            raise ValueError(f"failures must be an int >= 1, got {failures!r}")
        if cooldown_s <= 0:
            raise ValueError(f"cooldown_s must be > 0, got {cooldown_s!r}")
        self.failures = failures
        self.cooldown_s = cooldown_s
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
            if self._state == OPEN:
                if self._clock() - self._opened_at < self.cooldown_s:
                    return False
                self._state = HALF_OPEN
            if self._probing:
                return False
            self._probing = True
            return True

    def record_success(self) -> None:
        with self._lock:
            self._state, self._consecutive, self._probing = CLOSED, 0, False

    def record_failure(self) -> None:
        with self._lock:
            self._consecutive += 1
            self._probing = False
            if self._state == HALF_OPEN or self._consecutive >= self.failures:
                if self._state != OPEN:
                    self.times_opened += 1
                self._state, self._opened_at = OPEN, self._clock()

    def reset(self) -> None:
        """Close the breaker and forget failures (tests, admin)."""
        self.record_success()
