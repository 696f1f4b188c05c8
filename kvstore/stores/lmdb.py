"""LmdbStore: a local, embedded, multi-process spill tier with FIFO high-water eviction.

Layout of the environment (one per directory, shared by all namespaces: keys are disjoint):
- sub-db "blocks": namespace id (8 bytes, may be empty) + 16-byte block key -> encoded entry
- sub-db "order":  8-byte big-endian insertion sequence -> block key (oldest first)
- sub-db "seq":    block key -> its 8-byte sequence (to delete its "order" record)
- sub-db "meta":   b"generation" -> 8-byte counter, bumped after each eviction
- sub-db "expiry": block key -> 8-byte big-endian wall-clock ms its retention ends (only
  retained entries have one; eviction moves a retained entry behind the others instead of
  deleting it, until its retention ends or every entry left is retained)

A full map is an error in LMDB, so writes evict ahead of time. Copy-on-write makes the
live page count an underestimate of what a write needs: an insert copies every leaf it
touches (random keys: one in "blocks" and one in "seq" per entry), and the pages the
previous commit replaced are reusable only once no snapshot can see them. So a batch
"costs" its data pages plus twice its copied pages, and when live pages + cost would pass
`high_water` of the map, the oldest entries are deleted down to `low_water` - cost, in
chunks of a bounded number of entries per transaction (a delete copies leaves too), each
chunk followed by a tiny transaction on sub-db "meta" that makes the freed pages reusable.
A MapFullError that still happens (a reader pinning old pages, another process writing)
triggers one forced eviction down to half the live pages and a retry; then the batch is
dropped and counted. Environments are shared per process and reopened (lazily) in a
forked child.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import lmdb

from kvstore.stores.base import Changes, Counters, SpillStore, StoreStats
from kvstore.stores.lmdb_env import SharedEnv, acquire, release
from kvstore.stores.lmdb_pages import batches as _batches
from kvstore.stores.lmdb_pages import data_pages as _data_pages
from kvstore.stores.lmdb_pages import expiry_ms as _ms
from kvstore.stores.lmdb_pages import page_counts as _page_counts
from kvstore.stores.lmdb_pages import pages as _pages
from kvstore.stores.lmdb_pages import reserve as _reserve
from kvstore.stores.lmdb_pages import tree_pages as _tree_pages
from kvstore.stores.lmdb_pages import used_pages as _used_pages
from kvstore.stores.lmdb_records import advance as _advance
from kvstore.stores.lmdb_records import append as _append
from kvstore.stores.lmdb_records import insert as _insert
from kvstore.stores.lmdb_records import remove as _remove

T = TypeVar("T")


class LmdbStore(SpillStore):
    """Spill tier in an LMDB environment at `path` (a directory), bounded by its map size."""

    name = "lmdb"
    reads_in_place = True
    copies_values = True

    def __init__(
        self,
        path: str,
        map_size_bytes: int,
        high_water: float = 0.9,
        low_water: float = 0.8,
        namespace_id: bytes = b"",
        clock: Callable[[], float] = time.time,
    ):
        """`namespace_id` prefixes every key, so `clear` can drop one namespace's entries.
        `clock`: wall-clock seconds (retention deadlines outlive the process)."""
        if not 0.0 < low_water < high_water <= 1.0:
            raise ValueError(f"need 0 < low_water < high_water <= 1, got {low_water}, {high_water}")
        if not isinstance(map_size_bytes, int) or map_size_bytes < 64 * 4096:
            raise ValueError(f"map_size_bytes must be an int >= 256 KiB, got {map_size_bytes!r}")
        self.path = os.path.realpath(path)
        self._order = threading.Lock()
        self._prefix = namespace_id
        self.high_water, self.low_water = high_water, low_water
        self._requested_map_size = map_size_bytes
        self._counters = Counters(self.name)
        self.clock = clock
        self._shared: SharedEnv | None = acquire(self.path, map_size_bytes)

    # --------------------------------------------------------------- environment

    def _handle(self) -> SharedEnv:
        shared = self._shared
        if shared is None:
            raise RuntimeError(f"LmdbStore({self.path!r}) is closed")
        if shared.pid != os.getpid():  # forked: this process needs its own environment
            shared = self._shared = acquire(self.path, self._requested_map_size)
        return shared

    def _run(self, fn: Callable[[SharedEnv], T]) -> T:
        """Run `fn`, adopting a map grown by another process (MapResizedError) once."""
        shared = self._handle()
        try:
            return fn(shared)
        except lmdb.MapResizedError:
            shared.env.set_mapsize(0)
            return fn(shared)

    # --------------------------------------------------------------- reads

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        def count(shared: SharedEnv) -> int:
            with shared.env.begin(db=shared.blocks, buffers=True) as txn:
                cursor = txn.cursor()
                for i, key in enumerate(keys):
                    if not cursor.set_key(self._prefix + key):
                        return i
                return len(keys)

        try:
            return self._run(count)
        except lmdb.Error as e:
            self._counters.error(e)
            return 0

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        def contains(shared: SharedEnv) -> list[bool]:
            with shared.env.begin(db=shared.blocks, buffers=True) as txn:
                cursor = txn.cursor()
                return [cursor.set_key(self._prefix + key) for key in keys]

        try:
            return self._run(contains)
        except lmdb.Error as e:
            self._counters.error(e)
            return [False] * len(keys)

    def _fetch(self, keys: Sequence[bytes]) -> list[bytes | None]:
        def get(shared: SharedEnv) -> list[bytes | None]:
            with shared.env.begin(db=shared.blocks) as txn:
                return [txn.get(self._prefix + key) for key in keys]

        try:
            values = self._run(get)
        except lmdb.Error as e:
            self._counters.error(e)
            values = [None] * len(keys)
        return values

    @contextlib.contextmanager
    def read_prefix(self, keys: Sequence[bytes]) -> Iterator[Sequence[bytes | memoryview]]:
        """Zero-copy `get_prefix`: views into the map, held by a read transaction that ends
        with the `with` block (until then LMDB does not reuse their pages)."""
        try:
            txn = self._run(lambda shared: shared.env.begin(db=shared.blocks, buffers=True))
        except lmdb.Error as e:
            self._counters.error(e, misses=len(keys))
            yield []
            return
        try:
            values = self._read_views(txn, keys)
            self._counters.add(hits=len(values), misses=len(keys) - len(values))
            yield values
        finally:
            txn.abort()

    def _read_views(self, txn: lmdb.Transaction, keys: Sequence[bytes]) -> list[memoryview]:
        values: list[memoryview] = []
        try:
            for key in keys:
                value = txn.get(self._prefix + key)
                if value is None:
                    break
                values.append(value)
        except lmdb.Error as e:
            self._counters.error(e)
        return values

    # --------------------------------------------------------------- writes

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        if not items:
            return 0
        items = [(self._prefix + key, value) for key, value in items]
        psize, map_pages = _pages(self._handle())
        tree = self._run(_tree_pages)
        budget = (self.high_water - self.low_water) * map_pages  # pages one batch may cost
        sized = [((k, v), _data_pages(len(k), len(v), psize)) for k, v in items]
        fits = [(item, c) for item, c in sized if int(c) <= budget]
        changes = Changes()
        with self._order:  # this process's changes reach the listener in commit order
            written = sum(self._put_batch(b, c, changes) for b, c in _batches(fits, budget, tree))
            self._changed(changes)
        self._counters.add(writes=written, dropped_writes=len(sized) - len(fits))
        return written

    def _put_batch(
        self,
        batch: list[tuple[bytes, bytes]],
        data_pages: float,
        changes: Changes,
    ) -> int:
        """Write `batch` (what it evicted and stored goes to `changes`, in that order)."""
        for force in (False, True):
            try:
                written = self._run(
                    lambda sh, f=force: self._write(sh, batch, data_pages, f, changes)
                )
                changes.stored(self._own(key for key, _ in batch))
                return written
            except lmdb.MapFullError:
                continue
            except lmdb.Error as e:
                self._counters.error(e)
                break
        self._counters.add(dropped_writes=len(batch))
        return 0

    def _write(
        self,
        shared: SharedEnv,
        batch: list[tuple[bytes, bytes]],
        data_pages: float,
        force: bool,
        changes: Changes,
    ) -> int:
        _, map_pages = _pages(shared)
        with shared.env.begin() as txn:
            live, tree = _page_counts(txn, shared)
        need = data_pages + _reserve(len(batch), tree)
        if force or live + need > self.high_water * map_pages:
            target = max(0, int(self.low_water * map_pages - need))
            self._evict(shared, min(target, live // 2) if force else target, map_pages, changes)
        with shared.env.begin(write=True) as txn:  # commits unless an exception escapes
            return _insert(txn, shared, batch)

    def _evict(
        self, shared: SharedEnv, target_pages: int, map_pages: int, changes: Changes
    ) -> None:
        """Delete the oldest entries (FIFO) until live pages <= target_pages, a chunk per
        transaction (this namespace's keys go to `changes` once committed); a chunk that
        hits MapFull is retried at half the size."""
        chunk = max(1, int((1.0 - self.high_water) * map_pages) // 4)
        while True:
            try:
                keys: list[bytes] = []
                with shared.env.begin(write=True) as txn:
                    evicted = self._evict_chunk(txn, shared, target_pages, chunk, keys)
                self._counters.add(evictions=evicted)  # committed
                changes.removed(self._own(keys))
                _advance(shared)
            except lmdb.MapFullError:
                if chunk == 1:
                    raise
                chunk //= 2
                continue
            if evicted < chunk:  # at the target, or nothing left to evict
                return

    def _evict_chunk(
        self, txn: lmdb.Transaction, shared: SharedEnv, target: int, chunk: int, keys: list
    ) -> int:
        """Delete up to `chunk` oldest entries (their keys into `keys`), fewer once live
        pages <= target or none are left; returns how many."""
        cursor = txn.cursor(db=shared.order)
        evicted, passes, now_ms = 0, txn.stat(shared.expiry)["entries"], int(self.clock() * 1000)
        while evicted < chunk:
            if _used_pages(txn, shared) <= target or not cursor.first():
                break
            key = cursor.value()
            cursor.delete()
            if passes > 0 and _ms(txn.get(key, db=shared.expiry)) > now_ms:
                passes -= 1  # retained: it goes behind the others (each one once a chunk)
                _append(txn, shared, key)
                continue
            txn.delete(key, db=shared.seq)
            txn.delete(key, db=shared.blocks)
            txn.delete(key, db=shared.expiry)
            keys.append(key)
            evicted += 1
        return evicted

    def retain(self, keys: Sequence[bytes], ttl_s: float) -> int:
        until = int((self.clock() + ttl_s) * 1000)

        def mark(shared: SharedEnv) -> int:
            retained = 0
            with shared.env.begin(write=True) as txn:
                for key in keys:
                    full = self._prefix + key
                    if txn.get(full, db=shared.seq) is None:
                        continue
                    if _ms(txn.get(full, db=shared.expiry)) < until:
                        txn.put(full, until.to_bytes(8, "big"), db=shared.expiry)
                    retained += 1
            return retained

        try:
            return self._run(mark) if keys else 0
        except lmdb.Error as e:
            self._counters.error(e)
            return 0

    def delete(self, keys: Sequence[bytes]) -> int:
        def remove(shared: SharedEnv) -> list[bytes]:
            with shared.env.begin(write=True) as txn:
                return [k for k in keys if _remove(txn, shared, self._prefix + k)]

        try:
            with self._order:
                removed, changes = self._run(remove) if keys else [], Changes()
                changes.removed(removed)
                self._changed(changes)
            return len(removed)
        except lmdb.Error as e:
            self._counters.error(e)
            return 0

    # --------------------------------------------------------------- admin

    def _own(self, full_keys: Iterable[bytes]) -> list[bytes]:
        """This namespace's keys among `full_keys`, without the namespace id."""
        n = len(self._prefix)
        return [key[n:] for key in full_keys if key.startswith(self._prefix)]

    def identity(self) -> str | None:
        return f"lmdb://{socket.gethostname()}{self.path}"  # processes of one host share it

    def stats(self) -> StoreStats:
        def measure(shared: SharedEnv) -> tuple[int, int, int]:
            with shared.env.begin() as txn:
                entries, used = txn.stat(shared.blocks)["entries"], _used_pages(txn, shared)
                return entries, used, self._num_retained(txn, shared)

        shared = self._handle()
        psize, map_pages = _pages(shared)
        entries, used, retained = self._run(measure)
        return self._stats(entries, used * psize, map_pages * psize, retained=retained)

    def count_entries(self) -> int | None:
        """This namespace's entries (every entry without a namespace id): an admin call, it
        walks the namespace's keys in one read transaction. None if the store fails."""

        def count(shared: SharedEnv) -> int:
            if not self._prefix:
                with shared.env.begin() as txn:
                    return txn.stat(shared.blocks)["entries"]
            with shared.env.begin() as txn:
                cursor, n = txn.cursor(db=shared.blocks), 0
                if cursor.set_range(self._prefix):
                    for key in cursor.iternext(values=False):
                        if not key.startswith(self._prefix):
                            break
                        n += 1
                return n

        try:
            return self._run(count)
        except lmdb.Error:
            return None

    def _num_retained(self, txn: lmdb.Transaction, shared: SharedEnv) -> int:
        """Entries retained now (a walk of the expiry records: few, retained ones only)."""
        now = int(self.clock() * 1000)
        cursor = txn.cursor(db=shared.expiry)
        return sum(_ms(v) > now for _, v in cursor.iternext())

    def clear(self) -> int:
        """Delete this namespace's entries (every entry when the store has no namespace id)."""

        def drop_all(shared: SharedEnv) -> int:
            with shared.env.begin(write=True) as txn:
                removed = txn.stat(shared.blocks)["entries"]
                for db in (shared.blocks, shared.order, shared.seq, shared.expiry):
                    txn.drop(db, delete=False)
            return removed

        def drop_namespace(shared: SharedEnv) -> int:
            with shared.env.begin(write=True) as txn:
                cursor, keys = txn.cursor(db=shared.blocks), []
                if cursor.set_range(self._prefix):
                    for key in cursor.iternext(values=False):
                        if not key.startswith(self._prefix):
                            break
                        keys.append(key)
                return sum(_remove(txn, shared, key) for key in keys)

        return self._run(drop_namespace if self._prefix else drop_all)

    def close(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            release(self.path, shared)
