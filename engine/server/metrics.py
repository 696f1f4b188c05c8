"""/metrics, rendered by prometheus_client: the cache's counters and the server's own.

The cache's counter families are declared in `kvstore.metrics` (the cache layer does not
depend on prometheus_client); `EngineCollector` exports them at each scrape from
`PrefixCache.stats()`, with the device pool, the spill stores (breaker state included) and
the scheduler's queue. `ServerMetrics` counts request outcomes, refusals and per-tenant
tokens and times TTFT and queue waits. Each server has its own registry: several servers
can run in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.loop.request import GenerateResult, Request
from engine.loop.scheduler import QueueStats
from kvstore.metrics import CACHE_FAMILIES, PREFIX

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0)  # fmt: skip
BREAKER_STATES = ("closed", "open", "half_open")
STORE_COUNTERS = ("hits", "misses", "writes", "evictions", "verify_failures", "dropped_writes",
                  "errors", "foreign")  # fmt: skip
STORE_GAUGES = ("entries", "bytes", "capacity_bytes", "retained")
RETENTION_COUNTERS = (  # stats()["retention"] field, metric name, help
    ("expired_blocks_total", "kvstore_retention_expired_blocks_total",
     "device blocks whose retention ran out"),
    ("forced_blocks_total", "kvstore_retention_forced_evictions_blocks_total",
     "retained device blocks evicted before their TTL (nothing unretained was left)"),
    ("deferred_evictions_total", "kvstore_retention_deferred_evictions_total",
     "evictions that took an unretained block while retained ones waited"),
)  # fmt: skip
SERVER_COUNTERS = (  # name, help, label
    ("kvstore_requests_total", "finished requests by outcome (ok, error, cancelled)", "outcome"),
    ("kvstore_requests_rejected_total", "requests refused before queueing, by reason", "reason"),
    ("kvstore_tenant_prompt_tokens_total", "prompt tokens of finished requests, by tenant",
     "tenant"),
    ("kvstore_tenant_cached_tokens_total", "prompt tokens served from cache, by tenant", "tenant"),
    ("kvstore_tenant_completion_tokens_total", "generated tokens, by tenant", "tenant"),
)  # fmt: skip


def cache_counters(counters: dict, spill_tiers: list[str]) -> Iterator[Metric]:
    """The `kvstore.metrics` families, with a 0 series for each tier not counted yet."""
    for family in CACHE_FAMILIES:
        metric = CounterMetricFamily(PREFIX + family.name, family.help, labels=family.labels)
        values = dict.fromkeys(family.zero_series(spill_tiers), 0)
        values |= counters.get(family.name, {})
        for label_values, value in sorted(values.items()):
            metric.add_metric(label_values, value)
        yield metric


def device_blocks(device: dict[str, int]) -> Metric:
    metric = GaugeMetricFamily(
        "kvstore_device_blocks", "device pool blocks by state", labels=["state"]
    )
    for key, value in sorted(device.items()):
        metric.add_metric([key.removeprefix("blocks_")], value)
    return metric


def store_families(tiers: dict[str, dict]) -> Iterator[Metric]:
    """Each spill store's own counters and gauges (a gauge only where the store can tell)."""
    for field in STORE_COUNTERS:
        help_text = f"spill store {field.replace('_', ' ')}"
        metric = CounterMetricFamily(f"kvstore_store_{field}_total", help_text, labels=["tier"])
        for tier, stats in tiers.items():
            metric.add_metric([tier], stats[field])
        yield metric
    for field in STORE_GAUGES:
        help_text = f"spill store {field.replace('_', ' ')}"
        metric = GaugeMetricFamily(f"kvstore_store_{field}", help_text, labels=["tier"])
        for tier, stats in tiers.items():
            if stats[field] is not None:
                metric.add_metric([tier], stats[field])
        yield metric


def breaker_state(tiers: dict[str, dict]) -> Metric:
    """1 for each breaker's current state, 0 for the others (labels sorted: state, tier)."""
    help_text = "circuit breaker state (1 = current)"
    metric = GaugeMetricFamily("kvstore_tier_breaker_state", help_text, labels=["state", "tier"])
    for tier, stats in tiers.items():
        if stats.get("breaker_state") is not None:
            for state in BREAKER_STATES:
                metric.add_metric([state, tier], int(stats["breaker_state"] == state))
    return metric


def retention_families(retention: dict) -> Iterator[Metric]:
    """Device blocks retained now per tenant, and retention's counters."""
    help_text = "device blocks retained by clients, by tenant"
    metric = GaugeMetricFamily("kvstore_retained_blocks", help_text, labels=["tenant"])
    for tenant, blocks in sorted(retention.get("blocks_by_tenant", {}).items()):
        metric.add_metric([tenant], blocks)
    yield metric
    for field, name, help_text in RETENTION_COUNTERS:
        yield CounterMetricFamily(name, help_text, value=retention.get(field, 0))


