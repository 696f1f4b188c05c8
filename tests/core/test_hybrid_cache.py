"""A hybrid model's cache (`PrefixCache(window=..., window_layers=...)`): the window layers'
K/V in a window plane whose parts a block lets go of when no window sees it, while its full
layers stay; driven as an engine drives it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hashing import Namespace
from kvstore import QuantError
from kvstore.block_tables import BlockTables, SeqBlocks
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig, ConfigError
from kvstore.device.hybrid_pool import HybridPool, make_pool
from kvstore.device.pool import BlockPool, PoolExhausted
from kvstore.device.window_plane import WindowPlaneError

BS, WINDOW = 4, 8  # a hit needs the window parts of the 2 blocks before its point
LAYERS, WINDOW_LAYERS = 3, [0, 2]  # layer 1 attends to the whole prefix
NS = Namespace("hybrid-model", "float32", LAYERS, 2, 8, BS)


def hybrid_cache(blocks: int = 64, **config: object) -> PrefixCache:
    config = CacheConfig(block_size=BS, device_blocks=blocks, device="cpu", **config)
    return PrefixCache(config, NS, window=WINDOW, window_layers=WINDOW_LAYERS)


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n).astype(np.uint32)


def random_blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, LAYERS, 2, 2, BS, 8), generator=g)


def prefill(tables: BlockTables, ids: np.ndarray, seed: int = 0) -> SeqBlocks:
    """Open, grow, write every new block's K/V and commit all of ids, as a prefill does."""
    seq = tables.open(ids, "", "")
    assert tables.grow(seq, len(ids))
    new = seq.block_table[seq.num_shared_blocks :]
    tables.pool.write_blocks(new, random_blocks(len(new), seed))
    tables.commit(seq, ids, len(ids))
    return seq


def as_layer(blocks: torch.Tensor) -> torch.Tensor:
    """One layer's K (or V) of whole blocks [n, heads, BS, dim] -> [1, heads, n * BS, dim]."""
    n, heads, _, dim = blocks.shape
    return blocks.permute(1, 0, 2, 3).reshape(1, heads, n * BS, dim)


def decoded_past_its_window(cache: PrefixCache, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """A request that prefilled 48 tokens and slid to position 48 (it let go of the window
    parts of blocks 0..9, the index of 0..8: 9..11 are its prompt's window), then closed:
    its tokens and its 12 blocks' K/V as written."""
    tables = BlockTables(cache)
    ids = tokens(48)
    seq = prefill(tables, ids, seed)
    written = cache.pool.read_blocks(seq.block_table)
    cache.flush()  # (write-through tiers: written while every part is held)
    tables.slide(seq, 48)
    tables.close(seq)
    return ids, written


def slots_in_use(cache: PrefixCache) -> int:
    return cache.pool.window.num_slots - cache.pool.window.num_free


# --- the pool's two planes ------------------------------------------------------------------


def test_whole_blocks_round_trip_through_the_two_planes_byte_for_byte() -> None:
    pool = HybridPool(8, NS, torch.device("cpu"), WINDOW_LAYERS, num_window_slots=4)
    assert pool.kv.shape[1] == 1 and pool.window.kv.shape[:2] == (4, 2)
    ids = pool.allocate(3)
    blocks = random_blocks(3)
    pool.write_blocks(ids, blocks)
    assert torch.equal(pool.read_blocks(ids), blocks)
    assert torch.equal(pool.kv[ids][:, 0], blocks[:, 1])  # the full layer's part
    layers = pool.gather(ids)  # per layer [1, heads, 3 * BS, dim]
    assert torch.equal(layers[2][1][0, :, BS : 2 * BS], blocks[1, 2, 1])


def test_a_block_that_lets_go_of_its_window_part_frees_its_slot_and_reads_zeros_there() -> None:
    pool = HybridPool(8, NS, torch.device("cpu"), WINDOW_LAYERS, num_window_slots=2)
    ids = pool.allocate(2)
    with pytest.raises(PoolExhausted):  # the slots run out before the blocks
        pool.allocate(1)
    assert pool.num_free_blocks == 6 and pool.window.num_free == 0
    pool.write_blocks(ids, random_blocks(2))
    pool.incref(ids[:1])  # a second owner of block 0, with its window part
    assert pool.drop_window(ids[:1]) == 0  # the other owner still holds it
    assert pool.drop_window(ids[:1]) == 1
    assert pool.window.num_free == 1 and pool.whole(ids) == [None, ids[1]]
    with pytest.raises(WindowPlaneError, match="hold no window part"):
        pool.read_blocks(ids)
    read = pool.read_blocks(ids, window_from=1)  # what a hit whose window starts at 1 reads
    assert read[0, WINDOW_LAYERS].abs().sum() == 0 and read[0, 1].abs().sum() > 0
    pool.free(ids[:1], window=False)
    pool.free(ids[:1], window=False)
    pool.free(ids[1:])
    assert (pool.num_free_blocks, pool.window.num_free) == (8, 2)


def test_the_pool_budget_is_split_between_full_blocks_and_window_slots() -> None:
    # 2 KiB per layer and block here: a block costs 1 full layer + 0.5 x 2 window layers
    ns = Namespace("hybrid-model", "float32", LAYERS, 2, 16, 8)
    config = CacheConfig(block_size=8, device_cache_gb=100 * 4096 / 2**30, device="cpu")
    pool = make_pool(config, ns, WINDOW_LAYERS)
    assert (pool.num_blocks, pool.window.num_slots) == (100, 50)
    plain = BlockPool.from_config(config, ns)
    assert (plain.num_blocks, plain.window) == (66, None)


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, True, "half"])
def test_a_bad_window_share_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="window_share"):
        CacheConfig(window_share=bad)  # type: ignore[arg-type]


