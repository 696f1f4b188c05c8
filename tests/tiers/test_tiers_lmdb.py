"""LmdbStore on real LMDB environments in tmp dirs: round trips, FIFO high-water eviction,
full maps, fork safety, maps grown by another process."""

from __future__ import annotations

import multiprocessing as mp
import random
from pathlib import Path

import pytest
import torch
from tier_helpers import assert_same_entry, make_chain, namespace, run_in_threads

from kvstore.stores import LmdbStore

MAP_BYTES = 1 << 20  # 256 pages of 4 KiB
# 32 KiB of fp32 KV per block: one entry takes 9 pages
BIG = dict(layers=2, kv_heads=2, head_dim=64, block_size=16)

fork = mp.get_context("fork")


def present(store: LmdbStore, keys: list[bytes]) -> list[bool]:
    return [v is not None for v in store.get_many(keys)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("codec", ["none", "lz4"])
def test_lmdb_store_round_trips_entries_bit_exact(
    tmp_path: Path, dtype: torch.dtype, codec: str
) -> None:
    chain = make_chain(namespace(dtype), num_blocks=4, codec=codec)
    with LmdbStore(str(tmp_path / "db"), MAP_BYTES) as store:
        assert store.put_many(chain.items) == 4
        assert store.put_many(chain.items[:2]) == 0  # present keys are skipped
        assert store.count_prefix(chain.keys) == 4
        for i, data in enumerate(store.get_many(chain.keys)):
            assert data is not None
            assert_same_entry(chain.decode(i, data), chain.entries[i])
        s = store.stats()
        assert (s.entries, s.hits, s.misses, s.writes, s.dropped_writes) == (4, 4, 0, 4, 0)


def test_lmdb_store_persists_across_reopen(tmp_path: Path) -> None:
    chain = make_chain(namespace(), num_blocks=3)
    with LmdbStore(str(tmp_path / "db"), MAP_BYTES) as store:
        store.put_many(chain.items)
    with LmdbStore(str(tmp_path / "db"), MAP_BYTES) as store:
        assert store.get_many(chain.keys) == chain.encoded


def test_lmdb_store_counts_the_prefix_up_to_the_first_gap(tmp_path: Path) -> None:
    chain = make_chain(namespace(), num_blocks=5)
    with LmdbStore(str(tmp_path / "db"), MAP_BYTES) as store:
        store.put_many(chain.items)
        assert store.delete([chain.keys[2], b"\x00" * 16]) == 1
        assert store.count_prefix(chain.keys) == 2
        assert store.get_prefix(chain.keys) == chain.encoded[:2]
        assert store.reject(chain.keys[:1]) == 1
        assert store.count_prefix(chain.keys) == 0
        s = store.stats()
        assert (s.entries, s.verify_failures) == (3, 1)


def test_lmdb_store_evicts_oldest_first_at_the_high_water_mark(tmp_path: Path) -> None:
    chain = make_chain(namespace(**BIG), num_blocks=80)
    with LmdbStore(str(tmp_path / "db"), MAP_BYTES) as store:
        written = sum(store.put_many([item]) for item in chain.items[:40])
        written += sum(store.put_many(chain.items[i : i + 7]) for i in range(40, 80, 7))
        s = store.stats()
        assert (written, s.writes, s.dropped_writes, s.errors) == (80, 80, 0, 0)
        assert s.entries + s.evictions == 80
        # FIFO: exactly the newest `entries` blocks survive
        assert present(store, chain.keys) == [False] * s.evictions + [True] * s.entries
        assert s.bytes <= 0.9 * MAP_BYTES
        assert s.entries == len([v for v in store.get_many(chain.keys) if v is not None])


@pytest.mark.parametrize(
    "value_bytes", [200, 2000, 5000], ids=["leaf", "near-overflow", "overflow"]
)
@pytest.mark.parametrize("batch", [8, 64])
def test_a_small_map_keeps_taking_writes_of_any_entry_size(
    tmp_path: Path, value_bytes: int, batch: int
) -> None:
    # copy-on-write needs pages the live count does not show: without that reserve a 1 MiB
    # map of small entries filled up and dropped every write after the first ~2000
    rng = random.Random(value_bytes * batch)
    items = [(rng.randbytes(16), rng.randbytes(value_bytes)) for _ in range(40 * 64)]
    with LmdbStore(str(tmp_path / "db"), MAP_BYTES) as store:
        written = sum(store.put_many(items[i : i + batch]) for i in range(0, len(items), batch))
        s = store.stats()
        assert (written, s.writes, s.dropped_writes, s.errors) == (2560, 2560, 0, 0)
        assert s.entries + s.evictions == 2560
        keys = [k for k, _ in items]
        assert present(store, keys) == [False] * s.evictions + [True] * s.entries  # FIFO
        # the reserve is bounded by a batch's budget: eviction keeps the map well used
        assert 0.5 * MAP_BYTES <= s.bytes <= 0.9 * MAP_BYTES


def test_lmdb_store_drops_an_entry_too_big_for_the_map_and_keeps_serving(tmp_path: Path) -> None:
    chain = make_chain(namespace(**BIG), num_blocks=2)
    with LmdbStore(str(tmp_path / "db"), MAP_BYTES) as store:
        store.put_many(chain.items[:1])
        huge = (b"h" * 16, b"x" * (MAP_BYTES // 8))  # over the 10% a single batch may take
        assert store.put_many([huge, chain.items[1]]) == 1
        s = store.stats()
        assert (s.dropped_writes, s.entries, s.errors) == (1, 2, 0)
        assert store.get_many(chain.keys) == chain.encoded


def _hold_reader(path: str, ready, release) -> None:
    store = LmdbStore(path, MAP_BYTES)
    txn = store._handle().env.begin()  # a long reader pins every page it can see
    txn.get(b"x" * 16)
    ready.set()
    release.wait(30)
    txn.abort()
    store.close()


def test_lmdb_full_map_drops_writes_while_a_reader_pins_pages(tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    chain = make_chain(namespace(**BIG), num_blocks=60)
    store = LmdbStore(path, MAP_BYTES)
    store.put_many(chain.items[:20])
    ready, release = fork.Event(), fork.Event()
    child = fork.Process(target=_hold_reader, args=(path, ready, release))
    child.start()
    try:
        assert ready.wait(30)
        results = [store.put_many([item]) for item in chain.items[20:50]]  # never raises
        s = store.stats()
        assert s.entries == store.count_prefix(chain.keys[s.evictions : 50])  # still serving
    finally:
        release.set()
        child.join(30)
    assert 0 in results and set(results) == {0, 1}
    assert (s.dropped_writes, s.writes, s.errors) == (results.count(0), 20 + results.count(1), 0)
    # the reader is gone: the same map takes writes again
    assert [store.put_many([item]) for item in chain.items[50:60]] == [1] * 10
    assert store.count_prefix(chain.keys[50:60]) == 10
    store.close()


def _write_in_child(
    store: LmdbStore, items: list[tuple[bytes, bytes]], first_key: bytes, q
) -> None:
    seen = store.get_many([first_key])[0] is not None
    q.put((seen, store.put_many(items)))


def test_lmdb_store_reopens_its_environment_after_fork(tmp_path: Path) -> None:
    chain = make_chain(namespace(), num_blocks=4)
    store = LmdbStore(str(tmp_path / "db"), MAP_BYTES)
    store.put_many(chain.items[:1])
    q = fork.Queue()
    child = fork.Process(target=_write_in_child, args=(store, chain.items[1:], chain.keys[0], q))
    child.start()
    seen, written = q.get(timeout=30)
    child.join(30)
    assert (child.exitcode, seen, written) == (0, True, 3)
    assert store.get_many(chain.keys) == chain.encoded  # the parent reads the child's writes
    assert store.put_many(chain.items) == 0
    store.close()


def _grow_map(path: str, items: list[tuple[bytes, bytes]], q) -> None:
    with LmdbStore(path, 4 * MAP_BYTES) as store:
        q.put(store.put_many(items))


def test_lmdb_store_adopts_a_map_grown_by_another_process(tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    chain = make_chain(namespace(**BIG), num_blocks=50)
    store = LmdbStore(path, MAP_BYTES)
    store.put_many(chain.items[:1])
    q = fork.Queue()
    child = fork.Process(target=_grow_map, args=(path, chain.items[1:], q))
    child.start()
    assert q.get(timeout=30) == 49
    child.join(30)
    # 50 entries of 9 pages no longer fit the old 1 MiB map: reading them needs the new size
    assert store.count_prefix(chain.keys) == 50
    assert store.get_many(chain.keys) == chain.encoded
    s = store.stats()
    assert (s.capacity_bytes, s.entries, s.errors) == (4 * MAP_BYTES, 50, 0)
    store.close()


def test_two_stores_on_one_path_share_the_environment(tmp_path: Path) -> None:
    chain = make_chain(namespace(), num_blocks=2)
    a = LmdbStore(str(tmp_path / "db"), MAP_BYTES)
    b = LmdbStore(str(tmp_path / "db"), MAP_BYTES)
    assert a._handle().env is b._handle().env
    a.put_many(chain.items)
    a.close()
    assert b.get_many(chain.keys) == chain.encoded
    assert b.clear() == 2
    assert b.count_prefix(chain.keys) == 0
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.get_many(chain.keys)


def test_lmdb_store_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="low_water"):
        LmdbStore(str(tmp_path / "db"), MAP_BYTES, high_water=0.5, low_water=0.6)
    with pytest.raises(ValueError, match="map_size_bytes"):
        LmdbStore(str(tmp_path / "db"), 1000)


def test_lmdb_store_serves_concurrent_readers_and_writers(tmp_path: Path) -> None:
    chains = [make_chain(namespace(), num_blocks=40, seed=s) for s in range(4)]
    store = LmdbStore(str(tmp_path / "db"), 8 * MAP_BYTES)
    written = [0] * 4

    def work(t: int) -> None:
        for i in range(0, 40, 4):
            written[t] += store.put_many(chains[t].items[i : i + 4])
            assert store.count_prefix(chains[t].keys) == i + 4
            store.get_many(chains[(t + 1) % 4].keys[:8])

    assert run_in_threads(work) == []
    assert written == [40] * 4
    s = store.stats()
    assert (s.entries, s.writes, s.errors, s.dropped_writes) == (160, 160, 0, 0)
    assert s.hits + s.misses == 4 * 10 * 8
    store.close()


def test_lmdb_clear_drops_only_its_own_namespace(tmp_path: Path) -> None:
    a = LmdbStore(str(tmp_path), 2**24, namespace_id=b"\x01" * 8)
    b = LmdbStore(str(tmp_path), 2**24, namespace_id=b"\x02" * 8)
    keys = [bytes([i]) * 16 for i in range(5)]
    assert a.put_many([(k, b"a" * 100) for k in keys]) == 5
    assert b.put_many([(k, b"b" * 100) for k in keys[:3]]) == 3  # same keys, other namespace
    assert a.get_many(keys[:1]) == [b"a" * 100] and b.get_many(keys[:1]) == [b"b" * 100]
    assert a.clear() == 5
    assert a.get_many(keys) == [None] * 5
    assert b.get_many(keys) == [b"b" * 100] * 3 + [None] * 2
    assert b.stats().entries == 3
    a.close()
    b.close()
