"""LmdbStore: a local, embedded, multi-process spill tier with FIFO high-water eviction.

Layout of the environment (one per directory, shared by all namespaces: keys are disjoint):
- sub-db "blocks": namespace id (8 bytes, may be empty) + 16-byte block key -> encoded entry
- sub-db "order":  8-byte big-endian insertion sequence -> block key (oldest first)
- sub-db "seq":    block key -> its 8-byte sequence (to delete its "order" record)
- sub-db "meta":   b"generation" -> 8-byte counter, bumped after each eviction

A full map is an error in LMDB, so writes evict ahead of time: when live pages + the batch
would pass `high_water` of the map, the oldest entries are deleted (in their own
transaction) down to `low_water`. Pages freed by transaction N are reusable only from
N + 2 on, so an eviction is followed by a tiny transaction on sub-db "meta" before the
write. A MapFullError that still happens triggers one forced eviction and retry, then the
batch is dropped and counted. Environments are shared per process and reopened (lazily)
in a forked child.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import lmdb

from kvstore.stores.base import Counters, SpillStore, StoreStats

T = TypeVar("T")
_DB_NAMES = (b"blocks", b"order", b"seq", b"meta")
_ENTRY_OVERHEAD = 64  # node header + "order"/"seq" records, per entry, in bytes (estimate)


@dataclass
class _SharedEnv:
    """One process's handle on an environment; LMDB forbids opening a path twice per process."""

    env: lmdb.Environment
    blocks: lmdb._Database
    order: lmdb._Database
    seq: lmdb._Database
    meta: lmdb._Database
    main: lmdb._Database
    pid: int
    refs: int = 1


_registry_lock = threading.Lock()
_open_envs: dict[str, _SharedEnv] = {}
_inherited: dict[str, lmdb.Environment] = {}  # opened by the parent before a fork


def _after_fork_in_child() -> None:
    global _registry_lock
    _registry_lock = threading.Lock()
    _inherited.update((path, shared.env) for path, shared in _open_envs.items())
    _open_envs.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _open_env(path: str, map_size_bytes: int) -> _SharedEnv:
    os.makedirs(path, exist_ok=True)
    env = lmdb.open(
        path,
        map_size=map_size_bytes,
        subdir=True,
        max_dbs=len(_DB_NAMES),
        sync=False,
        metasync=False,
        readahead=False,
        lock=True,
    )
    env.reader_check()  # clear reader slots left by dead processes
    blocks, order, seq, meta = (env.open_db(name) for name in _DB_NAMES)
    return _SharedEnv(env, blocks, order, seq, meta, env.open_db(), os.getpid())


def _acquire(path: str, map_size_bytes: int) -> _SharedEnv:
    with _registry_lock:
        shared = _open_envs.get(path)
        if shared is not None:
            shared.refs += 1
            return shared
        inherited = _inherited.pop(path, None)
        if inherited is not None:
            # The binding refuses a second open of the same files until the inherited handle
            # is closed. Closing it also frees the parent's reader slots; a parent read racing
            # with this can then see recycled pages, which entry checksums turn into a miss.
            inherited.close()
        shared = _open_envs[path] = _open_env(path, map_size_bytes)
        return shared


def _release(path: str, shared: _SharedEnv) -> None:
    with _registry_lock:
        if shared.pid != os.getpid() or _open_envs.get(path) is not shared:
            return
        shared.refs -= 1
        if shared.refs == 0:
            del _open_envs[path]
            shared.env.close()


