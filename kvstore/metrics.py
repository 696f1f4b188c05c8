"""Cache counters, named and labelled as they are exported to Prometheus."""

from __future__ import annotations

import threading
from collections import Counter

PREFIX = "kvstore_"


def series(name: str, **labels: str) -> str:
    """Prometheus series name: `kvstore_<name>{label="value",...}` (labels sorted)."""
    if not labels:
        return PREFIX + name
    body = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{PREFIX}{name}{{{body}}}"


class CacheMetrics:
    """Thread-safe cumulative counters. Token counts are prompt tokens, per source tier."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def inc(self, name: str, value: int = 1, **labels: str) -> None:
        with self._lock:
            self._counts[series(name, **labels)] += value

    def record_lookup(self, num_prompt_tokens: int, tier_tokens: dict[str, int]) -> None:
        with self._lock:
            self._counts[series("lookups_total")] += 1
            self._counts[series("prefix_cache_queries_tokens_total")] += num_prompt_tokens
            for tier, tokens in tier_tokens.items():
                self._counts[series("prefix_cache_hits_tokens_total", tier=tier)] += tokens

    def get(self, name: str, **labels: str) -> int:
        with self._lock:
            return self._counts.get(series(name, **labels), 0)

    def snapshot(self) -> dict:
        """{"counters": {series: value}, "hits_tokens": {tier: tokens}, "hit_rate": float}."""
        with self._lock:
            counts = dict(self._counts)
        hits_prefix = series("prefix_cache_hits_tokens_total") + '{tier="'
        hits = {k[len(hits_prefix) : -2]: v for k, v in counts.items() if k.startswith(hits_prefix)}
        queries = counts.get(series("prefix_cache_queries_tokens_total"), 0)
        rate = sum(hits.values()) / queries if queries else 0.0
        return {"counters": counts, "hits_tokens": hits, "hit_rate": rate}
