"""The cache's counter families: declared once, validated on use, exported without a library."""

import subprocess
import sys

import pytest

from kvstore.metrics import CACHE_FAMILIES, FAMILIES, CacheMetrics


def test_counts_are_kept_by_family_and_label_values():
    metrics = CacheMetrics()
    metrics.record_lookup(10, {"device": 4, "memory": 4})
    metrics.record_lookup(6, {})
    metrics.inc("verify_failures_total", tier="lmdb", reason="checksum")
    snapshot = metrics.snapshot()
    assert snapshot["counters"]["lookups_total"] == {(): 2}
    assert snapshot["counters"]["verify_failures_total"] == {("checksum", "lmdb"): 1}
    assert snapshot["hits_tokens"] == {"device": 4, "memory": 4}
    assert snapshot["hit_rate"] == 0.5
    assert metrics.get("prefix_cache_queries_tokens_total") == 16


def test_undeclared_names_and_label_sets_are_refused():
    metrics = CacheMetrics()
    for name, labels in [("lookup_total", {}), ("lookups_total", {"tier": "device"}),
                         ("verify_failures_total", {"tier": "lmdb"})]:  # fmt: skip
        with pytest.raises(ValueError, match=r"kvstore\.metrics|takes labels"):
            metrics.inc(name, **labels)


def test_families_have_sorted_labels_and_zero_series_per_tier():
    assert all(list(f.labels) == sorted(f.labels) for f in CACHE_FAMILIES)
    assert len(FAMILIES) == len(CACHE_FAMILIES)
    spill = ["memory", "redis"]
    assert FAMILIES["lookups_total"].zero_series(spill) == [()]
    hits = FAMILIES["prefix_cache_hits_tokens_total"].zero_series(spill)
    assert hits == [("device",), ("memory",), ("redis",)]
    assert FAMILIES["tier_writes_blocks_total"].zero_series(spill) == [("memory",), ("redis",)]
    assert FAMILIES["verify_failures_total"].zero_series(spill) == []


def test_the_cache_layer_does_not_import_prometheus_client():
    code = "import sys, kvstore.cache; sys.exit('prometheus_client' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
