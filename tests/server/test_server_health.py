"""/health's status and tier states, from the tiers' stats (no server needed)."""

from __future__ import annotations

import logging

import pytest

from engine.server.health import ERROR_WINDOW_S, health, tier_state
from kvstore.stores.base import Counters


@pytest.mark.parametrize(
    ("stats", "state"),
    [
        ({"breaker_state": "open", "seconds_since_error": 0.1}, "down"),
        ({"breaker_state": "half_open", "seconds_since_error": 3.0}, "probing"),
        ({"breaker_state": "closed", "seconds_since_error": 0.1}, "ok"),
        ({"breaker_state": None, "seconds_since_error": 0.1}, "failing"),
        ({"breaker_state": None, "seconds_since_error": ERROR_WINDOW_S + 1}, "ok"),
        ({"breaker_state": None, "seconds_since_error": None}, "ok"),
    ],
)
def test_a_tier_state_follows_its_breaker_or_its_last_error(stats: dict, state: str) -> None:
    assert tier_state(stats) == state


def test_the_status_says_unavailable_then_draining_then_degraded_in_that_order() -> None:
    failing = {"lmdb": {"breaker_state": None, "seconds_since_error": 1.0, "errors": 4}}
    assert health(False, True, failing)[:2] == ("unavailable", 503)
    assert health(True, True, failing)[:2] == ("draining", 503)
    degraded = health(True, False, failing)
    assert degraded[:2] == ("degraded", 200)
    assert degraded.tiers == {
        "device": {"state": "ok"},
        "lmdb": {"state": "failing", "errors": 4, "seconds_since_error": 1.0},
    }
    assert health(True, False, {})[:2] == ("ok", 200)


def test_a_failing_tier_is_logged_once_per_spell_and_every_error_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counters = Counters("lmdb")
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers"):
        for _ in range(3):
            counters.error(OSError(28, "No space left on device"), dropped_writes=2)
    assert counters.snapshot()["errors"] == 3
    assert counters.snapshot()["dropped_writes"] == 6
    assert counters.seconds_since_error() is not None
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "tier lmdb is failing (OSError: [Errno 28] No space left on device): its reads are "
        "misses and its writes are dropped while it does"
    ]
