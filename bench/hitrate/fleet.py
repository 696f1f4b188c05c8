"""Replica fleets: N caches behind a router, replayed on one trace.

Each replica has its own device pool, host-memory and LMDB tiers (`bench.hitrate.tiers`);
the Redis tier is one set shared by all of them. Routes:

- `round-robin`: request r goes to replica r mod N;
- `session`: a session's first request goes to the least loaded replica (fewest requests
  routed so far, then the lowest index), and every later one follows it. No trace format
  here carries a session id, so sessions are derived from the prefix chains
  (`derive_sessions`);
- `kv`: the live router's choice, by its own code (`kvstore.fleet.routing.choose_replica`): the
  cheapest replica by the prefill the request needs there, each prefix block priced by the
  cheapest tier that holds it there, plus the replica's load. Each replica's device index
  and spill tiers publish their block events to a `BlockSet` per medium (`MediaBlocks`), as
  a replica's events reach the router, so the route never looks into an index or a tier;
  the shared Redis publishes to one set that counts for every replica. Loads come from the
  service model.

`prefix` (the longest device prefix, ties to the least loaded) was replaced by `kv`: every
prompt shares its first block with what the first replica holds, so it never tied and sent
a whole trace to one replica.

Service model (what the `kv` route sees as load). Requests arrive at the trace's timestamps,
and each replica serves its own one at a time, first come first served. A request's service
time on the replica it was routed to is

    prefill_ms_per_token * uncached prompt tokens + decode_ms_per_token * output tokens

where the uncached tokens are those no tier of that replica served. At a request's arrival
t, replica r reports `ReplicaLoad(queued_tokens, running_tokens, routed)`:

- `queued_tokens`: the uncached prompt tokens of r's requests not started by t;
- `running_tokens`: the prompt + output tokens of the request r serves at t (0 when idle);
- `routed`: the requests routed to r so far.

The default of 0.01 ms a prompt token is a fleet with headroom (docs/BENCHMARKS.md,
"Replicas and routes", sweeps it). Every route runs the service model, so every route
reports its mean wait. Simplifications: the cache is not timed (a request's blocks are
looked up and stored when it arrives, so a later request may hit blocks still being
prefilled), and a replica serves one request at a time where an engine batches.
`BlockTrace` carries no output lengths, so the command line's replays count every output
as 0 tokens (`replay_fleet` takes them).

With one replica every route is the same replay.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from bench.hitrate.keysets import make_keyset
from bench.hitrate.tiers import BlockRequest, Replica, TierConfig, block_requests
from bench.traces import BlockTrace
from kvstore.fleet.events import TIER_MEDIUM, BlockSet, MediaBlocks
from kvstore.fleet.routing import ReplicaLoad, RoutingConfig, choose_replica
from kvstore.index.policies import POLICIES

__all__ = [
    "ROUTES",
    "Fleet",
    "FleetConfig",
    "FleetResult",
    "ServiceModel",
    "ServiceQueue",
    "check_route",
    "derive_sessions",
    "make_fleet",
    "replay_fleet",
]

ROUTES = ("round-robin", "session", "kv")
REPLACED_ROUTES = {"prefix": "kv"}  # old name -> its replacement
SHARED_TIERS = ("redis",)
UNSEEN, SHARED = -1, -2  # block owners that are not a session

Progress = Callable[[int], None]
OnRequest = Callable[[int, int, list[int]], None]  # (request, replica, hits per tier)
Router = Callable[[int, BlockRequest], int]


def check_route(route: str) -> None:
    """Raise ValueError naming the routes unless `route` is one."""
    if route in REPLACED_ROUTES:
        raise ValueError(
            f"route {route!r} was replaced by {REPLACED_ROUTES[route]!r}, the live router's "
            "choice by cached prefix and load"
        )
    if route not in ROUTES:
        raise ValueError(f"unknown route {route!r}; choose from {ROUTES}")


def _non_negative(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class ServiceModel:
    """A replica's service time per request, in ms (module docstring)."""

    prefill_ms_per_token: float = 0.01  # 100,000 prompt tokens/s: a fleet with headroom
    # one request's decode shares its batch with the others', so by default it holds the
    # replica for no extra time; BlockTrace has no output lengths for it to multiply anyway
    decode_ms_per_token: float = 0.0

    def __post_init__(self) -> None:
        _non_negative(self.prefill_ms_per_token, "prefill_ms_per_token")
        _non_negative(self.decode_ms_per_token, "decode_ms_per_token")

    def service_ms(self, uncached_tokens: int, output_tokens: int) -> float:
        return (
            self.prefill_ms_per_token * uncached_tokens + self.decode_ms_per_token * output_tokens
        )


