"""The spill-store contract: a batch key-value store of encoded block entries.

Keys are 16-byte block hashes (lookup keys); values are entries made by `kvstore.entry.codec`.
Every method is one round trip (or one transaction) per call, whatever the batch size, and
none raises on a backend failure: a failing tier reads as misses and drops writes, and
counts them in `stats()`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvstore.stores.breaker import describe as describe_error

log = logging.getLogger("kvstore.tiers")
ERROR_LOG_QUIET_S = 30.0  # a failing tier is logged again after this long without errors


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of one store's counters (per process) and size.

    hits/misses count keys of `get_many`/`get_prefix` (a prefix read counts the keys after
    the first gap as misses). `entries`/`bytes` are None when the backend cannot tell cheaply.
    """

    name: str
    entries: int | None
    bytes: int | None
    capacity_bytes: int | None
    hits: int
    misses: int
    writes: int
    evictions: int
    verify_failures: int
    dropped_writes: int
    errors: int
    foreign: int = 0  # of verify_failures: intact entries of another secret/namespace/format
    retained: int | None = None  # entries retained now (None: the backend cannot tell cheaply)
    breaker_state: str | None = None  # "closed", "open", "half_open"; None without a breaker
    seconds_since_error: float | None = None  # since the last counted error; None: never


class Counters:
    """Thread-safe counters shared by the stores' `stats()`."""

    FIELDS = (
        "hits",
        "misses",
        "writes",
        "evictions",
        "verify_failures",
        "dropped_writes",
        "errors",
        "foreign",
    )

    def __init__(self, name: str = "tier") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)
        self._last_error_at: float | None = None  # monotonic

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta
            if deltas.get("errors"):
                self._last_error_at = time.monotonic()

    def error(self, error: BaseException, **deltas: int) -> None:
        """Count one backend error (and `deltas`); the first after a quiet spell is logged."""
        now = time.monotonic()
        with self._lock:
            last, self._last_error_at = self._last_error_at, now
            self._values["errors"] += 1
            for name, delta in deltas.items():
                self._values[name] += delta
        if last is None or now - last >= ERROR_LOG_QUIET_S:
            log.warning("tier %s is failing (%s): its reads are misses and its writes are "
                        "dropped while it does", self.name, describe_error(error))  # fmt: skip

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def seconds_since_error(self) -> float | None:
        with self._lock:
            last = self._last_error_at
        return None if last is None else time.monotonic() - last

    def count_reads(self, values: Sequence[bytes | None], requested: int) -> None:
        found = sum(v is not None for v in values)
        self.add(hits=found, misses=requested - found)


# listener(removed, stored): entry keys one call of this process removed, then stored
StoreListener = Callable[[list[bytes], list[bytes]], None]


