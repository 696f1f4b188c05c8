"""MemoryStore: round trips through host RAM, capacity-bounded LRU/FIFO eviction."""

from __future__ import annotations

import pytest
import torch
from tier_helpers import assert_same_entry, make_chain, namespace

from kvstore.stores import MemoryStore


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_memory_store_round_trips_entries_bit_exact(dtype: torch.dtype) -> None:
    chain = make_chain(namespace(dtype), num_blocks=4)
    store = MemoryStore(capacity_bytes=1 << 20)
    assert store.put_many(chain.items) == 4
    assert store.put_many(chain.items) == 0  # present keys are skipped
    assert store.count_prefix(chain.keys) == 4
    for i, data in enumerate(store.get_many(chain.keys)):
        assert data is not None
        assert_same_entry(chain.decode(i, data), chain.entries[i])
    s = store.stats()
    assert (s.entries, s.bytes, s.hits, s.misses, s.writes) == (
        4, sum(map(len, chain.encoded)), 4, 0, 4
    )  # fmt: skip


def test_memory_store_keeps_independent_copies() -> None:
    store = MemoryStore(capacity_bytes=1024)
    buf = bytearray(b"abc")
    store.put_many([(b"k" * 16, buf)])
    buf[0] = ord("x")
    assert store.get_many([b"k" * 16]) == [b"abc"]


def test_memory_store_counts_the_prefix_up_to_the_first_gap() -> None:
    chain = make_chain(namespace(), num_blocks=5)
    store = MemoryStore(capacity_bytes=1 << 20)
    store.put_many([chain.items[i] for i in (0, 1, 3, 4)])
    assert store.count_prefix(chain.keys) == 2
    assert store.get_prefix(chain.keys) == chain.encoded[:2]
    assert store.get_many(chain.keys)[2] is None
    assert store.count_prefix([]) == 0


def test_memory_store_evicts_least_recently_used_first() -> None:
    store = MemoryStore(capacity_bytes=300)
    items = [(bytes([i]) * 16, bytes([i]) * 100) for i in range(4)]
    store.put_many(items[:3])
    store.get_many([items[0][0]])  # 0 is now the most recent
    assert store.put_many([items[3]]) == 1
    assert [v is not None for v in store.get_many([k for k, _ in items])] == [
        True, False, True, True
    ]  # fmt: skip
    assert store.stats().evictions == 1


def test_memory_store_fifo_ignores_hits() -> None:
    store = MemoryStore(capacity_bytes=300, policy="fifo")
    items = [(bytes([i]) * 16, bytes([i]) * 100) for i in range(4)]
    store.put_many(items[:3])
    store.get_many([items[0][0]])
    store.put_many([items[3]])
    assert [v is not None for v in store.get_many([k for k, _ in items])] == [
        False, True, True, True
    ]  # fmt: skip


def test_memory_store_drops_values_larger_than_capacity() -> None:
    store = MemoryStore(capacity_bytes=100)
    assert store.put_many([(b"a" * 16, b"x" * 101), (b"b" * 16, b"y" * 100)]) == 1
    s = store.stats()
    assert (s.entries, s.bytes, s.dropped_writes, s.evictions) == (1, 100, 1, 0)


def test_memory_store_reject_deletes_and_counts_verify_failures() -> None:
    chain = make_chain(namespace(), num_blocks=3)
    store = MemoryStore(capacity_bytes=1 << 20)
    store.put_many(chain.items)
    assert store.reject(chain.keys[1:]) == 2
    assert store.delete(chain.keys) == 1
    s = store.stats()
    assert (s.entries, s.bytes, s.verify_failures) == (0, 0, 2)


def test_memory_store_clear_and_close_empty_it() -> None:
    chain = make_chain(namespace(), num_blocks=3)
    with MemoryStore(capacity_bytes=1 << 20) as store:
        store.put_many(chain.items)
        assert store.clear() == 3
        assert store.count_prefix(chain.keys) == 0


def test_memory_store_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        MemoryStore(capacity_bytes=0)
    with pytest.raises(ValueError, match="policy"):
        MemoryStore(capacity_bytes=10, policy="random")
