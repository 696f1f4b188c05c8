"""What a reader does with tier entries that fail verification (docs/FORMAT.md).

- Damaged (its checksum fails, or its header cannot be parsed): deleted from the tier.
- Foreign (written under another secret, namespace, entry kind or format version): a miss
  here, but valid for its writer. Never deleted, so that one misconfigured process cannot
  empty a shared tier; announced once per tier and reason with its likely cause.
- Mismatched (an intact entry of another prefix: a lookup-key collision, another shape):
  kept for the prefix that wrote it.
Every failure is a miss, counted in `verify_failures_total{reason, tier}` and the store's
`verify_failures`; foreign ones also in `foreign_entries_total` and the store's `foreign`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from kvstore.entry import EntryError
from kvstore.metrics import CacheMetrics
from kvstore.stores import SpillStore

log = logging.getLogger("kvstore.tiers")

CAUSES = {
    "secret": "this process's secret (KVSTORE_SECRET) differs from the writer's: give every "
    "process that shares the tier the same secret",
    "version": "another kvstore release wrote them in another entry format",
    "namespace": "another model, layout or tenant wrote them under a colliding key",
    "kind": "a serving stack's adapter and the engine wrote the same key",
}


class Rejections:
    """Sorts a read's failed entries into damaged (deleted) and the rest (kept); counts and
    announces them. One per cache or adapter; thread-safe."""

    def __init__(self, metrics: CacheMetrics):
        self.metrics = metrics
        self._announced: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def record(self, store: SpillStore, failures: Sequence[tuple[bytes, EntryError]]) -> None:
        """The entries at these keys of `store` failed verification with these errors."""
        if not failures:
            return
        damaged = [key for key, e in failures if e.damaged]
        foreign = [e for _, e in failures if e.foreign]
        if damaged:
            store.reject(damaged)
        if len(damaged) < len(failures):
            store.refuse(len(failures) - len(damaged), foreign=len(foreign))
        for _, e in failures:
            self.metrics.inc("verify_failures_total", tier=store.name, reason=e.reason)
        for e in foreign:
            self.metrics.inc("foreign_entries_total", tier=store.name, reason=e.reason)
            self._announce(store.name, e)

    def _announce(self, tier: str, e: EntryError) -> None:
        with self._lock:
            if (tier, e.reason) in self._announced:
                return
            self._announced.add((tier, e.reason))
        log.warning(
            "kvstore: the %s tier holds entries this process cannot use (%s): %s. They read "
            "as misses here and are never deleted (this is announced once).",
            tier, e, CAUSES[e.reason],
        )  # fmt: skip