# --- hits, slides and the index ---------------------------------------------------------------


def test_a_request_decoding_past_its_window_holds_every_full_part_and_its_windows_parts() -> None:
    cache = hybrid_cache()
    tables = BlockTables(cache)
    ids = tokens(48)
    seq = prefill(tables, ids[:12])
    for n in range(12, 49):
        assert tables.grow(seq, n)
        if n // BS > seq.num_committed:
            tables.commit(seq, ids[:n], n)
        tables.slide(seq, n)
    # query 48 sees keys 41..48, blocks 10..12 (12 is not there yet): the request let go of
    # the window parts of blocks 0..9, the index of 3..9 (0..2: the prompt's window)
    assert (seq.num_window_dropped, len(seq.block_table)) == (10, 12)
    assert cache.index.num_cached_blocks == 12  # every full part stays cached
    assert cache.kind.windows.punched == set(seq.block_table[3:10])
    assert slots_in_use(cache) == 3 + 2  # blocks 0..2, and 10, 11
    cache.check_integrity()
    tables.close(seq)
    cache.check_integrity()
    assert slots_in_use(cache) == 3 + 2  # the index's now
    assert cache.metrics.get("windowed_out_blocks_total") == 7


def test_a_hit_ends_where_its_windows_parts_are_held_and_loads_the_cached_bytes() -> None:
    cache = hybrid_cache()
    ids, want = decoded_past_its_window(cache)
    # the whole prompt hits: the window before its end (blocks 10, 11) is held
    hit = cache.lookup(ids, whole_prompt=True)
    assert (hit.num_cached_tokens, hit.window_from) == (48, 10)
    kv = cache.load(hit)
    keys = want[:, :, 0].permute(1, 2, 0, 3, 4).reshape(LAYERS, 2, 48, 8)  # [layers, heads, ...]
    assert torch.equal(kv.layers[1][0][0], keys[1])  # the full layer: every position
    assert torch.equal(kv.layers[0][0][0, :, 40:], keys[0, :, 40:])  # a window layer: 10, 11
    assert kv.layers[0][0][0, :, :36].abs().sum() == 0  # no window sees blocks 0..8
    cache.release(hit)
    # a prompt that leaves this path after block 5 needs the window parts of blocks 4 and
    # 5, which are gone, and so are those of every earlier window (the prompt's window is
    # blocks 9..11): no hit
    other = np.concatenate([ids[:24], tokens(9, seed=3)])
    hit = cache.lookup(other)
    assert hit.num_cached_tokens == 0
    cache.release(hit)
    cache.check_integrity()


