import pytest
import torch

from hashing import Namespace
from kvstore.config import CacheConfig
from kvstore.device.pool import BlockPool, PoolExhausted, bytes_per_block, pool_blocks

LAYERS, HEADS, BS, DIM = 3, 2, 4, 8


def make_pool(dtype: str, num_blocks: int = 8) -> BlockPool:
    ns = Namespace("fp", dtype, LAYERS, HEADS, DIM, BS)
    return BlockPool(num_blocks, ns, torch.device("cpu"))


def random_kv(num_tokens: int, dtype: torch.dtype, seed: int = 0) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    shape = (1, HEADS, num_tokens, DIM)
    return [
        (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
        for _ in range(LAYERS)
    ]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_scatter_then_gather_is_bit_exact(dtype):
    pool = make_pool(dtype)
    kv = random_kv(3 * BS, pool.dtype)
    ids = [5, 1, 6]  # deliberately out of order
    pool.scatter(ids, kv)
    out = pool.gather(ids)
    assert len(out) == LAYERS
    for (k, v), (k2, v2) in zip(kv, out, strict=True):
        assert k2.shape == (1, HEADS, 3 * BS, DIM)
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_scatter_with_start_token_writes_only_the_suffix_blocks():
    pool = make_pool("float32")
    kv = random_kv(4 * BS, torch.float32)
    pool.scatter([2, 3], kv, start_token=2 * BS)
    out = pool.gather([2, 3])
    for (k, v), (k2, v2) in zip(kv, out, strict=True):
        assert torch.equal(k[:, :, 2 * BS :], k2) and torch.equal(v[:, :, 2 * BS :], v2)


def test_scatter_rejects_kv_shorter_than_the_blocks():
    pool = make_pool("float32")
    with pytest.raises(ValueError, match="need"):
        pool.scatter([0, 1], random_kv(BS + 1, torch.float32))


def test_read_and_write_blocks_round_trip_as_independent_copies():
    pool = make_pool("bfloat16")
    pool.scatter([0, 4], random_kv(2 * BS, pool.dtype))
    blocks = pool.read_blocks([0, 4])
    assert blocks.shape == (2, LAYERS, 2, HEADS, BS, DIM)
    pool.kv[0].zero_()  # the copy must not alias the pool
    pool.write_blocks([7, 0], blocks)
    assert torch.equal(pool.kv[7], blocks[0]) and torch.equal(pool.kv[0], blocks[1])


def test_allocate_free_and_ref_counts():
    pool = make_pool("float32", num_blocks=4)
    ids = pool.allocate(3)
    assert ids == [0, 1, 2] and pool.num_free_blocks == 1
    pool.incref([1])
    pool.free(ids)
    assert pool.num_free_blocks == 3 and pool.ref_cnt.tolist() == [0, 1, 0, 0]
    with pytest.raises(PoolExhausted):
        pool.allocate(4)
    pool.free([1])
    with pytest.raises(ValueError, match="double free"):
        pool.free([1])
    assert pool.num_free_blocks == 4


def test_pool_is_sized_in_blocks_or_bytes():
    ns = Namespace("fp", "float16", LAYERS, HEADS, DIM, BS)
    per_block = LAYERS * 2 * HEADS * BS * DIM * 2
    assert bytes_per_block(ns) == per_block
    assert pool_blocks(CacheConfig(block_size=BS, device_blocks=7), ns) == 7
    gb = 100 * per_block / 2**30
    assert pool_blocks(CacheConfig(block_size=BS, device_cache_gb=gb), ns) == 100


def test_a_host_staged_pool_takes_tier_bytes_in_one_transfer_and_in_place_ones_at_once():
    pool = make_pool("float32")
    pool.stages_on_host = True  # as a GPU pool: reads land in host staging first
    blocks = torch.randn(3, *pool.layout.block_shape)
    raw = [memoryview(block.numpy()).cast("B") for block in blocks]
    pool.zero([6, 2, 3])
    with pool.staged_reads(2) as stage:
        staged = stage.destinations([6, 2])
        for view, data in zip(staged, raw[:2], strict=True):
            view[:] = data
        assert not pool.read_blocks([6, 2]).any()  # not in the pool yet
        stage.upload([6, 2], 0)
    assert torch.equal(pool.read_blocks([6, 2]), blocks[:2])
    assert pool.num_transfers == 1
    (own,) = pool.destinations([3])  # a layered load writes the pool itself
    own[:] = raw[2]
    assert torch.equal(pool.read_blocks([3])[0], blocks[2])


def test_a_staged_lookup_cannot_hand_out_more_rows_than_it_asked_for():
    pool = make_pool("float32")
    pool.stages_on_host = True
    with pool.staged_reads(2) as stage:
        stage.destinations([1, 2])
        with pytest.raises(ValueError, match="3 rows staged, the lookup asked for 2"):
            stage.destinations([3])
