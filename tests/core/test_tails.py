"""Tails: a finished request's partly filled last block is kept, and a request that goes on
from its tokens gets them cached (copied into a block of its own, byte for byte)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hashing import Namespace
from kvstore.block_tables import BlockTables, SeqBlocks
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig, ConfigError

BS = 4
NS = Namespace("tail-model", "float32", 2, 2, 8, BS)


def make(blocks: int = 32, **config: object) -> tuple[PrefixCache, BlockTables]:
    cache = PrefixCache(CacheConfig(block_size=BS, device_blocks=blocks, **config), NS)
    return cache, BlockTables(cache)


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n).astype(np.uint32)


def computed(tables: BlockTables, ids: np.ndarray, salt: str = "") -> SeqBlocks:
    """A request that computed the K/V of every token of ids (random values written into its
    own blocks, as a forward would) and committed its full blocks."""
    seq = tables.open(ids, salt, "")
    assert tables.grow(seq, len(ids))
    gen = torch.Generator().manual_seed(int(ids[0]))
    for block in seq.block_table[seq.num_shared_blocks :]:
        shape = tables.pool.kv[block].shape
        tables.pool.kv[block] = torch.randn(shape, generator=gen)
    tables.commit(seq, ids, len(ids))
    return seq


def finished(tables: BlockTables, ids: np.ndarray, salt: str = "") -> torch.Tensor:
    """Run a request over ids to its end, keep its tail; returns the tail block's bytes."""
    seq = computed(tables, ids, salt)
    tail = tables.pool.kv[seq.block_table[len(ids) // BS]].clone()
    assert tables.keep_tail(seq, ids)
    tables.close(seq)
    return tail


def test_a_request_that_goes_on_from_a_finished_one_gets_its_partial_block() -> None:
    cache, tables = make()
    first = tokens(10)  # 2 full blocks and 2 tokens in the third
    tail = finished(tables, first)
    nxt = np.concatenate([first, tokens(5, seed=1)])
    seq = tables.open(nxt, "", "")
    assert (seq.num_shared_blocks, seq.num_cached_tokens) == (2, 10)
    assert seq.tier_tokens == {"device": 10}
    own = seq.block_table[2]  # a block of its own: it writes positions 10 and 11 there
    assert own not in cache.index.all_block_ids() and cache.pool.ref_cnt[own] == 1
    # every byte of the kept block came back (positions 8, 9 and the rest, masked)
    assert torch.equal(cache.pool.kv[own], tail)
    assert cache.metrics.get("tail_hits_tokens_total") == 2
    tables.close(seq)
    cache.check_integrity()


def test_only_the_tokens_the_prompt_repeats_are_taken() -> None:
    cache, tables = make()
    first = tokens(11)  # the tail holds positions 8, 9, 10
    finished(tables, first)
    nxt = np.concatenate([first[:9], [first[9] + 1], first[10:], tokens(4, seed=1)])
    seq = tables.open(nxt, "", "")
    assert seq.num_cached_tokens == 9  # 8 from the index, 1 (position 8) from the tail
    tables.close(seq)
    other = np.concatenate([first[:8], [first[8] + 1], tokens(4, seed=2)])
    seq = tables.open(other, "", "")  # differs at once: no tail, no block taken
    assert (seq.num_cached_tokens, len(seq.block_table)) == (8, 2)
    tables.close(seq)
    cache.check_integrity()


def test_a_tail_is_not_found_under_another_salt_or_after_another_prefix() -> None:
    cache, tables = make()
    first = tokens(10)
    finished(tables, first, salt="tenant-a")
    seq = tables.open(first, "tenant-b", "")
    assert seq.num_cached_tokens == 0
    tables.close(seq)
    moved = np.concatenate([first[:7], [first[7] + 1], first[8:]])  # same tail, other prefix
    seq = tables.open(moved, "tenant-a", "")
    assert seq.num_cached_tokens == 4
    tables.close(seq)
    seq = tables.open(first, "tenant-a", "")
    assert seq.num_cached_tokens == 10
    tables.close(seq)
    cache.check_integrity()


def test_the_tail_stays_for_every_request_that_goes_on_from_it() -> None:
    cache, tables = make()
    system = tokens(6)  # a shared prompt: 1 full block and a tail of 2
    finished(tables, system)
    seqs = [tables.open(np.concatenate([system, tokens(3, seed=s)]), "", "") for s in (1, 2, 3)]
    assert [s.num_cached_tokens for s in seqs] == [6, 6, 6]
    assert len({s.block_table[1] for s in seqs}) == 3  # three copies, one each
    for s in seqs:
        tables.close(s)
    assert len(cache.tails) == 1
    cache.check_integrity()


def test_tails_beyond_the_capacity_go_least_recently_used_first() -> None:
    cache, tables = make(tail_blocks=2)
    firsts = [tokens(5, seed=s) for s in range(3)]
    for ids in firsts[:2]:
        finished(tables, ids)
    seq = tables.open(firsts[0], "", "")  # a use: firsts[1]'s tail is now the oldest
    tables.close(seq)
    finished(tables, firsts[2])
    assert len(cache.tails) == 2
    got = []
    for ids in firsts:
        seq = tables.open(ids, "", "")
        got.append(seq.num_cached_tokens)
        tables.close(seq)
    assert got == [5, 4, 5]
    cache.check_integrity()


def test_a_full_pool_takes_tails_back_after_the_index_blocks() -> None:
    cache, tables = make(blocks=8, tail_blocks=4)
    finished(tables, tokens(5, seed=1))  # 1 cached block, 1 tail
    finished(tables, tokens(5, seed=2))
    assert (cache.pool.num_free_blocks, cache.held.num_available()) == (4, 8)
    seq = tables.open(tokens(24, seed=3), "", "")
    assert tables.grow(seq, 24)  # 6 blocks: 4 free, then the 2 cached ones, not the tails
    assert (len(cache.tails), cache.index.num_cached_blocks) == (2, 0)
    assert tables.grow(seq, 32)  # 2 more: only the tails are left
    assert len(cache.tails) == 0
    tables.close(seq)
    cache.check_integrity()


def test_no_tail_is_kept_for_a_request_whose_blocks_are_not_all_committed() -> None:
    cache, tables = make()
    ids = tokens(10)
    seq = tables.open(ids, "", "")
    assert tables.grow(seq, 10)
    tables.commit(seq, ids, 4)  # one of its two full blocks
    assert not tables.keep_tail(seq, ids)
    whole = tokens(8, seed=1)
    seq2 = computed(tables, whole)
    assert not tables.keep_tail(seq2, whole)  # no partial block: nothing to keep
    for s in (seq, seq2):
        tables.close(s)
    assert len(cache.tails) == 0
    cache.check_integrity()


def test_tails_are_off_for_a_window_cache_and_with_zero_blocks() -> None:
    window = PrefixCache(CacheConfig(block_size=BS, device_blocks=32), NS, window=8)
    assert window.tails.capacity == 0
    _, tables = make(tail_blocks=0)
    ids = tokens(6)
    seq = computed(tables, ids)
    assert not tables.keep_tail(seq, ids)
    tables.close(seq)
    assert make(blocks=320)[0].tails.capacity == 20  # the default: 1/16 of the pool


def test_evicting_the_device_drops_the_tails() -> None:
    cache, tables = make()
    finished(tables, tokens(6))
    cache.evict_device()
    assert (len(cache.tails), cache.pool.num_free_blocks) == (0, 32)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_a_bad_tail_blocks_setting_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="tail_blocks"):
        CacheConfig(tail_blocks=bad)  # type: ignore[arg-type]


def test_a_running_request_lends_its_partial_block_to_those_that_repeat_its_tokens() -> None:
    cache, tables = make(tail_blocks=0)  # lending needs no tail kept
    prompt = tokens(10)  # 2 full blocks and 2 tokens in the third
    lender = computed(tables, prompt)
    lent = tables.lend_tail(lender, len(prompt))
    block = lender.block_table[2]
    assert lent == (block, 8, 2) and cache.pool.ref_cnt[block] == 2  # no copy: a reference
    borrowers = [tables.open(np.concatenate([prompt, [7 + i]]), "", "", lent=lent)
                 for i in range(3)]  # fmt: skip
    for seq in borrowers:
        own = seq.block_table[2]  # a copy of its own, every byte of the lent block
        assert (seq.num_cached_tokens, cache.pool.ref_cnt[own]) == (10, 1)
        assert torch.equal(cache.pool.kv[own], cache.pool.kv[block])
    assert cache.metrics.get("tail_hits_tokens_total") == 3 * 2
    tables.return_lent(lent)
    assert cache.pool.ref_cnt[block] == 1  # the lender's again
    assert cache.held.num_reserved == 0  # (returning it once lowered the reserved count)
    for seq in [lender, *borrowers]:
        tables.close(seq)
    whole = computed(tables, tokens(12, seed=3))
    assert tables.lend_tail(whole, 12) is None  # whole blocks: nothing to lend
    tables.close(whole)
    cache.check_integrity()
