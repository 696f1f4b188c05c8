"""What GET /health tells a load balancer or the router: whether the replica serves, and the
state of each cache tier, so that a tier that is down shows here and not only on /metrics.

Status, in order of precedence:
- `unavailable` (503): the engine loop died;
- `draining` (503): SIGTERM arrived; in-flight requests finish, new ones get 503;
- `degraded` (200): it serves, but a spill tier is down or failing (its hits are misses);
- `ok` (200).
A tier with a circuit breaker (Redis) is `down` while it is open, `probing` while one call
tests it, else `ok`. A tier without one (LMDB, memory) is `failing` for `ERROR_WINDOW_S`
after its last error (a full disk shows here), else `ok`.
"""

from __future__ import annotations

from typing import NamedTuple

ERROR_WINDOW_S = 10.0
TIER_OK, TIER_DOWN, TIER_PROBING, TIER_FAILING = "ok", "down", "probing", "failing"
BREAKER_TO_STATE = {"open": TIER_DOWN, "half_open": TIER_PROBING}


class Health(NamedTuple):
    status: str
    http_status: int
    tiers: dict[str, dict]


def tier_state(stats: dict) -> str:
    """One spill tier's state from its `StoreStats` as a dict."""
    breaker = stats.get("breaker_state")
    if breaker is not None:
        return BREAKER_TO_STATE.get(breaker, TIER_OK)
    since = stats.get("seconds_since_error")
    return TIER_FAILING if since is not None and since < ERROR_WINDOW_S else TIER_OK


def tier_report(stats: dict) -> dict:
    report = {"state": tier_state(stats), "errors": stats.get("errors", 0)}
    if stats.get("breaker_state") is not None:
        report["breaker"] = stats["breaker_state"]
    if stats.get("seconds_since_error") is not None:
        report["seconds_since_error"] = round(stats["seconds_since_error"], 1)
    return report


def health(alive: bool, draining: bool, tier_stats: dict[str, dict]) -> Health:
    """The replica's status and its tiers (`device` is up while the engine is);
    `tier_stats`: each spill tier's `SpillStore.health()`."""
    tiers = {"device": {"state": TIER_OK if alive else TIER_DOWN}}
    tiers |= {name: tier_report(stats) for name, stats in tier_stats.items()}
    if not alive:
        return Health("unavailable", 503, tiers)
    if draining:
        return Health("draining", 503, tiers)
    degraded = any(t["state"] != TIER_OK for t in tiers.values())
    return Health("degraded" if degraded else "ok", 200, tiers)