class Changes:
    """The entry keys one call changed, in the order it changed them: `net()` splits them by
    each key's last change (an old entry evicted and then written again is stored; one
    written and then evicted is removed)."""

    def __init__(self) -> None:
        self._last: dict[bytes, bool] = {}  # key -> stored (True) or removed (False) last

    def removed(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._last[bytes(key)] = False

    def stored(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._last[bytes(key)] = True

    def net(self) -> tuple[list[bytes], list[bytes]]:
        last = self._last.items()
        return [k for k, s in last if not s], [k for k, s in last if s]


class SpillStore(ABC):
    """A spill tier below the device pool. Implementations are thread-safe."""

    name: str
    _listener: StoreListener | None = None
    # True: put_many copies the values during the call, so a caller may pass views of a buffer
    # it reuses afterwards. False (the safe default): it may keep them, so pass immutable bytes.
    copies_values: bool = False
    # `read_prefix` hands out values without I/O on the caller's thread (process memory, or
    # a map whose pages fault in where they are read): a layer-by-layer load reads them at
    # lookup time and compares headers there, instead of on its loader thread
    reads_in_place: bool = False

    @abstractmethod
    def count_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading `keys` present (stops at the first absent key); one round trip.

        A positive answer is a promise only: the entries may be evicted or fail verification
        before they are fetched.
        """

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is present (a promise only, as `count_prefix`); one round trip.

        This default fetches the values; the stores override it to check keys only."""
        return [v is not None for v in self._fetch(keys)]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The stored value of every key, None where absent; one round trip."""
        values = self._fetch(keys)
        self._counters.count_reads(values, len(keys))
        return values

    def get_prefix(self, keys: Sequence[bytes]) -> list[bytes]:
        """Values of the longest present prefix of `keys`: a whole lookup in one round trip."""
        values = self._fetch(keys)
        n = next((i for i, v in enumerate(values) if v is None), len(values))
        self._counters.add(hits=n, misses=len(keys) - n)
        return values[:n]  # type: ignore[return-value]

    @contextlib.contextmanager
    def read_prefix(self, keys: Sequence[bytes]) -> Iterator[Sequence[bytes | memoryview]]:
        """`get_prefix` whose values may be zero-copy views into the store (LMDB's map), valid
        only inside the `with` block: copy what must outlive it."""
        yield self.get_prefix(keys)

    @abstractmethod
    def _fetch(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """get_many without the counting (implementations: one round trip / transaction)."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> int:
        """Store (key, value) pairs, skipping keys already present; returns how many were written.

        Values are bytes-like (views of a reused buffer only if `copies_values`).

        Writes the store cannot take (full, unreachable) are dropped and counted, never raised.
        """

    @abstractmethod
    def retain(self, keys: Sequence[bytes], ttl_s: float) -> int:
        """Keep the entries `keys` at least ttl_s seconds from now: eviction passes over them
        until then (a longer retention or expiry an entry has stays). Returns how many of them
        the call retained (absent keys are skipped; a failing backend retains none)."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove these keys; returns how many were present."""

    def reject(self, keys: Sequence[bytes]) -> int:
        """Damaged entries (checksum or header fails): count them as verify failures and
        delete them. Only damaged ones: an intact entry that fails is `refuse`d."""
        self._counters.add(verify_failures=len(keys))
        return self.delete(keys) if keys else 0

    def refuse(self, count: int, foreign: int = 0) -> None:
        """Intact entries that failed verification (`foreign` of them written under another
        secret, namespace or format version; the rest another prefix's): counted, kept."""
        self._counters.add(verify_failures=count, foreign=foreign)

    def identity(self) -> str | None:
        """The backend's name without secrets, the same in every process that reads it (a
        router counts a block written there for each of them); None: private to this
        process (host memory)."""
        return None

    def probe(self) -> str | None:
        """None when the store can be reached now, else why not (one line, no secrets).
        Local stores are reachable once open; a networked one asks its server."""
        return None

    @abstractmethod
    def stats(self) -> StoreStats:
        """Counters and size of this store."""

    def counters(self) -> dict[str, int]:
        """This store's counters alone (`Counters.FIELDS`): no backend call, unlike stats()."""
        return self._counters.snapshot()

    @abstractmethod
    def clear(self) -> int:
        """Remove every entry of this store; returns how many were removed (None-free count)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections/handles. Idempotent."""

    _counters: Counters

    def watch(self, listener: StoreListener) -> None:
        """Have `listener(removed, stored)` called for each call of this process that
        changed the store (put_many and its evictions, delete, reject; host memory's clear
        too), with the entry keys it removed and those it stored, each key by its last
        change in the call (`Changes`). Calls are reported in the order their changes took
        effect (under the store's lock), so the listener must be quick and must not call the
        store. A change made by another process (a shared LMDB's writer, `kvstore admin
        clear`, Redis's own eviction or expiry) is not seen. One listener per store."""
        self._listener = listener

    def _changed(self, changes: Changes) -> None:
        if self._listener is not None:
            removed, stored = changes.net()
            if removed or stored:
                self._listener(removed, stored)

    def __enter__(self) -> SpillStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def health(self) -> dict:
        """What a health check reads, with no I/O: errors, seconds since the last one, and the
        breaker's state (None without one)."""
        breaker = getattr(self, "breaker", None)
        return {
            "errors": self._counters.snapshot()["errors"],
            "seconds_since_error": self._counters.seconds_since_error(),
            "breaker_state": None if breaker is None else breaker.state,
        }

    def _stats(
        self,
        entries: int | None,
        nbytes: int | None,
        capacity: int | None,
        breaker_state: str | None = None,
        retained: int | None = None,
    ) -> StoreStats:
        return StoreStats(
            self.name,
            entries,
            nbytes,
            capacity,
            **self._counters.snapshot(),
            retained=retained,
            breaker_state=breaker_state,
            seconds_since_error=self._counters.seconds_since_error(),
        )
