"""/metrics in the Prometheus text format (0.0.4): the cache's counters and the server's own.

Cache counters come from `PrefixCache.stats()` (already named as Prometheus series); the
server adds per-store counters and gauges (breaker state included), TTFT and queue-wait
histograms, request outcomes and per-tenant token counters.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Iterable, Sequence

from engine.request import GenerateResult, Request
from engine.scheduler import QueueStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0)  # fmt: skip
BREAKER_STATES = ("closed", "open", "half_open")
STORE_COUNTERS = ("hits", "misses", "writes", "evictions", "verify_failures", "dropped_writes",
                  "errors")  # fmt: skip
STORE_GAUGES = ("entries", "bytes", "capacity_bytes")

# Cache counter families (kvstore.metrics names): help text, and whether labelled by tier.
CACHE_FAMILIES = {
    "kvstore_lookups_total": ("prefix-cache lookups", False),
    "kvstore_prefix_cache_queries_tokens_total": ("prompt tokens looked up", False),
    "kvstore_prefix_cache_hits_tokens_total": ("prompt tokens served from cache, by tier", True),
    "kvstore_stored_blocks_total": ("blocks stored into the device pool", False),
    "kvstore_promoted_blocks_total": ("tier blocks promoted into the device pool", False),
    "kvstore_evicted_blocks_total": ("blocks evicted from the device pool", False),
    "kvstore_tier_writes_blocks_total": ("blocks written to a spill tier", True),
    "kvstore_dropped_writes_blocks_total": ("tier writes dropped (queue full)", False),
    "kvstore_verify_failures_total": ("tier entries that failed verification", False),
}


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def labels(**values: str) -> str:
    if not values:
        return ""
    return "{" + ",".join(f'{k}="{escape(str(v))}"' for k, v in sorted(values.items())) + "}"


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


class Histogram:
    """A cumulative Prometheus histogram (thread-safe)."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS_S):
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    def lines(self, name: str) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        out, running = [], 0
        for bound, count in zip([*map(str, self.buckets), "+Inf"], counts, strict=True):
            running += count
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        return [*out, f"{name}_sum {_number(total)}", f"{name}_count {running}"]


class ServerMetrics:
    """The server's own counters and histograms; `observe` is each request's done callback."""

    def __init__(self) -> None:
        self.ttft = Histogram()
        self.queue_wait = Histogram()
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()  # (family, label string) -> value

    def inc(self, family: str, value: int = 1, **label_values: str) -> None:
        with self._lock:
            self._counts[(family, labels(**label_values))] += value

    def observe(self, job: Request, result: GenerateResult | None) -> None:
        if job.queue_wait_s is not None:
            self.queue_wait.observe(job.queue_wait_s)
        if job.ttft_s is not None:
            self.ttft.observe(job.ttft_s)
        outcome = "ok" if result is not None else "cancelled" if job.cancelled else "error"
        self.inc("kvstore_requests_total", outcome=outcome)
        if result is not None:
            tenant = job.tenant or ""
            self.inc("kvstore_tenant_prompt_tokens_total", result.prompt_tokens, tenant=tenant)
            self.inc("kvstore_tenant_cached_tokens_total", result.cached_tokens, tenant=tenant)
            generated = len(result.output_token_ids)
            self.inc("kvstore_tenant_completion_tokens_total", generated, tenant=tenant)

    def counter_lines(self) -> dict[str, list[str]]:
        with self._lock:
            items = sorted(self._counts.items())
        out: dict[str, list[str]] = {}
        for (family, label_text), value in items:
            out.setdefault(family, []).append(f"{family}{label_text} {value}")
        return out


SERVER_FAMILIES = {
    "kvstore_requests_total": "finished requests by outcome (ok, error, cancelled)",
    "kvstore_requests_rejected_total": "requests refused before queueing, by reason",
    "kvstore_tenant_prompt_tokens_total": "prompt tokens of finished requests, by tenant",
    "kvstore_tenant_cached_tokens_total": "prompt tokens served from cache, by tenant",
    "kvstore_tenant_completion_tokens_total": "generated tokens, by tenant",
}


def _family(name: str, kind: str, help_text: str, samples: Iterable[str]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


def _cache_counters(stats: dict) -> list[str]:
    counters: dict[str, int] = dict(stats.get("counters", {}))
    tiers = ["device", *stats.get("tiers", {})]
    for family, (_, by_tier) in CACHE_FAMILIES.items():
        if family == "kvstore_verify_failures_total":
            continue  # labelled by tier and reason: only the ones that happened
        for tier in tiers if by_tier else [None]:
            if by_tier and family == "kvstore_tier_writes_blocks_total" and tier == "device":
                continue
            counters.setdefault(family + (labels(tier=tier) if tier else ""), 0)
    out = []
    for family, (help_text, _) in CACHE_FAMILIES.items():
        samples = [f"{s} {v}" for s, v in sorted(counters.items()) if s.split("{")[0] == family]
        out += _family(family, "counter", help_text, samples)
    return out


def _store_lines(tiers: dict[str, dict]) -> list[str]:
    out = []
    for field in STORE_COUNTERS:
        name = f"kvstore_store_{field}_total"
        samples = [f"{name}{labels(tier=t)} {s[field]}" for t, s in tiers.items()]
        out += _family(name, "counter", f"spill store {field.replace('_', ' ')}", samples)
    for field in STORE_GAUGES:
        name = f"kvstore_store_{field}"
        samples = [
            f"{name}{labels(tier=t)} {s[field]}" for t, s in tiers.items() if s[field] is not None
        ]
        out += _family(name, "gauge", f"spill store {field.replace('_', ' ')}", samples)
    name = "kvstore_tier_breaker_state"
    samples = [
        f"{name}{labels(tier=t, state=state)} {int(s['breaker_state'] == state)}"
        for t, s in tiers.items()
        if s.get("breaker_state") is not None
        for state in BREAKER_STATES
    ]
    return out + _family(name, "gauge", "circuit breaker state (1 = current)", samples)


def render(stats: dict, server: ServerMetrics, queue: QueueStats) -> str:
    """The whole /metrics page."""
    device = stats.get("device", {})
    lines = _cache_counters(stats)
    lines += _family(
        "kvstore_device_blocks",
        "gauge",
        "device pool blocks by state",
        [f"kvstore_device_blocks{labels(state=k.removeprefix('blocks_'))} {v}" for k, v in
         sorted(device.items())],
    )  # fmt: skip
    lines += _store_lines(stats.get("tiers", {}))
    counters = server.counter_lines()
    for family, help_text in SERVER_FAMILIES.items():
        lines += _family(family, "counter", help_text, counters.get(family, []))
    lines += _family("kvstore_queue_waiting", "gauge", "requests waiting", [
        f"kvstore_queue_waiting {queue.waiting}"])  # fmt: skip
    lines += _family("kvstore_requests_running", "gauge", "requests running", [
        f"kvstore_requests_running {queue.running}"])  # fmt: skip
    ttft = "kvstore_time_to_first_token_seconds"
    lines += _family(ttft, "histogram", "arrival to first token", server.ttft.lines(ttft))
    wait = "kvstore_queue_wait_seconds"
    lines += _family(wait, "histogram", "arrival to start", server.queue_wait.lines(wait))
    return "\n".join(lines) + "\n"