class LmdbStore(SpillStore):
    """Spill tier in an LMDB environment at `path` (a directory), bounded by its map size."""

    name = "lmdb"
    copies_values = True

    def __init__(
        self,
        path: str,
        map_size_bytes: int,
        high_water: float = 0.9,
        low_water: float = 0.8,
        namespace_id: bytes = b"",
    ):
        """`namespace_id` prefixes every key, so `clear` can drop one namespace's entries."""
        if not 0.0 < low_water < high_water <= 1.0:
            raise ValueError(f"need 0 < low_water < high_water <= 1, got {low_water}, {high_water}")
        if not isinstance(map_size_bytes, int) or map_size_bytes < 64 * 4096:
            raise ValueError(f"map_size_bytes must be an int >= 256 KiB, got {map_size_bytes!r}")
        self.path = os.path.realpath(path)
        self._prefix = namespace_id
        self.high_water, self.low_water = high_water, low_water
        self._requested_map_size = map_size_bytes
        self._counters = Counters()
        self._shared: _SharedEnv | None = _acquire(self.path, map_size_bytes)

    # --------------------------------------------------------------- environment

    def _handle(self) -> _SharedEnv:
        shared = self._shared
        if shared is None:
            raise RuntimeError(f"LmdbStore({self.path!r}) is closed")
        if shared.pid != os.getpid():  # forked: this process needs its own environment
            shared = self._shared = _acquire(self.path, self._requested_map_size)
        return shared

    def _run(self, fn: Callable[[_SharedEnv], T]) -> T:
        """Run `fn`, adopting a map grown by another process (MapResizedError) once."""
        shared = self._handle()
        try:
            return fn(shared)
        except lmdb.MapResizedError:
            shared.env.set_mapsize(0)
            return fn(shared)

    def _pages(self, shared: _SharedEnv) -> tuple[int, int]:
        """(page size, map size in pages)."""
        psize = shared.env.stat()["psize"]
        return psize, shared.env.info()["map_size"] // psize

    @staticmethod
    def _used_pages(txn: lmdb.Transaction, shared: _SharedEnv) -> int:
        total = 0
        for db in (shared.main, shared.blocks, shared.order, shared.seq, shared.meta):
            st = txn.stat(db)
            total += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        return total

    # --------------------------------------------------------------- reads

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        def count(shared: _SharedEnv) -> int:
            with shared.env.begin(db=shared.blocks, buffers=True) as txn:
                cursor = txn.cursor()
                for i, key in enumerate(keys):
                    if not cursor.set_key(self._prefix + key):
                        return i
                return len(keys)

        try:
            return self._run(count)
        except lmdb.Error:
            self._counters.add(errors=1)
            return 0

    def _fetch(self, keys: Sequence[bytes]) -> list[bytes | None]:
        def get(shared: _SharedEnv) -> list[bytes | None]:
            with shared.env.begin(db=shared.blocks) as txn:
                return [txn.get(self._prefix + key) for key in keys]

        try:
            values = self._run(get)
        except lmdb.Error:
            self._counters.add(errors=1)
            values = [None] * len(keys)
        return values

    @contextlib.contextmanager
    def read_prefix(self, keys: Sequence[bytes]) -> Iterator[Sequence[bytes | memoryview]]:
        """Zero-copy `get_prefix`: views into the map, held by a read transaction that ends
        with the `with` block (until then LMDB does not reuse their pages)."""
        try:
            txn = self._run(lambda shared: shared.env.begin(db=shared.blocks, buffers=True))
        except lmdb.Error:
            self._counters.add(errors=1, misses=len(keys))
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
        except lmdb.Error:
            self._counters.add(errors=1)
        return values

    # --------------------------------------------------------------- writes

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        if not items:
            return 0
        items = [(self._prefix + key, value) for key, value in items]
        psize, map_pages = self._pages(self._handle())
        max_batch = int((self.high_water - self.low_water) * map_pages)
        cost = [-(-(len(v) + _ENTRY_OVERHEAD) // psize) for _, v in items]
        too_big = sum(c > max_batch for c in cost)
        fits = [(item, c) for item, c in zip(items, cost, strict=True) if c <= max_batch]
        written = sum(self._put_batch(batch, need) for batch, need in _batches(fits, max_batch))
        self._counters.add(writes=written, dropped_writes=too_big)
        return written

    def _put_batch(self, batch: list[tuple[bytes, bytes]], need: int) -> int:
        for force_evict in (False, True):
            try:
                return self._run(
                    lambda shared, force=force_evict: self._write(shared, batch, need, force)
                )
            except lmdb.MapFullError:
                continue
            except lmdb.Error:
                self._counters.add(errors=1)
                break
        self._counters.add(dropped_writes=len(batch))
        return 0

    def _write(
        self, shared: _SharedEnv, batch: list[tuple[bytes, bytes]], need: int, force_evict: bool
    ) -> int:
        _, map_pages = self._pages(shared)
        txn = shared.env.begin(write=True)
        try:
            used = self._used_pages(txn, shared)
            if force_evict or used + need > self.high_water * map_pages:
                target = max(0, int(self.low_water * map_pages) - need)
                if force_evict:  # the map filled below the mark (free pages not yet reusable)
                    target = min(target, used // 2)
                self._evict(txn, shared, target)
                txn.commit()
                self._advance(shared)
                txn = shared.env.begin(write=True)
            written = self._insert(txn, shared, batch)
            txn.commit()
            return written
        finally:
            txn.abort()  # no-op after commit

    @staticmethod
    def _advance(shared: _SharedEnv) -> None:
        """Commit one tiny transaction: pages freed by transaction N are reusable from N + 2."""
        with shared.env.begin(write=True, db=shared.meta) as txn:
            generation = int.from_bytes(txn.get(b"generation", b""), "big") + 1
            txn.put(b"generation", generation.to_bytes(8, "big"))

    def _evict(self, txn: lmdb.Transaction, shared: _SharedEnv, target_pages: int) -> None:
        """Delete the oldest entries until live pages <= target_pages (FIFO)."""
        cursor = txn.cursor(db=shared.order)
        evicted = 0
        while self._used_pages(txn, shared) > target_pages and cursor.first():
            key = cursor.value()
            cursor.delete()
            txn.delete(key, db=shared.seq)
            txn.delete(key, db=shared.blocks)
            evicted += 1
        self._counters.add(evictions=evicted)

    @staticmethod
    def _insert(txn: lmdb.Transaction, shared: _SharedEnv, batch: list[tuple[bytes, bytes]]) -> int:
        cursor = txn.cursor(db=shared.order)
        seq = int.from_bytes(cursor.key(), "big") + 1 if cursor.last() else 0
        written = 0
        for key, value in batch:
            if not txn.put(key, value, db=shared.blocks, overwrite=False):
                continue  # already present
            seq_key = seq.to_bytes(8, "big")
            seq += 1
            txn.put(seq_key, key, db=shared.order, append=True)
            txn.put(key, seq_key, db=shared.seq)
            written += 1
        return written

    def delete(self, keys: Sequence[bytes]) -> int:
        def remove(shared: _SharedEnv) -> int:
            removed = 0
            with shared.env.begin(write=True) as txn:
                for key in keys:
                    removed += self._remove(txn, shared, self._prefix + key)
            return removed

        try:
            return self._run(remove) if keys else 0
        except lmdb.Error:
            self._counters.add(errors=1)
            return 0

    # --------------------------------------------------------------- admin

    def stats(self) -> StoreStats:
        def measure(shared: _SharedEnv) -> tuple[int, int]:
            with shared.env.begin() as txn:
                return txn.stat(shared.blocks)["entries"], self._used_pages(txn, shared)

        shared = self._handle()
        psize, map_pages = self._pages(shared)
        entries, used = self._run(measure)
        return self._stats(entries, used * psize, map_pages * psize)

    @staticmethod
    def _remove(txn: lmdb.Transaction, shared: _SharedEnv, full_key: bytes) -> int:
        seq_key = txn.pop(full_key, db=shared.seq)
        if seq_key is not None:
            txn.delete(seq_key, db=shared.order)
        return int(txn.delete(full_key, db=shared.blocks))

    def clear(self) -> int:
        """Delete this namespace's entries (every entry when the store has no namespace id)."""

        def drop_all(shared: _SharedEnv) -> int:
            with shared.env.begin(write=True) as txn:
                removed = txn.stat(shared.blocks)["entries"]
                for db in (shared.blocks, shared.order, shared.seq):
                    txn.drop(db, delete=False)
            return removed

        def drop_namespace(shared: _SharedEnv) -> int:
            with shared.env.begin(write=True) as txn:
                cursor, keys = txn.cursor(db=shared.blocks), []
                if cursor.set_range(self._prefix):
                    for key in cursor.iternext(values=False):
                        if not key.startswith(self._prefix):
                            break
                        keys.append(key)
                return sum(self._remove(txn, shared, key) for key in keys)

        return self._run(drop_namespace if self._prefix else drop_all)

    def close(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            _release(self.path, shared)


def _batches(
    items: list[tuple[tuple[bytes, bytes], int]], max_pages: int
) -> Iterator[tuple[list[tuple[bytes, bytes]], int]]:
    """Split (item, cost) pairs into batches of at most `max_pages` estimated pages."""
    batch: list[tuple[bytes, bytes]] = []
    need = 0
    for item, cost in items:
        if batch and need + cost > max_pages:
            yield batch, need
            batch, need = [], 0
        batch.append(item)
        need += cost
    if batch:
        yield batch, need