def test_a_recomputed_prefix_gives_the_cached_blocks_their_window_parts_back() -> None:
    cache = hybrid_cache()
    tables = BlockTables(cache)
    ids, _ = decoded_past_its_window(cache, seed=1)
    other = np.concatenate([ids[:24], tokens(9, seed=3)])
    b = prefill(tables, other, seed=2)  # misses (above), recomputes blocks 0..5, commits
    assert b.num_cached_tokens == 0
    # the index kept its own blocks 0..5 and copied b's window parts into them
    cached = cache.index.path_block_ids(b.node)
    assert all(cache.pool.window.held(cached[:8]))
    assert torch.equal(
        cache.pool.read_blocks(cached[4:6])[:, WINDOW_LAYERS],
        cache.pool.read_blocks(b.block_table[4:6])[:, WINDOW_LAYERS],
    )
    tables.close(b)
    hit = cache.lookup(np.concatenate([ids[:24], tokens(9, seed=4)]))
    assert hit.num_cached_tokens == 24
    cache.release(hit)
    cache.check_integrity()


def test_window_slots_run_short_and_come_back_from_the_index_before_any_block_is_evicted() -> None:
    cache = hybrid_cache(blocks=16, window_share=0.5)  # 8 window slots
    tables = BlockTables(cache)
    for seed in range(2):  # two prompts of 3 blocks: 6 slots held by the index
        tables.close(prefill(tables, tokens(12, seed=10 + seed)))
    assert (cache.index.num_cached_blocks, slots_in_use(cache)) == (6, 6)
    seq = tables.open(tokens(16, seed=20), "", "")
    assert tables.grow(seq, 16)  # 4 blocks: 2 slots free, 2 taken back from the index
    assert cache.index.num_cached_blocks == 6  # no full part evicted
    assert len(cache.kind.windows.punched) == 2 and slots_in_use(cache) == 8
    assert cache.metrics.get("evicted_blocks_total") == 0
    tables.close(seq)
    cache.check_integrity()


def test_a_hybrid_hit_cannot_be_copied_block_for_block() -> None:
    cache = hybrid_cache()
    tables = BlockTables(cache)
    ids = tokens(16)
    tables.close(prefill(tables, ids))
    hit = cache.lookup(ids)
    dst = torch.zeros((8, LAYERS, 2, 2, BS, 8))
    with pytest.raises(ValueError, match="sliding-window hit"):
        cache.load_into(hit, dst, list(range(8)))
    cache.release(hit)


# --- tiers ----------------------------------------------------------------------------------


def test_lmdb_gives_back_every_layer_of_a_block_whose_window_part_left_the_device(tmp_path) -> None:
    cache = hybrid_cache(lmdb_dir=str(tmp_path / "kv"))
    ids, want = decoded_past_its_window(cache, seed=5)
    cache.flush()
    assert cache.evict_device() == 12
    hit = cache.lookup(ids, whole_prompt=True)
    assert hit.tier_tokens == {"lmdb": 48}
    assert torch.equal(cache.pool.read_blocks(hit.block_ids), want)
    cache.release(hit)
    cache.check_integrity()
    cache.close()


def test_a_write_back_tier_gets_a_hybrid_models_blocks_whole_when_they_are_committed() -> None:
    cache = hybrid_cache(memory_cache_gb=0.01)  # write-back
    tables = BlockTables(cache)
    ids = tokens(48)
    seq = prefill(tables, ids, seed=6)
    want = cache.pool.read_blocks(seq.block_table)
    cache.flush()  # before blocks 0..8 lose their window parts, not at eviction
    assert cache.stats()["tiers"]["memory"]["entries"] == 12
    tables.slide(seq, 48)
    tables.close(seq)
    assert cache.evict_device() == 12
    cache.flush()
    assert cache.stats()["tiers"]["memory"]["writes"] == 12  # none again
    hit = cache.lookup(ids, whole_prompt=True)
    assert hit.tier_tokens == {"memory": 48}
    assert torch.equal(cache.pool.read_blocks(hit.block_ids), want)
    cache.release(hit)
    cache.close()


