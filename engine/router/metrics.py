"""The router's /metrics (its own registry) and its replicas as /health shows them."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.router.affinity import CacheKeys
from engine.router.fleet import Fleet, Replica


class FleetCollector(Collector):
    """Per replica at each scrape: up, load, routed requests, indexed blocks; decisions and
    prompt_cache_key moves."""

    def __init__(self, fleet: Fleet, keys: CacheKeys):
        self.fleet, self.keys = fleet, keys

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "up": "1 when the replica answers its health reads",
            "queued_tokens": "prompt tokens waiting for prefill (reported + sent since)",
            "running_tokens": "KV tokens of running requests, as last reported",
            "indexed_blocks": "blocks its KV events say it holds (0: down, or events stale)",
        }
        families = {
            name: GaugeMetricFamily(f"kvstore_router_replica_{name}", text, labels=["replica"])
            for name, text in gauges.items()
        }
        routed = CounterMetricFamily("kvstore_router_routed", "requests routed", labels=["replica"])
        for replica in self.fleet.replicas:
            load = replica.load()
            indexed = self.fleet.indexed(replica)
            values = (replica.alive, load.queued_tokens, load.running_tokens, indexed)
            for family, value in zip(families.values(), values, strict=True):
                family.add_metric([replica.url], float(value))
            routed.add_metric([replica.url], replica.routed)
        yield from families.values()
        yield routed
        decisions = CounterMetricFamily(
            "kvstore_router_decisions", "routing decisions by how they were made", labels=["how"]
        )
        for how, value in sorted(self.fleet.counts.items()):
            decisions.add_metric([how], value)
        yield decisions
        yield self._key_moves()

    def _key_moves(self) -> Metric:
        moves = CounterMetricFamily(
            "kvstore_router_cache_key_moves",
            "requests with a known prompt_cache_key routed away from its replica (it is "
            "the new one): over the load bound, or down or failed",
            labels=["why"],
        )
        for why, value in self.keys.moves.items():
            moves.add_metric([why], value)
        return moves


class RouterMetrics:
    content_type = CONTENT_TYPE_PLAIN_0_0_4

    def __init__(self, fleet: Fleet, keys: CacheKeys):
        disable_created_metrics()
        self.fleet = fleet
        self.registry = CollectorRegistry()
        self.registry.register(FleetCollector(fleet, keys))
        self.retries = Counter(
            "kvstore_router_retries",
            "requests sent again after a replica failed before the first byte",
            registry=self.registry,
        )
        self.broken_streams = Counter(
            "kvstore_router_broken_streams",
            "streams a replica broke after the first byte (ended with an error event)",
            registry=self.registry,
        )
        self.predicted_cached = Counter(
            "kvstore_router_predicted_cached_tokens",
            "prompt tokens the chosen replica held by its events",
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def describe(self, replica: Replica) -> dict:
        load, sub = replica.load(), replica.events
        events = "none"
        if sub is not None:
            stale = sub.stale(time.monotonic(), self.fleet.config.stale_after_s)
            events = "stale" if stale else "fresh"
        return {
            "url": replica.url,
            "role": replica.role,
            "alive": replica.alive,
            "status": replica.status,
            "routed": replica.routed,
            "queued_tokens": load.queued_tokens,
            "running_tokens": load.running_tokens,
            "events": events,
            "indexed_blocks": self.fleet.indexed(replica),
            "indexed_tier_blocks": self.fleet.tier_blocks(replica),
        }