def read_gate_gauges(gate: dict | None) -> Iterator[Metric]:
    """What the read gate weighs (kvstore/tiers/gate.py): the engine's measured prefill
    throughput and each tier's measured read bandwidth (absent until measured)."""
    if gate is None:
        return
    help_text = "prompt tokens per second of the engine's prefill forwards (moving figure)"
    metric = GaugeMetricFamily("kvstore_prefill_tokens_per_second", help_text)
    if gate["prefill_tokens_per_s"] is not None:
        metric.add_metric([], gate["prefill_tokens_per_s"])
    yield metric
    help_text = "payload bytes per second of a tier's whole reads: round trip, copy, checks"
    metric = GaugeMetricFamily("kvstore_tier_read_bytes_per_second", help_text, labels=["tier"])
    for tier, value in sorted(gate["bandwidth_bytes_per_s"].items()):
        if value is not None:
            metric.add_metric([tier], value)
    yield metric


def capacity_gauges(capacity: dict[str, dict[str, float]]) -> Iterator[Metric]:
    """Per tier (device included), a block's bytes there and blocks per GB (1e9 bytes)."""
    for name, key, help_text in (
        ("kvstore_tier_block_bytes", "bytes_per_block", "bytes a KV block takes in a tier "
         "(a spill tier's under its codec, entry header included)"),
        ("kvstore_tier_blocks_per_gb", "blocks_per_gb", "KV blocks a tier holds per GB"),
    ):  # fmt: skip
        metric = GaugeMetricFamily(name, help_text, labels=["tier"])
        for tier, figures in capacity.items():
            metric.add_metric([tier], figures[key])
        yield metric


def queue_gauges(queue: QueueStats) -> Iterator[Metric]:
    yield GaugeMetricFamily("kvstore_queue_waiting", "requests waiting", value=queue.waiting)
    yield GaugeMetricFamily("kvstore_requests_running", "requests running", value=queue.running)


class EngineCollector(Collector):
    """The engine's state at scrape time: one `stats()` and one `queue()` call per scrape."""

    def __init__(self, stats: Callable[[], dict], queue: Callable[[], QueueStats]):
        self._stats, self._queue = stats, queue

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        tiers = stats.get("tiers", {})
        yield from cache_counters(stats.get("counters", {}), list(tiers))
        yield device_blocks(stats.get("device", {}))
        yield from store_families(tiers)
        yield breaker_state(tiers)
        yield from retention_families(stats.get("retention", {}))
        yield from read_gate_gauges(stats.get("read_gate"))
        yield from capacity_gauges(stats.get("capacity", {}))
        yield from queue_gauges(self._queue())


class ServerMetrics:
    """The server's registry: its own counters and histograms, and the engine's collector.
    `observe` is each request's done callback; `render` is the /metrics page."""

    def __init__(self, stats: Callable[[], dict], queue: Callable[[], QueueStats]):
        # The text format would add a `<name>_created` gauge per counter and histogram, a
        # series this page never had; prometheus_client switches them off process-wide only.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats, queue))
        self.counters = {
            name: Counter(name, help_text, [label], registry=self.registry)
            for name, help_text, label in SERVER_COUNTERS
        }
        self.ttft = Histogram("kvstore_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS_S, registry=self.registry)  # fmt: skip
        self.displaced = Counter("kvstore_requests_displaced_total", "waiting requests "
                                 "refused at a full queue to let a tenant with fewer in",
                                 registry=self.registry)  # fmt: skip
        self.preemptions = Counter("kvstore_preemptions_total", "times a running request was "
                                   "preempted to free blocks (it resumes from the cache)",
                                   registry=self.registry)  # fmt: skip
        self.queue_wait = Histogram("kvstore_queue_wait_seconds", "arrival to start",
                                    buckets=LATENCY_BUCKETS_S, registry=self.registry)  # fmt: skip

    def reject(self, reason: str) -> None:
        self.counters["kvstore_requests_rejected_total"].labels(reason).inc()

    def observe(self, job: Request, result: GenerateResult | None) -> None:
        if job.displaced:  # refused, not run: its 429 (or stream error) counts it rejected
            self.displaced.inc()
            return
        if job.queue_wait_s is not None:
            self.queue_wait.observe(job.queue_wait_s)
        if job.ttft_s is not None:
            self.ttft.observe(job.ttft_s)
        self.preemptions.inc(job.num_preemptions)
        outcome = "ok" if result is not None else "cancelled" if job.cancelled else "error"
        self.counters["kvstore_requests_total"].labels(outcome).inc()
        if result is not None:
            self._count_tokens(job.tenant or "", result)

    def branch(self, job: Request, result: GenerateResult | None) -> None:
        """The done callback of a request's other sequences (`n`, `best_of`): the leader's
        `observe` counts the request and its prompt once, each sequence its own tokens."""
        self.preemptions.inc(job.num_preemptions)
        if result is not None:
            completion = self.counters["kvstore_tenant_completion_tokens_total"]
            completion.labels(job.tenant or "").inc(len(result.output_token_ids))

    def _count_tokens(self, tenant: str, result: GenerateResult) -> None:
        counts = {"prompt": result.prompt_tokens, "cached": result.cached_tokens,
                  "completion": len(result.output_token_ids)}  # fmt: skip
        for kind, count in counts.items():
            self.counters[f"kvstore_tenant_{kind}_tokens_total"].labels(tenant).inc(count)

    def render(self) -> bytes:
        """The whole /metrics page (calls the engine's `stats()`: run it off the event loop)."""
        return generate_latest(self.registry)
