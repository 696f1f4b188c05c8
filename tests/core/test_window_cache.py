"""A sliding-window cache (`PrefixCache(window=...)`) driven as an engine drives it: blocks
that slide out of a request's window are dropped, and a hit, a commit or a tier refills
around the holes without losing a reference or a block."""

from __future__ import annotations

import numpy as np
import pytest

from hashing import Namespace
from kvstore.block_tables import BlockTables, SeqBlocks
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig

BS, WINDOW = 4, 8  # a hit needs the 2 blocks before its point
NS = Namespace("window-model", "float32", 2, 2, 8, BS)


def window_cache(**config: object) -> PrefixCache:
    return PrefixCache(CacheConfig(block_size=BS, device_blocks=64, **config), NS, window=WINDOW)


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n).astype(np.uint32)


def decode(tables: BlockTables, ids: np.ndarray, prompt: int) -> SeqBlocks:
    """Prefill `prompt` tokens, then one token a step to len(ids), as the engine does."""
    seq = tables.open(ids[:prompt], "", "")
    for n in range(prompt, len(ids) + 1):
        assert tables.grow(seq, n)
        if n // BS > seq.num_committed:
            tables.commit(seq, ids[:n], n)
        tables.slide(seq, n)
    return seq


def prefilled(n: int) -> tuple[PrefixCache, BlockTables, np.ndarray, SeqBlocks]:
    """A window cache and a request that prefilled and committed n tokens (no slide yet)."""
    cache = window_cache()
    tables = BlockTables(cache)
    ids = tokens(n)
    seq = tables.open(ids, "", "")
    assert tables.grow(seq, n)
    tables.commit(seq, ids, n)
    return cache, tables, ids, seq


def refs(cache: PrefixCache, ids: list[int | None]) -> list[int]:
    return [int(cache.pool.ref_cnt[b]) for b in ids if b is not None]


def test_a_hit_keeps_its_window_while_another_request_drops_those_blocks() -> None:
    cache, tables, a_ids, a = prefilled(48)
    hit = cache.lookup(np.concatenate([a_ids[:24], [7, 7, 7]]).astype(np.uint32))
    assert hit.block_ids == [None] * 4 + a.block_table[4:6]
    assert refs(cache, hit.block_ids) == [3, 3]  # the index, a's table, the hit
    tables.slide(a, 48)  # a lets go of 0..9, the index of 0..8 (9..11 end a's prompt)
    assert refs(cache, hit.block_ids) == [1, 1]  # the hit's own: not on the free list
    cache.release(hit)
    tables.close(a)
    cache.check_integrity()
    assert (cache.index.num_cached_blocks, cache.pool.num_free_blocks) == (3, 61)


def test_a_commit_that_fills_holes_before_its_start_takes_the_index_reference() -> None:
    cache, tables, a_ids, a = prefilled(48)
    b_ids = np.concatenate([a_ids[:24], tokens(5, seed=1)])
    b = tables.open(b_ids, "", "")  # holds blocks 4, 5
    tables.slide(a, 48)  # punches them in the index: b's commit fills the holes back
    assert tables.grow(b, 29)
    tables.commit(b, b_ids, 28)
    cache.check_integrity()
    assert cache.index.path_block_ids(b.node)[4:6] == b.block_table[4:6]
    tables.slide(b, 40)
    tables.close(b)
    tables.close(a)
    cache.check_integrity()
    assert dict(cache.tenants.blocks) == {"": cache.index.num_cached_blocks}


def test_the_tiers_fill_the_holes_of_a_window_the_device_dropped() -> None:
    cache = window_cache(memory_cache_gb=0.01, memory_write_policy="write-through")
    tables = BlockTables(cache)
    ids = tokens(80)
    tables.close(decode(tables, ids, 48))
    assert cache.flush(10)
    branch = np.concatenate([ids[:32], np.arange(5000, 5009, dtype=np.uint32)])
    hit = cache.lookup(branch)  # blocks 6, 7 were dropped on the device; memory has them
    assert (hit.num_cached_tokens, hit.tier_tokens) == (32, {"device": 24, "memory": 8})
    cache.release(hit)
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("chunk_blocks", [1, 2])
def test_write_back_tiers_get_every_dropped_block_in_whole_chunks(chunk_blocks: int) -> None:
    cache = window_cache(memory_cache_gb=0.01, chunk_blocks=chunk_blocks)  # write-back
    tables = BlockTables(cache)
    ids = tokens(80)
    tables.close(decode(tables, ids, 8))
    cache.evict_device()
    assert cache.flush(10)
    hit = cache.lookup(ids[:41])
    assert (hit.num_cached_tokens, hit.tier_tokens) == (40, {"memory": 40})
    cache.release(hit)
    cache.close()
