"""The cache's counter families, declared once (name, help, labels), and their counts.

`CacheMetrics` counts without any exporter library; the server reads the counts from
`PrefixCache.stats()` and exports each family below as a Prometheus counter named
`PREFIX + name`. `inc` refuses a name or label set the table does not declare.
"""

from __future__ import annotations

import threading
from collections import Counter
from types import MappingProxyType
from typing import NamedTuple

PREFIX = "kvstore_"
DEVICE_TIER = "device"  # the tier name of hits served from the device pool

# Which series a family exports as 0 before its first count (an unlabelled family always
# has its one series).
EVERY_TIER = "every tier"  # the device pool and each spill tier
SPILL_TIERS = "spill tiers"
NO_ZEROS = "none"  # only the series that were counted


class Family(NamedTuple):
    """One counter family: `name` as counted (exported as PREFIX + name), labels sorted as
    the exported series write them."""

    name: str
    help: str
    labels: tuple[str, ...] = ()
    zeros: str = NO_ZEROS

    def zero_series(self, spill_tiers: list[str]) -> list[tuple[str, ...]]:
        """Label values of the series exported as 0 when nothing was counted yet."""
        if not self.labels:
            return [()]
        if self.zeros == EVERY_TIER:
            return [(tier,) for tier in [DEVICE_TIER, *spill_tiers]]
        if self.zeros == SPILL_TIERS:
            return [(tier,) for tier in spill_tiers]
        return []


CACHE_FAMILIES = (
    Family("lookups_total", "prefix-cache lookups"),
    Family("prefix_cache_queries_tokens_total", "prompt tokens looked up"),
    Family("prefix_cache_hits_tokens_total", "prompt tokens served from cache, by tier",
           ("tier",), EVERY_TIER),
    Family("tail_hits_tokens_total",
           "prompt tokens served from the kept partial last block of an earlier request"),
    Family("stored_blocks_total", "blocks stored into the device pool"),
    Family("promoted_blocks_total", "tier blocks promoted into the device pool"),
    Family("evicted_blocks_total", "blocks evicted from the device pool"),
    Family("windowed_out_blocks_total",
           "blocks dropped from the device pool after they slid out of a sliding window (a "
           "hybrid model's: their window layers' part)"),
    Family("tier_writes_blocks_total", "blocks written to a spill tier", ("tier",), SPILL_TIERS),
    Family("dropped_writes_blocks_total", "tier writes dropped (queue full, or not encodable)"),
    Family("tier_retained_entries_total", "spill-tier entries given a client's retention",
           ("tier",), SPILL_TIERS),
    Family("layer_load_seconds_total",
           "seconds the loader spent on layer-by-layer tier loads (reads, copies, checksums)"),
    Family("layer_wait_seconds_total",
           "seconds forwards waited for layers still loading from a tier"),
    Family("layer_load_retries_total",
           "layer-by-layer loads with blocks that did not verify (their requests computed "
           "again)"),
    Family("tier_read_skipped_total",
           "lookups that computed a tier's blocks instead of reading them (the read gate: "
           "fetching them measured slower than computing their tokens)", ("tier",), SPILL_TIERS),
    Family("tier_read_skipped_blocks_total", "blocks a tier held that the read gate skipped",
           ("tier",), SPILL_TIERS),
    Family("verify_failures_total", "tier entries that failed verification",
           ("reason", "tier")),
    Family("foreign_entries_total",
           "intact tier entries of another secret, namespace or format (kept, never deleted)",
           ("reason", "tier")),
    # kvstore.adapters: a serving stack's blocks in the spill tiers, by stack
    Family("adapter_lookups_blocks_total", "stack blocks looked up", ("stack",)),
    Family("adapter_reads_blocks_total", "stack blocks asked for by reads", ("stack",)),
    Family("adapter_hits_blocks_total", "stack blocks read and verified, by tier",
           ("stack", "tier")),
    Family("adapter_writes_blocks_total", "stack blocks written, by tier", ("stack", "tier")),
    Family("adapter_dropped_writes_blocks_total",
           "stack blocks a tier did not take (full or unreachable)", ("stack", "tier")),
)  # fmt: skip
FAMILIES = MappingProxyType({family.name: family for family in CACHE_FAMILIES})

SeriesKey = tuple[str, tuple[str, ...]]  # (family name, label values in the family's order)


def series_key(name: str, labels: dict[str, str]) -> SeriesKey:
    """The key of one series; ValueError for a name or label set not declared above."""
    family = FAMILIES.get(name)
    if family is None:
        raise ValueError(f"{name!r} is not a cache metric family (kvstore.metrics.FAMILIES)")
    if sorted(labels) != list(family.labels):
        raise ValueError(f"{name} takes labels {family.labels}, got {tuple(sorted(labels))}")
    return name, tuple(str(labels[label]) for label in family.labels)


class CacheMetrics:
    """Thread-safe cumulative counters. Token counts are prompt tokens, per source tier."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[SeriesKey] = Counter()

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        key = series_key(name, labels)
        with self._lock:
            self._counts[key] += value

    def record_lookup(self, num_prompt_tokens: int, tier_tokens: dict[str, int]) -> None:
        hits = {series_key("prefix_cache_hits_tokens_total", {"tier": t}): n
                for t, n in tier_tokens.items()}  # fmt: skip
        with self._lock:
            self._counts[("lookups_total", ())] += 1
            self._counts[("prefix_cache_queries_tokens_total", ())] += num_prompt_tokens
            self._counts.update(hits)

    def get(self, name: str, **labels: str) -> int:
        key = series_key(name, labels)
        with self._lock:
            return self._counts.get(key, 0)

    def snapshot(self) -> dict:
        """{"counters": {family name: {label values: count}}, "hits_tokens": {tier: tokens},
        "hit_rate": float}; label values are in the order of the family's `labels`."""
        with self._lock:
            counts = dict(self._counts)
        counters: dict[str, dict[tuple[str, ...], int]] = {}
        for (name, values), count in counts.items():
            counters.setdefault(name, {})[values] = count
        hits = {v[0]: n for v, n in counters.get("prefix_cache_hits_tokens_total", {}).items()}
        queries = counts.get(("prefix_cache_queries_tokens_total", ()), 0)
        rate = sum(hits.values()) / queries if queries else 0.0
        return {"counters": counters, "hits_tokens": hits, "hit_rate": rate}