# --- short window slots, refills from a tier, bad arguments -------------------------------------


def test_short_window_slots_take_back_the_least_recently_hit_index_parts_and_evict_nothing() -> (
    None
):
    cache = hybrid_cache(blocks=32, window_share=0.25)  # 8 window slots
    tables = BlockTables(cache)
    a, b = tokens(12, seed=30), tokens(12, seed=31)
    seqs = [prefill(tables, ids) for ids in (a, b)]
    a_ids, b_ids = (list(seq.block_table) for seq in seqs)
    for seq in seqs:
        tables.close(seq)
    assert slots_in_use(cache) == 6  # 3 blocks each, the index's
    # a hit on a uses the window parts of its last 2 blocks: a's first goes before b's
    cache.release(cache.lookup(a, whole_prompt=True))
    got = cache.held.allocate(5)  # 2 free slots, 3 taken back: a's first, then b's
    assert len(got) == 5 and cache.kind.windows.punched == {a_ids[0], b_ids[0], b_ids[1]}
    assert cache.metrics.get("evicted_blocks_total") == 0
    hit = cache.lookup(a, whole_prompt=True)
    assert hit.num_cached_tokens == 12
    cache.release(hit)
    cache.held.free(got)
    cache.check_integrity()


def test_blocks_without_window_parts_are_given_them_all_or_none() -> None:
    cache = hybrid_cache(blocks=32, window_share=0.25)  # 8 window slots
    tables = BlockTables(cache)
    seq = tables.open(tokens(80), "", "")
    # 20 blocks of full parts, window parts for the first chunk only (16 tokens)
    assert tables.grow(seq, 80, compute_to=16)
    assert (len(seq.block_table), seq.num_window_end, slots_in_use(cache)) == (20, 4, 4)
    assert not tables.grow(seq, 80, compute_to=48)  # 12 window parts: 4 free slots
    assert (seq.num_window_end, slots_in_use(cache)) == (4, 4)  # nothing taken
    assert tables.grow(seq, 80, compute_to=32)
    assert (seq.num_window_end, slots_in_use(cache)) == (8, 8)
    tables.close(seq)
    assert (cache.pool.num_free_blocks, slots_in_use(cache)) == (32, 0)
    assert cache.metrics.get("evicted_blocks_total") == 0


def test_a_tier_gives_back_window_parts_the_device_let_go_of(tmp_path) -> None:
    cache = hybrid_cache(lmdb_dir=str(tmp_path / "kv"))
    ids, written = decoded_past_its_window(cache, seed=7)  # 0..8 lose theirs on the device
    want = written[4:6]
    # a prompt leaving the path after block 5 needs 4's and 5's: LMDB has them whole
    hit = cache.lookup(np.concatenate([ids[:24], tokens(9, seed=3)]))
    assert (hit.num_cached_tokens, hit.tier_tokens) == (24, {"device": 16, "lmdb": 8})
    assert torch.equal(cache.pool.read_blocks(hit.block_ids[4:6]), want)
    assert hit.block_ids == cache.index.path_block_ids(hit.node)[:6]  # the cached blocks
    cache.release(hit)
    cache.check_integrity()
    cache.close()


def test_window_layers_that_are_every_layer_are_refused() -> None:
    config = CacheConfig(block_size=BS, device_blocks=8, device="cpu")
    with pytest.raises(ValueError, match="window-only model"):
        PrefixCache(config, NS, window=WINDOW, window_layers=[0, 1, 2])
    with pytest.raises(ValueError, match="needs the window"):
        PrefixCache(config, NS, window_layers=[0])


