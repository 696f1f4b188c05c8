"""Replica fleets: N caches behind a router, replayed on one trace.

Each replica has its own device pool, host-memory and LMDB tiers (`bench.hitrate.tiers`);
the Redis tier is one set shared by all of them. Routes:

- `round-robin`: request r goes to replica r mod N;
- `session`: a session's first request goes to the least loaded replica (fewest requests
  routed so far, then the lowest index), and every later one follows it. No trace format
  here carries a session id, so sessions are derived from the prefix chains
  (`derive_sessions`);
- `prefix`: the replica whose device index holds the longest prefix of the request (probed
  with `RadixIndex.peek_prefix`, which changes no policy state), ties to the least loaded.

With one replica every route is the same replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from bench.hitrate.keysets import make_keyset
from bench.hitrate.tiers import BlockRequest, Replica, TierConfig, block_requests
from bench.traces import BlockTrace
from kvstore.policies import POLICIES

__all__ = ["ROUTES", "FleetConfig", "FleetResult", "derive_sessions", "replay_fleet"]

ROUTES = ("round-robin", "session", "prefix")
SHARED_TIERS = ("redis",)
UNSEEN, SHARED = -1, -2  # block owners that are not a session

Progress = Callable[[int], None]
OnRequest = Callable[[int, int, list[int]], None]  # (request, replica, hits per tier)
Router = Callable[[int, BlockRequest], int]


@dataclass(frozen=True)
class FleetConfig:
    """`replicas` caches of `tiers` each, evicting by `policy`, behind `route`."""

    tiers: TierConfig
    policy: str = "lru"
    replicas: int = 1
    route: str = "round-robin"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {list(POLICIES)}")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
            raise ValueError(f"replicas must be an int, got {self.replicas!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.route not in ROUTES:
            raise ValueError(f"unknown route {self.route!r}; choose from {ROUTES}")

    @property
    def total_blocks(self) -> int:
        """Blocks of every tier of the fleet: private tiers once per replica, shared once."""
        caps = self.tiers.capacities
        shared = sum(caps[t] for t in SHARED_TIERS if t in caps)
        return self.replicas * (sum(caps.values()) - shared) + shared


class FleetResult(NamedTuple):
    tier_block_hits: dict[str, int]  # block hits served by each tier
    routed: list[int]  # requests per replica


def derive_sessions(trace: BlockTrace) -> np.ndarray:
    """int64 [R]: a session id per request, from the prefix chains alone.

    Ids name whole prefix chains, so the blocks of a request seen before form a prefix of it.
    A request continues the session of its deepest seen block when that block (a) belongs to
    one session only and (b) ended an earlier request that no later request has extended:
    the next turn of a chat resends the previous prompt whole. Anything else starts a new
    session, and the seen blocks then count as shared (a system prompt, a document), so a
    shared prefix never merges two conversations.
    """
    owner = np.full(trace.num_unique, UNSEEN, dtype=np.int64)
    open_end = np.zeros(trace.num_unique, dtype=bool)  # ended a request, not extended since
    out = np.empty(trace.num_requests, dtype=np.int64)
    offsets, count = trace.offsets.tolist(), 0
    for r in range(trace.num_requests):
        ids = trace.blocks[offsets[r] : offsets[r + 1]]
        seen = int(np.count_nonzero(owner[ids] != UNSEEN))  # a prefix of ids
        last = int(ids[seen - 1]) if seen else -1
        session = int(owner[last]) if seen and open_end[last] else SHARED
        if session < 0:
            session, count = count, count + 1
        prefix = ids[:seen]
        owner[prefix[owner[prefix] != session]] = SHARED
        owner[ids[seen:]] = session
        if seen < len(ids) and seen:
            open_end[last] = False
        if len(ids):
            open_end[ids[-1]] = True
        out[r] = session
    return out


def _least_loaded(replicas: list[Replica], candidates: list[int] | None = None) -> int:
    pool = range(len(replicas)) if candidates is None else candidates
    return min(pool, key=lambda i: (replicas[i].routed, i))


def _session_router(sessions: np.ndarray, replicas: list[Replica]) -> Router:
    home = np.full(int(sessions.max()) + 1 if len(sessions) else 0, -1, dtype=np.int64)

    def route(r: int, req: BlockRequest) -> int:
        s = sessions[r]
        if home[s] < 0:
            home[s] = _least_loaded(replicas)
        return int(home[s])

    return route


def _prefix_router(replicas: list[Replica]) -> Router:
    def route(r: int, req: BlockRequest) -> int:
        held = [rep.index.peek_prefix(req.keys, req.tokens).num_blocks for rep in replicas]
        best = max(held)
        return _least_loaded(replicas, [i for i, h in enumerate(held) if h == best])

    return route


def make_router(
    route: str, trace: BlockTrace, replicas: list[Replica], sessions: np.ndarray | None = None
) -> Router:
    """The routing function of `route` (`sessions`: a session id per request, else derived)."""
    if len(replicas) == 1:
        return lambda r, req: 0
    if route == "round-robin":
        return lambda r, req: r % len(replicas)
    if route == "session":
        return _session_router(derive_sessions(trace) if sessions is None else sessions, replicas)
    if route == "prefix":
        return _prefix_router(replicas)
    raise ValueError(f"unknown route {route!r}; choose from {ROUTES}")


def make_replicas(config: FleetConfig, num_unique: int) -> list[Replica]:
    caps = config.tiers.capacities
    shared = {t: make_keyset(t, caps[t], num_unique) for t in SHARED_TIERS if t in caps}
    return [
        Replica(config.tiers, config.policy, num_unique, shared) for _ in range(config.replicas)
    ]


def replay_fleet(
    trace: BlockTrace,
    config: FleetConfig,
    progress: Progress | None = None,
    on_request: OnRequest | None = None,
) -> FleetResult:
    """Replay `trace` on the fleet; `on_request(r, replica, hits)` runs after request r."""
    replicas = make_replicas(config, trace.num_unique)
    route = make_router(config.route, trace, replicas)
    totals = [0] * len(config.tiers.tiers)
    offsets = trace.offsets
    for r, req in enumerate(block_requests(trace)):
        i = route(r, req)
        replicas[i].routed += 1
        hits = replicas[i].serve(req)
        totals = [a + b for a, b in zip(totals, hits, strict=True)]
        if on_request is not None:
            on_request(r, i, hits)
        if progress is not None and r & 0x3FF == 0:
            progress(int(offsets[r]))
    return FleetResult(
        dict(zip(config.tiers.tiers, totals, strict=True)), [p.routed for p in replicas]
    )