@dataclass(frozen=True)
class FleetConfig:
    """`replicas` caches of `tiers` each, evicting by `policy`, behind `route` (`routing`
    weighs the `kv` route's costs; `service` times every replica's requests)."""

    tiers: TierConfig
    policy: str = "lru"
    replicas: int = 1
    route: str = "round-robin"
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    service: ServiceModel = field(default_factory=ServiceModel)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {list(POLICIES)}")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
            raise ValueError(f"replicas must be an int, got {self.replicas!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        check_route(self.route)

    @property
    def total_blocks(self) -> int:
        """Blocks of every tier of the fleet: private tiers once per replica, shared once."""
        caps = self.tiers.capacities
        shared = sum(caps[t] for t in SHARED_TIERS if t in caps)
        return self.replicas * (sum(caps.values()) - shared) + shared


class FleetResult(NamedTuple):
    tier_block_hits: dict[str, int]  # block hits served by each tier
    routed: list[int]  # requests per replica
    mean_wait_ms: float = 0.0  # mean time from arrival to the start of service


# --- sessions ------------------------------------------------------------------------------
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


# --- service model -------------------------------------------------------------------------
class _Job(NamedTuple):
    start_ms: float
    end_ms: float
    prefill_tokens: int  # uncached prompt tokens
    kv_tokens: int  # prompt + output tokens


class ServiceQueue:
    """One replica's requests, served one at a time in arrival order."""

    def __init__(self) -> None:
        self._waiting: deque[_Job] = deque()  # not started, in start order
        self._running: _Job | None = None
        self._queued = 0  # prefill tokens of _waiting
        self._free_at = -math.inf  # when the last job added ends

    def add(self, now_ms: float, prefill_tokens: int, kv_tokens: int, service_ms: float) -> float:
        """Queue a request arriving at `now_ms`; returns its wait before service, in ms."""
        start = max(now_ms, self._free_at)
        self._free_at = start + service_ms
        self._waiting.append(_Job(start, self._free_at, prefill_tokens, kv_tokens))
        self._queued += prefill_tokens
        return start - now_ms

    def load(self, now_ms: float, routed: int) -> ReplicaLoad:
        """The load the replica reports at `now_ms` (module docstring)."""
        self._advance(now_ms)
        running = self._running.kv_tokens if self._running is not None else 0
        return ReplicaLoad(self._queued, running, routed)

    def _advance(self, now_ms: float) -> None:
        # jobs run back to back: each starts when the one before ends, or at its arrival
        while True:
            if self._running is not None and self._running.end_ms <= now_ms:
                self._running = None
            if self._running is not None or not self._waiting:
                return
            if self._waiting[0].start_ms > now_ms:
                return
            self._running = self._waiting.popleft()
            self._queued -= self._running.prefill_tokens


# --- routes --------------------------------------------------------------------------------
def _least_loaded(replicas: list[Replica]) -> int:
    return min(range(len(replicas)), key=lambda i: (replicas[i].routed, i))


def _session_router(sessions: np.ndarray, replicas: list[Replica]) -> Router:
    home = np.full(int(sessions.max()) + 1 if len(sessions) else 0, -1, dtype=np.int64)

    def route(r: int, req: BlockRequest) -> int:
        s = sessions[r]
        if home[s] < 0:
            home[s] = _least_loaded(replicas)
        return int(home[s])

    return route


def _kv_router(
    trace: BlockTrace,
    replicas: list[Replica],
    views: Sequence[MediaBlocks],
    queues: Sequence[ServiceQueue],
    config: RoutingConfig,
) -> Router:
    times, tokens = trace.timestamps.tolist(), trace.num_tokens.tolist()
    blocks, bt = list(views), trace.block_tokens

    def route(r: int, req: BlockRequest) -> int:
        loads = [q.load(times[r], p.routed) for q, p in zip(queues, replicas, strict=True)]
        return choose_replica(req.keys, tokens[r], bt, blocks, loads, config).replica

    return route


class Fleet(NamedTuple):
    """The replicas of one replay and what the router knows of them."""

    replicas: list[Replica]
    views: list[MediaBlocks]  # each replica's blocks by its events (kv route only, else [])
    queues: list[ServiceQueue]


def _views(config: FleetConfig) -> tuple[list[MediaBlocks], dict[str, BlockSet]]:
    """Each replica's blocks per medium, and the shared tiers' sets (in every view)."""
    names = [name for name, _ in config.tiers.spill]
    shared = {t: BlockSet() for t in SHARED_TIERS if t in names}
    views = []
    for _ in range(config.replicas):
        tiers = {TIER_MEDIUM[t]: shared[t] if t in shared else BlockSet() for t in names}
        views.append(MediaBlocks(BlockSet(), tiers))
    return views, shared


def make_fleet(config: FleetConfig, num_unique: int) -> Fleet:
    """The replicas (the shared tiers made once), their event views and service queues."""
    caps, n = config.tiers.capacities, config.replicas
    views, sinks = _views(config) if config.route == "kv" else ([], {})
    shared = {
        t: make_keyset(t, caps[t], num_unique, sinks.get(t)) for t in SHARED_TIERS if t in caps
    }
    replicas = []
    for i in range(n):
        view = views[i] if views else None
        device = view.device if view else None
        private = {t: view.tiers[TIER_MEDIUM[t]] for t, _ in config.tiers.spill} if view else None
        replicas.append(Replica(config.tiers, config.policy, num_unique, shared, device, private))
    return Fleet(replicas, views, [ServiceQueue() for _ in range(n)])


def make_replicas(config: FleetConfig, num_unique: int) -> list[Replica]:
    return make_fleet(config, num_unique).replicas


def make_router(
    config: FleetConfig, trace: BlockTrace, fleet: Fleet, sessions: np.ndarray | None = None
) -> Router:
    """The routing function of `config.route` (`sessions`: a session id per request, else
    derived from the trace)."""
    replicas = fleet.replicas
    if len(replicas) == 1:
        return lambda r, req: 0
    if config.route == "round-robin":
        return lambda r, req: r % len(replicas)
    if config.route == "session":
        return _session_router(derive_sessions(trace) if sessions is None else sessions, replicas)
    if config.route == "kv":
        return _kv_router(trace, replicas, fleet.views, fleet.queues, config.routing)
    raise ValueError(f"unknown route {config.route!r}; choose from {ROUTES}")


# --- replay --------------------------------------------------------------------------------
def _output_tokens(trace: BlockTrace, given: np.ndarray | None) -> list[int]:
    if given is None:
        return [0] * trace.num_requests
    if len(given) != trace.num_requests:
        raise ValueError(f"got {len(given)} output lengths for {trace.num_requests} requests")
    return [int(n) for n in given]


def replay_fleet(
    trace: BlockTrace,
    config: FleetConfig,
    progress: Progress | None = None,
    on_request: OnRequest | None = None,
    output_tokens: np.ndarray | None = None,
) -> FleetResult:
    """Replay `trace` on the fleet; `on_request(r, replica, hits)` runs after request r.
    `output_tokens` (one per request; default 0) feed the service model only."""
    fleet = make_fleet(config, trace.num_unique)
    route = make_router(config, trace, fleet)
    outputs = _output_tokens(trace, output_tokens)
    times, prompts, bt = trace.timestamps.tolist(), trace.num_tokens.tolist(), trace.block_tokens
    totals, wait = [0] * len(config.tiers.tiers), 0.0
    offsets = trace.offsets
    for r, req in enumerate(block_requests(trace)):
        i = route(r, req)
        replica = fleet.replicas[i]
        replica.routed += 1
        hits = replica.serve(req)
        totals = [a + b for a, b in zip(totals, hits, strict=True)]
        uncached = prompts[r] - sum(hits) * bt
        service = config.service.service_ms(uncached, outputs[r])
        wait += fleet.queues[i].add(times[r], uncached, prompts[r] + outputs[r], service)
        if on_request is not None:
            on_request(r, i, hits)
        if progress is not None and r & 0x3FF == 0:
            progress(int(offsets[r]))
    return FleetResult(
        dict(zip(config.tiers.tiers, totals, strict=True)),
        [p.routed for p in fleet.replicas],
        wait / trace.num_requests if trace.num_requests else 0.0,
    )
