"""A promoted lookup's way into the pool (kvstore/device/staging.py), counted: on a staged
pool (a GPU pool's path, run here on the CPU with host staging forced) each tier's blocks
move in one transfer, whatever their number; on a CPU pool the verified copy out of a store
writes the pool itself and nothing more moves. A lookup served by host memory, LMDB and Redis
in turn, against real stores, comes back bit-exact either way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hashing import Namespace
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig

LAYERS, HEADS, BS, DIM = 2, 2, 4, 8
NS = Namespace("fp", "float32", LAYERS, HEADS, DIM, BS)
BLOCKS = 9  # memory holds 0-2, LMDB 0-5, Redis 0-8


def kv_for(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(1, HEADS, n, DIM, generator=g), torch.randn(1, HEADS, n, DIM, generator=g))
        for _ in range(LAYERS)
    ]


def three_tier_config(tmp_path, redis_url: str) -> CacheConfig:
    return CacheConfig(
        block_size=BS,
        device_blocks=64,
        memory_cache_gb=0.01,
        memory_write_policy="write-through",
        lmdb_dir=str(tmp_path / "lmdb"),
        lmdb_map_size_gb=0.05,
        redis_url=redis_url,
        lookup_deadline_ms=2000.0,
    )


def spread_over_tiers(cache: PrefixCache, prompt: np.ndarray, kv: list) -> None:
    """The prompt in every tier, then cut: memory keeps blocks 0-2, LMDB 0-5, Redis all;
    the device none."""
    assert cache.store(prompt, kv) == BLOCKS
    assert cache.flush(10)
    assert cache.evict_device() == BLOCKS
    memory, lmdb, _ = cache.tiers.stores
    keys = cache.hasher.hash_blocks(prompt)
    memory.delete(keys[3:])
    lmdb.delete(keys[6:])


@pytest.mark.parametrize("staged", [True, False], ids=["host-staged", "in-place"])
def test_a_lookup_from_three_tiers_moves_one_transfer_per_tier(tmp_path, redis_server, staged):
    prompt = np.random.default_rng(0).integers(0, 5000, BLOCKS * BS + 1).astype(np.uint32)
    kv = kv_for(len(prompt))
    with PrefixCache(three_tier_config(tmp_path, redis_server.url), NS) as cache:
        cache.pool.stages_on_host = staged  # staged: the GPU pool's path, on this CPU
        spread_over_tiers(cache, prompt, kv)
        hit = cache.lookup(prompt)
        assert hit.tier_tokens == {"memory": 3 * BS, "lmdb": 3 * BS, "redis": 3 * BS}
        assert cache.pool.num_transfers == (3 if staged else 0)
        loaded = cache.load(hit)
        for (k, v), (k2, v2) in zip(kv, loaded.layers, strict=True):
            n = BLOCKS * BS
            assert torch.equal(k[:, :, :n], k2) and torch.equal(v[:, :, :n], v2)
        cache.release(hit)
        cache.check_integrity()


def test_control_a_transfer_that_misses_a_tier_leaves_its_blocks_unwritten(
    tmp_path, redis_server, monkeypatch
):
    """The transfers carry the bytes: with the LMDB tier's upload dropped, its blocks in the
    pool are not the prompt's."""
    from kvstore.device import staging

    prompt = np.random.default_rng(0).integers(0, 5000, BLOCKS * BS + 1).astype(np.uint32)
    kv = kv_for(len(prompt))
    real = staging._StagedLookup.upload
    calls = []

    def upload(self, block_ids, first):
        calls.append(first)
        if len(calls) != 2:  # the second tier read: LMDB's
            real(self, block_ids, first)

    monkeypatch.setattr(staging._StagedLookup, "upload", upload)
    with PrefixCache(three_tier_config(tmp_path, redis_server.url), NS) as cache:
        cache.pool.stages_on_host = True
        spread_over_tiers(cache, prompt, kv)
        cache.pool.kv.zero_()
        hit = cache.lookup(prompt)
        loaded = cache.load(hit)
        k, k2 = kv[0][0], loaded.layers[0][0]
        assert calls == [0, 3, 6]
        assert torch.equal(k[:, :, : 3 * BS], k2[:, :, : 3 * BS])
        assert not k2[:, :, 3 * BS : 6 * BS].any()  # LMDB's rows never reached the pool
        cache.release(hit)


def test_a_layered_lookup_from_three_tiers_copies_once_per_layer(
    tmp_path, redis_server, monkeypatch
):
    """Layer by layer (kvstore/tiers/layered.py) every tier's blocks of one layer move in one
    batched copy: as many as the model has layers, whatever the blocks and tiers."""
    from kvstore.tiers import layered

    prompt = np.random.default_rng(0).integers(0, 5000, BLOCKS * BS + 1).astype(np.uint32)
    kv = kv_for(len(prompt))
    sizes = []
    real = torch._foreach_copy_

    def foreach_copy(dst, src, *args, **kwargs):
        sizes.append(len(dst))
        return real(dst, src, *args, **kwargs)

    monkeypatch.setattr(layered.torch, "_foreach_copy_", foreach_copy)
    config = three_tier_config(tmp_path, redis_server.url)
    with PrefixCache(CacheConfig(**{**config.__dict__, "layer_loads": True}), NS) as cache:
        spread_over_tiers(cache, prompt, kv)
        hit = cache.lookup(prompt, layered=True)
        assert cache.settle(hit)
        assert hit.tier_tokens == {"memory": 3 * BS, "lmdb": 3 * BS, "redis": 3 * BS}
        assert sizes == [BLOCKS] * LAYERS  # one copy per layer, of every block
        loaded = cache.load(hit)
        assert torch.equal(kv[1][1][:, :, : BLOCKS * BS], loaded.layers[1][1])
        cache.release(hit)
        cache.check_integrity()
