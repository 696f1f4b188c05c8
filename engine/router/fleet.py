"""The router's view of its replicas: liveness and load from each one's /health, blocks from
each one's KV events, and the choice of a replica for a request (kvstore/fleet/routing.py).

A replica's load is what it last reported plus the prompt tokens the router sent it since
that report was asked for (so a burst of requests between two reports does not all land on
the replica that looked idle).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from engine.api.errors import ApiError
from engine.api.roles import ROLES
from engine.router.config import RouterConfig
from hashing import BlockHash, BlockHasher, Namespace, as_token_array, combine_salts
from kvstore.fleet.events import SPILL_MEDIA, BlockSet, MediaBlocks
from kvstore.fleet.routing import (
    ReplicaLoad,
    RouteChoice,
    choose_replica,
    held_prefix,
    within_key_bound,
)

log = logging.getLogger("kvstore.router")
MAX_HASHERS = 1024  # salts whose hashers are kept
DOWN_AFTER_FAILURES = 2  # failed health reads in a row before a replica is dropped
SERVING = ("ok", "degraded")  # /health statuses that take requests (degraded: a tier is down)
PENDING_S = 5.0  # how long a routed prompt's blocks count as held before its events say so


@dataclass(eq=False)
class Replica:
    """One replica as the router knows it."""

    url: str
    alive: bool = False
    status: str = "unknown"  # its /health status: ok, degraded (serves), draining, ...
    reported: ReplicaLoad = field(default_factory=ReplicaLoad)
    sent: list[tuple[float, int]] = field(default_factory=list)  # (monotonic, tokens) unseen
    asked_at: float = 0.0  # when the last /health read that answered was sent (monotonic)
    answered_at: float = 0.0  # when its answer came
    # (prefilled_at, sent entry) of requests prefilled since that read was sent
    prefilled: list[tuple[float, tuple[float, int]]] = field(default_factory=list)
    routed: int = 0
    failures: int = 0
    pending: tuple[float, frozenset] = (0.0, frozenset())  # (monotonic, keys) last routed
    info: dict | None = None  # /health's "cache": block size, namespace, events ports (None: down)
    read_costs: dict[str, float] = field(default_factory=dict)  # medium -> its measured cost
    model: str | None = None  # the model name it serves (/health's "model")
    role: str = "both"  # its /health's "role" (engine/router/pairing.py)
    events: object | None = None  # its EventSubscriber, when it publishes events and is up

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname  # check_replica_url: there is one

    def load(self) -> ReplicaLoad:
        """The last report, less what was prefilled since it was asked, plus what was sent
        since (a chat's next turn, sent at once, must not see its own last turn as load).
        A request sent while the read was in flight may be in the report (the replica
        counts when it answers): once prefilled it is taken off too, or a slow read would
        show a replica's finished requests as its queue."""
        done = sum(n for _, (sent_at, n) in self.prefilled if sent_at < self.answered_at)
        queued = max(0, self.reported.queued_tokens - done)
        queued += sum(tokens for _, tokens in self.sent)
        return ReplicaLoad(queued, self.reported.running_tokens, self.routed)

    def report(self, asked_at: float, body: dict) -> None:
        """A /health answer to a read sent at `asked_at` (monotonic); TypeError or ValueError
        for a body that is not one."""
        if not isinstance(body, dict):
            raise TypeError(f"/health answered {type(body).__name__}, not an object")
        queued, running = body.get("queued_tokens", 0), body.get("running_tokens", 0)
        self.reported = ReplicaLoad(int(queued), int(running))
        self.sent = [(t, n) for t, n in self.sent if t >= asked_at]
        self.prefilled = [(t, e) for t, e in self.prefilled if t >= asked_at]
        self.asked_at, self.answered_at = asked_at, time.monotonic()
        self.status = str(body.get("status"))
        self.alive, self.failures = self.status in SERVING, 0
        if isinstance(body.get("model"), str):
            self.model = body["model"]
        self.role = body["role"] if body.get("role") in ROLES else "both"
        self.read_costs = measured_costs(body.get("read_costs"))


def measured_costs(value: object) -> dict[str, float]:
    """A /health's `read_costs` (medium -> a block's load as a fraction of computing it, as
    the replica's read gate measured it), keeping only well-formed entries."""
    if not isinstance(value, dict):
        return {}
    return {
        medium: float(cost)
        for medium, cost in value.items()
        if medium in SPILL_MEDIA
        and isinstance(cost, int | float)
        and not isinstance(cost, bool)
        and 0 <= cost <= 1
    }


class Fleet:
    """Replicas, their health loop, their events, and the routing decision."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.replicas = [Replica(url) for url in config.replicas]
        self._hashers: dict[str, BlockHasher] = {}
        self._namespace: Namespace | None = None
        self._next = 0  # round-robin position
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None
        self.shared: dict[str, BlockSet] = {}  # a shared tier's blocks, by its identity
        self.counts = {"cache_key": 0, "fallback": 0, "kv": 0, "round_robin": 0, "session": 0}

    # --- health ------------------------------------------------------------------------------

    async def start(self) -> None:
        timeout = httpx.Timeout(self.config.connect_timeout_s)
        self._client = httpx.AsyncClient(timeout=timeout)
        await asyncio.gather(*(self._poll(r) for r in self.replicas))
        self._task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for replica in self.replicas:
            if replica.events is not None:
                replica.events.close()
        if self._client is not None:
            await self._client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await asyncio.gather(*(self._poll(r) for r in self.replicas))

    async def _poll(self, replica: Replica) -> None:
        asked_at = time.monotonic()
        try:
            response = await self._client.get(f"{replica.url}/health")
            body = response.json()
            replica.report(asked_at, body)
        except Exception as e:  # whatever a replica answers, the loop goes on
            self.failed(replica, f"health: {type(e).__name__}")
            if not replica.alive:
                replica.status = "unreachable"
            return
        if replica.info is None and isinstance(body.get("cache"), dict):
            self._attach(replica, body["cache"])

    def check_model(self, name: str | None) -> None:
        """A 404 for a model no replica serves (known once some replica has answered its
        health read; the replicas answer for what is not known yet)."""
        served = sorted({r.model for r in self.replicas if r.model is not None})
        if name is not None and served and name not in served:
            names = ", ".join(repr(m) for m in served)
            raise ApiError(404, f"model {name!r} is not served here; the fleet serves {names}",
                           param="model", code="model_not_found")  # fmt: skip

    def failed(self, replica: Replica, why: str) -> None:
        """A failed health read or request: down after DOWN_AFTER_FAILURES in a row."""
        replica.failures += 1
        if replica.failures >= DOWN_AFTER_FAILURES:
            self._down(replica, why)

    def dead(self, replica: Replica, why: str) -> None:
        """A replica that refused a connection or broke one: down now."""
        replica.failures = DOWN_AFTER_FAILURES
        self._down(replica, why)

    def _down(self, replica: Replica, why: str) -> None:
        """Dropped from routing, and its blocks from the index: a replica that answers again
        is indexed afresh, by a replay of its events from the first (`_attach`)."""
        if replica.alive:
            log.warning("replica %s is down (%s): dropped until it answers again", replica.url, why)
        replica.alive = False
        events, replica.events, replica.info = replica.events, None, None
        if events is not None:  # its thread stops within ~50 ms: not on the event loop
            threading.Thread(target=events.close, name="kv-events-close", daemon=True).start()

    def _attach(self, replica: Replica, info: dict) -> None:
        """Its namespace (all replicas must share one) and its event stream."""
        replica.info = info  # read once: a mismatch below is logged once
        try:
            namespace = Namespace(**info["namespace"])
        except (KeyError, TypeError, ValueError) as e:
            log.error("replica %s: unreadable namespace (%s): while it is up, the fleet is "
                      "routed by load only", replica.url, e)  # fmt: skip
            return
        if self._namespace is None:
            self._namespace = namespace
        elif namespace != self._namespace:
            log.error("replica %s caches another namespace (model, dtype or block size) than "
                      "the others: while it is up, the fleet is routed by load only",
                      replica.url)  # fmt: skip
            return
        events = info.get("kv_events")
        if events and self.config.policy == "kv":
            replica.events = _subscribe(replica.host, events, self._shared_sets(info))

    def _shared_sets(self, info: dict) -> dict[str, BlockSet]:
        """The set of each spill medium the replica shares (by the identity its /health
        names): one set per identity, which every replica that reads the tier updates."""
        sets = {}
        for tier in info.get("tiers") or ():
            shared = tier.get("shared") if isinstance(tier, dict) else None
            if isinstance(shared, str) and tier.get("medium") in SPILL_MEDIA:
                sets[tier["medium"]] = self.shared.setdefault(shared, BlockSet())
        return sets

    # --- routing -------------------------------------------------------------------------------

    def hasher(self, salt: str) -> BlockHasher | None:
        if self._namespace is None:
            return None
        hasher = self._hashers.get(salt)
        if hasher is None:
            ns = self._namespace
            hasher = BlockHasher(ns.with_salt(combine_salts(ns.salt, salt)) if salt else ns)
            if len(self._hashers) >= MAX_HASHERS:
                self._hashers.pop(next(iter(self._hashers)))
            self._hashers[salt] = hasher
        return hasher

    def keys(self, token_ids: list[int], salt: str) -> list[BlockHash]:
        """Lookup keys of the prompt's whole blocks (a replica may use them all: it runs the
        last token again for its logits). ValueError for ids that are not token ids."""
        hasher = self.hasher(salt)
        if hasher is None:
            return []
        return hasher.hash_blocks(as_token_array(token_ids))

    def indexed(self, replica: Replica) -> int:
        """Device blocks the router counts for `replica`: its events' while it is up and
        they are fresh; 0 while it is down (they are dropped) or its events are stale."""
        held = self.blocks(replica) if replica.alive else None
        if isinstance(held, MediaBlocks):
            held = held.device
        return 0 if held is None else len(held)

    def tier_blocks(self, replica: Replica) -> dict[str, int]:
        """Blocks its spill tiers hold by its events, per medium (a shared tier's: every
        reader's), priced or not; empty while it is down or its events are stale."""
        held = self.blocks(replica) if replica.alive else None
        if held is None:
            return {}
        tiers = replica.events.media.tiers
        return {medium: len(blocks) for medium, blocks in sorted(tiers.items())}

    def blocks(self, replica: Replica) -> BlockSet | MediaBlocks | None:
        """Its blocks by its events (with its spill tiers', unless the router prices the
        device alone); None (stale) when they cannot be trusted now."""
        sub, now = replica.events, time.monotonic()
        if sub is None or sub.stale(now, self.config.stale_after_s):
            return None
        since, keys = replica.pending
        media = sub.media
        device = _WithPending(media.device, keys) if now - since < PENDING_S else media.device
        if not self.config.tier_events or not media.tiers:
            return device
        return MediaBlocks(device, media.tiers, media.shared)

    def choose(
        self, num_tokens: int, keys: list[BlockHash], exclude: Sequence[Replica] = ()
    ) -> tuple[Replica, RouteChoice | None]:
        """The replica for a prompt of `num_tokens` tokens whose whole blocks have the
        lookup keys `keys` (`keys()`), among the live ones not in `exclude`."""
        live = [i for i, r in enumerate(self.replicas) if r.alive and r not in exclude]
        if not live:
            raise NoReplicaError("no replica is up")
        if self.config.policy == "round-robin":
            self.counts["round_robin"] += 1
            return self._round_robin(live), None
        blocks = [self.blocks(r) for r in self.replicas]
        loads = [r.load() for r in self.replicas]
        bs = self._namespace.block_size if self._namespace else 1
        measured = [r.read_costs for r in self.replicas]
        config = self.config.routing
        choice = choose_replica(keys, num_tokens, bs, blocks, loads, config, live, measured)
        self.counts["fallback" if choice.fallback else "kv"] += 1
        return self.replicas[choice.replica], choice

    def takes_key(self, replica: Replica, exclude: Sequence[Replica] = ()) -> bool:
        """Whether `replica` may take its prompt_cache_key's next request: alive, not in
        `exclude`, and within `key_load_slack` of the least loaded live replica's load."""
        if not replica.alive or replica in exclude:
            return False
        live = [i for i, r in enumerate(self.replicas) if r.alive and r not in exclude]
        loads = [r.load() for r in self.replicas]
        return within_key_bound(self.replicas.index(replica), loads, live, self.config.routing)

    def cached_tokens(self, replica: Replica, num_tokens: int, keys: list[BlockHash]) -> int:
        """The prompt's tokens `replica` holds by its events (0 while they are stale); the
        last token is computed again."""
        held = self.blocks(replica)
        bs = self._namespace.block_size if self._namespace else 1
        if held is None:
            return 0
        cached = held_prefix(held, keys, self.config.routing, replica.read_costs)[0] * bs
        return min(cached, max(num_tokens - 1, 0))

    def _round_robin(self, live: list[int]) -> Replica:
        n = len(self.replicas)
        for step in range(n):
            i = (self._next + step) % n
            if i in live:
                self._next = i + 1
                return self.replicas[i]
        return self.replicas[live[0]]

    def sent(
        self, replica: Replica, num_tokens: int, keys: Sequence[BlockHash] = ()
    ) -> tuple[float, int]:
        """A request went to `replica`: `num_tokens` to prefill there, and its prompt's
        `keys` held there from now (its events follow within milliseconds). Returns its
        entry in the replica's unseen load, for `prefilled`."""
        replica.routed += 1
        now = time.monotonic()
        entry = (now, num_tokens)
        replica.sent.append(entry)
        replica.pending = (now, frozenset(keys))
        return entry

    @staticmethod
    def prefilled(replica: Replica, entry: tuple[float, int], queued: bool = True) -> None:
        """The request's first byte came back (`queued`), or it was refused there: either
        way its prompt is no longer queued there (a chat's next turn, sent at once, must not
        see its previous turn as load). A report asked after it was sent and before it was
        prefilled counted it queued: `load` takes it off that report."""
        replica.sent = [item for item in replica.sent if item is not entry]
        if queued and all(item is not entry for _, item in replica.prefilled):
            replica.prefilled.append((time.monotonic(), entry))


class _WithPending(BlockSet):
    """A replica's blocks by its events, plus the prompt last routed to it: a chat's next
    turn sent the moment its answer arrived can come before that turn's events do."""

    def __init__(self, seen: BlockSet, pending: frozenset):
        super().__init__()
        self.blocks, self.pending = seen.blocks, pending

    def __contains__(self, key: object) -> bool:
        return key in self.blocks or key in self.pending

    def num_prefix_blocks(self, keys: Sequence[BlockHash]) -> int:
        n = 0
        for key in keys:
            if key not in self.blocks and key not in self.pending:
                break
            n += 1
        return n


class NoReplicaError(RuntimeError):
    """No live replica can take the request (answered with 503)."""


def _subscribe(host: str, events: dict, shared: dict[str, BlockSet]) -> object:
    from engine.events.subscriber import EventSubscriber
    from engine.events.wire import zmq_host

    endpoint = f"tcp://{zmq_host(host)}:{events['port']}"
    replay = f"tcp://{zmq_host(host)}:{events['replay_port']}"
    subscriber = EventSubscriber(endpoint, replay, shared=shared)
    subscriber.start()
    return subscriber
