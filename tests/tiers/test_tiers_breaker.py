"""CircuitBreaker state machine, driven by an explicit clock."""

from __future__ import annotations

import pytest

from kvstore.stores import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_only() -> None:
    breaker = CircuitBreaker(failures=3, cooldown_s=5.0, clock=Clock())
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # resets the run
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state == "closed" and breaker.allow()
    breaker.record_failure()
    assert breaker.state == "open" and not breaker.allow()
    assert breaker.times_opened == 1


def test_breaker_half_opens_after_cooldown_and_lets_one_probe_through() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failures=1, cooldown_s=5.0, clock=clock)
    breaker.record_failure()
    clock.now += 4.9
    assert not breaker.allow()
    clock.now += 0.1
    assert breaker.state == "half_open"
    assert breaker.allow()
    assert not breaker.allow()  # one probe at a time
    breaker.record_success()
    assert breaker.state == "closed" and breaker.allow() and breaker.allow()


def test_failed_probe_reopens_for_another_cooldown() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failures=2, cooldown_s=1.0, clock=clock)
    breaker.record_failure()
    breaker.record_failure()
    clock.now += 1.0
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state == "open" and not breaker.allow()
    assert breaker.times_opened == 2
    clock.now += 1.0
    assert breaker.allow()


def test_breaker_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="failures"):
        CircuitBreaker(failures=0)
    with pytest.raises(ValueError, match="cooldown_s"):
        CircuitBreaker(cooldown_s=0)


def test_each_state_change_is_one_warning_naming_the_tier(caplog) -> None:
    clock = Clock()
    breaker = CircuitBreaker(failures=2, cooldown_s=5.0, clock=clock, name="redis")
    with caplog.at_level("WARNING", logger="kvstore.tiers"):
        breaker.record_failure(ConnectionError("refused"))
        breaker.record_failure(ConnectionError("refused"))  # opens
        breaker.record_failure(ConnectionError("refused"))  # a straggler: still open
        assert not breaker.allow()
        clock.now += 5.0
        assert breaker.allow()  # half-open: the probe
        breaker.record_failure(TimeoutError("timed out"))  # open again
        clock.now += 5.0
        assert breaker.allow()
        breaker.record_success()  # closed
        breaker.record_success()  # no change, no warning
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "redis tier: circuit breaker open after 2 failures in a row (last: "
         "ConnectionError: refused): lookups miss the tier and writes to it are dropped for "
         "5 s, then one call probes it"),
        ("WARNING", "redis tier: circuit breaker half-open: one call probes the tier"),
        ("WARNING", "redis tier: circuit breaker open again: the probe failed (TimeoutError: "
         "timed out); next probe in 5 s"),
        ("WARNING", "redis tier: circuit breaker half-open: one call probes the tier"),
        ("WARNING", "redis tier: circuit breaker closed: the tier answers again"),
    ]  # fmt: skip