def test_a_hit_cut_short_unlocks_the_blocks_it_cannot_use() -> None:
    cache = hybrid_cache()
    ids, _ = decoded_past_its_window(cache)
    assert cache.index.num_evictable_blocks == 12
    hit = cache.lookup(np.concatenate([ids[:24], tokens(9, seed=3)]))  # cut to 0 (above)
    assert (hit.num_cached_tokens, hit.block_ids) == (0, [])
    assert cache.index.num_evictable_blocks == 12  # its 6 matched blocks are not locked
    cache.release(hit)
    cache.check_integrity()


def test_a_commit_refills_window_parts_even_when_the_index_holds_every_slot() -> None:
    cache = hybrid_cache(blocks=40, window_share=0.5)  # 20 window slots
    tables = BlockTables(cache)
    ids, _ = decoded_past_its_window(cache, seed=1)
    for seed in range(3):  # other prompts' window parts fill the plane
        tables.close(prefill(tables, tokens(20, seed=40 + seed)))
    assert cache.pool.window.num_free == 20 - 3 - 15
    other = np.concatenate([ids[:24], tokens(9, seed=3)])
    b = prefill(tables, other, seed=2)  # recomputes 0..5: their window parts come back
    assert not cache.kind.windows.punched & set(cache.index.path_block_ids(b.node)[:6])
    tables.close(b)
    hit = cache.lookup(np.concatenate([ids[:24], tokens(9, seed=4)]))
    assert hit.num_cached_tokens == 24
    cache.release(hit)
    cache.check_integrity()


def test_store_refills_the_window_parts_of_a_cached_prefix_from_the_callers_kv() -> None:
    cache = hybrid_cache()
    ids, want = decoded_past_its_window(cache, seed=8)
    prefix = np.concatenate([ids[:24], tokens(9, seed=3)])
    assert cache.peek(prefix) == 0
    layers = [tuple(as_layer(want[:, i, kv]) for kv in (0, 1)) for i in range(LAYERS)]
    assert cache.store(ids, layers) == 0  # every block is cached: none new
    assert cache.peek(prefix) == 24  # and blocks 0..8 hold their window parts again
    hit = cache.lookup(prefix)
    assert torch.equal(cache.pool.read_blocks(hit.block_ids), want[:6])
    cache.release(hit)
    cache.check_integrity()


def test_a_quantized_refill_refused_for_a_nan_leaves_its_block_punched_and_slotless() -> None:
    """store() refills punched blocks in order; a NaN in block 2's K/V stops it there: blocks
    0 and 1 hold their window parts again, block 2 none (not a slot of unwritten bytes), and
    the same K/V made finite refill it."""
    cache = hybrid_cache(kv_cache_dtype="int8")
    tables = BlockTables(cache)
    ids = tokens(48)
    seq = tables.open(ids, "", "")
    assert tables.grow(seq, len(ids))
    g = torch.Generator().manual_seed(9)
    layers = [tuple(torch.randn(1, 2, 48, 8, generator=g) for _ in "kv") for _ in range(LAYERS)]
    cache.pool.scatter(seq.block_table, layers)
    tables.commit(seq, ids, len(ids))
    path = cache.index.path_block_ids(seq.node)
    tables.slide(seq, 48)
    tables.close(seq)
    used = slots_in_use(cache)
    assert cache.kind.windows.punched == set(path[:9])
    bad = [(k.clone(), v.clone()) for k, v in layers]
    bad[0][0][0, 0, 2 * BS + 1, 0] = float("nan")  # block 2, window layer 0's K
    with pytest.raises(QuantError, match="inf or a NaN"):
        cache.store(ids, bad)
    assert cache.kind.windows.punched == set(path[2:9])
    assert slots_in_use(cache) == used + 2
    assert list(cache.pool.window.held(path[:3])) == [True, True, False]
    prefix = np.concatenate([ids[:24], tokens(9, seed=3)])
    assert cache.peek(prefix) == 2 * BS  # a hit through block 2 would read unwritten bytes
    cache.check_integrity()
    assert cache.store(ids, layers) == 0
    assert cache.peek(prefix) == 24
    cache.check_integrity()
