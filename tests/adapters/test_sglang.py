"""SGLang: its real StorageBackendFactory builds KvstoreHiCache for `dynamic` from the
extra config (module_path, class_name), and the backend is driven as HiCache's cache
controller drives it: register_mem_pool_host, batch_exists, batch_set_v1 / batch_get_v1
at host indices (interface_v1), and the legacy page-tensor batch_set / batch_get.

The host pool here is `PagePool`, a page buffer with the host pool's page API
(get_data_page, get_dummy_flat_data_page, set_from_flat_data_page). SGLang's own host
pools import in this venv (SGLang's own torch), but building one takes a device KV pool's
buffer description with K/V pointer tables, which only a running SGLang model runner
makes."""

from __future__ import annotations

import json
import time

import pytest
from adapter_helpers import (
    compose_redis,
    compose_service,
    corrupt,
    count,
    flag_value,
    import_stack,
    verify_failures,
)

import_stack("sglang", "sglang.srt.mem_cache.storage.backend_factory")

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvstore.adapters.sglang import HybridModelError, KvstoreHiCache
from kvstore.config import ConfigError

PAGE, PAGES, TOKEN_ELEMS = 16, 8, 2 * 2 * 2 * 8  # K/V x layers x heads x head_dim


class PagePool:
    """Host KV pages [PAGES * PAGE tokens, TOKEN_ELEMS] bf16, with the host pool's page API."""

    page_size, layout, dtype, storage_format_tag = PAGE, "page_first", torch.bfloat16, None
    size_per_token = TOKEN_ELEMS * 2

    def __init__(self, seed: int | None = None):
        self.kv = torch.zeros(PAGES * PAGE, TOKEN_ELEMS, dtype=self.dtype)
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
            self.kv.copy_(torch.randn(self.kv.shape, generator=gen).to(self.dtype))

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv[index : index + PAGE]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(PAGE * TOKEN_ELEMS, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv[index : index + PAGE] = data_page.view(PAGE, TOKEN_ELEMS)

    def page_bytes(self, page: int) -> bytes:
        return self.kv[page * PAGE : (page + 1) * PAGE].view(torch.uint8).numpy().tobytes()


def storage_config(settings: dict, model: str, **kw) -> HiCacheStorageConfig:
    extra = {"backend_name": "kvstore", "module_path": "kvstore.adapters.sglang",
             "class_name": "KvstoreHiCache", "interface_v1": 1, "kvstore": settings}  # fmt: skip
    fields = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0,
              "attn_cp_size": 1, "is_mla_model": False, "enable_storage_metrics": False,
              "is_page_first_layout": True, "model_name": model, **kw}  # fmt: skip
    return HiCacheStorageConfig(**fields, extra_config=extra)


@pytest.fixture
def backends():
    made: list[KvstoreHiCache] = []

    def make(settings: dict, pool: PagePool, model: str = "org/model", **kw) -> KvstoreHiCache:
        config = storage_config(settings, model, **kw)
        backend = StorageBackendFactory.create_backend("dynamic", config, pool)
        backend.register_mem_pool_host(pool)  # as the cache controller does
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def keys_of(n: int, salt: str = "") -> list[str]:
    return [f"{salt}{i:02d}" + "ab" * 31 for i in range(n)]  # sha256-hex-like page hashes


def indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def test_the_dynamic_factory_builds_a_kvstore_backend(tier, backends):
    backend = backends(tier.settings, PagePool())
    assert isinstance(backend, KvstoreHiCache) and isinstance(backend, HiCacheStorage)
    assert [s.name for s in backend.blocks.stores] == [tier.name]


def test_pages_round_trip_bit_exact_through_host_indices(tier, backends):
    src, dst = PagePool(seed=1), PagePool()
    writer = backends(tier.settings, src)
    keys = keys_of(3)
    assert writer.batch_set_v1(keys, indices([1, 4, 6])) == [True] * 3
    if tier.name == "memory":  # a process's own tier: the same backend reads it back
        reader = writer
        reader.register_mem_pool_host(dst)
    else:
        reader = backends(tier.settings, dst)
    assert reader.batch_exists(keys) == 3
    assert reader.batch_get_v1(keys, indices([0, 2, 3])) == [True] * 3
    assert [dst.page_bytes(p) for p in (0, 2, 3)] == [src.page_bytes(p) for p in (1, 4, 6)]
    blocks = writer.blocks
    assert count(blocks, "adapter_writes_blocks_total", tier=tier.name) == 3
    assert count(reader.blocks, "adapter_hits_blocks_total", tier=tier.name) == 3


def test_batch_exists_is_the_longest_present_prefix(tier, backends):
    backend = backends(tier.settings, PagePool(seed=2))
    keys = keys_of(4)
    backend.batch_set_v1([keys[0], keys[1], keys[3]], indices([0, 1, 3]))
    assert backend.batch_exists(keys) == 2
    assert backend.exists(keys[3]) and not backend.exists(keys[2])


def test_the_legacy_page_tensor_interface(tier, backends):
    pool = PagePool(seed=3)
    backend = backends(tier.settings, pool)
    keys = keys_of(2, "legacy")
    pages = [pool.get_data_page(i * PAGE) for i in range(2)]
    assert backend.batch_set(keys, pages) is True
    targets = [pool.get_dummy_flat_data_page() for _ in keys]
    got = backend.batch_get([*keys, "absent"], [*targets, pool.get_dummy_flat_data_page()])
    assert got[2] is None and all(torch.equal(g, p) for g, p in zip(got[:2], pages, strict=False))


def test_a_corrupted_page_is_a_miss_and_is_deleted(tier, backends):
    backend = backends(tier.settings, PagePool(seed=4))
    keys = keys_of(3, "c")
    backend.batch_set_v1(keys, indices([0, 1, 2]))
    assert backend.batch_get_v1(keys, indices([3, 4, 5])) == [True] * 3  # control: intact
    corrupt(backend.blocks, keys[1].encode())
    assert backend.batch_get_v1(keys, indices([3, 4, 5])) == [True, False, True]
    assert verify_failures(backend.blocks, tier.name, "checksum") == 1
    assert backend.batch_exists(keys) == 1


def test_two_models_never_share_a_page(tier, backends):
    pool = PagePool(seed=5)
    a = backends(tier.settings, pool, model="org/model-a")
    b = backends(tier.settings, PagePool(), model="org/model-b")
    b.blocks.stores = a.blocks.stores  # even on the very same stores
    keys = keys_of(2, "shared")
    a.batch_set_v1(keys, indices([0, 1]))
    assert b.batch_exists(keys) == 0 and b.batch_get_v1(keys, indices([0, 1])) == [False] * 2


def test_an_mla_rank_that_is_not_the_writer_does_not_write(tier, backends):
    backend = backends(tier.settings, PagePool(seed=6), is_mla_model=True, tp_rank=1, tp_size=2)
    assert backend.batch_set_v1(keys_of(1, "mla"), indices([0])) == [True]
    assert backend.batch_exists(keys_of(1, "mla")) == 0


@pytest.mark.parametrize("tier", ["redis"], indirect=True)
def test_redis_killed_is_misses_then_recovery(tier, backends):
    src, dst = PagePool(seed=7), PagePool()
    backend = backends(tier.settings, src)
    keys = keys_of(2, "k")
    backend.batch_set_v1(keys, indices([0, 1]))
    tier.redis.kill()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, indices([2, 3])) == [False, False]
    assert backend.batch_set_v1(keys_of(1, "x"), indices([2])) == [False]
    assert count(backend.blocks, "adapter_dropped_writes_blocks_total", tier="redis") == 1
    tier.redis.restart()
    time.sleep(0.25)  # the breaker's cooldown
    assert backend.batch_set_v1(keys, indices([0, 1])) == [True, True]
    backend.register_mem_pool_host(dst)
    assert backend.batch_get_v1(keys, indices([4, 5])) == [True, True]
    assert dst.page_bytes(4) == src.page_bytes(0)


def test_the_compose_fleet_config_loads_through_sglangs_factory(redis_server_factory, monkeypatch):
    """sglang's --hicache-storage-backend(-extra-config) of docker-compose.yml, verbatim,
    through SGLang's StorageBackendFactory, on a loopback Redis with its password."""
    command, env = compose_service("sglang")
    for name, value in compose_redis(redis_server_factory, env).items():
        monkeypatch.setenv(name, value)
    assert flag_value(command, "--hicache-storage-backend") == "dynamic"
    assert flag_value(command, "--page-size") == str(PAGE)
    extra = json.loads(flag_value(command, "--hicache-storage-backend-extra-config"))
    config = storage_config({}, "org/model")
    config.extra_config = extra
    src, dst = PagePool(seed=8), PagePool()
    backend = StorageBackendFactory.create_backend("dynamic", config, src)
    try:
        backend.register_mem_pool_host(src)
        assert [s.name for s in backend.blocks.stores] == ["redis"]
        keys = keys_of(2, "compose")
        assert backend.batch_set_v1(keys, indices([0, 1])) == [True, True]
        backend.register_mem_pool_host(dst)
        assert backend.batch_get_v1(keys, indices([2, 3])) == [True, True]
        assert dst.page_bytes(2) == src.page_bytes(0)
    finally:
        backend.close()


def test_two_secrets_on_one_tier_keep_each_others_pages(tier, backends, caplog):
    src = PagePool(seed=9)
    right = backends({**tier.settings, "secret": "right"}, src)
    wrong = backends({**tier.settings, "secret": "wrong"}, PagePool())
    wrong.blocks.stores = right.blocks.stores  # the very same stores
    keys = keys_of(3, "s")
    assert right.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
    with caplog.at_level("WARNING", logger="kvstore.tiers"):
        assert wrong.batch_get_v1(keys, indices([3, 4, 5])) == [False] * 3
    assert wrong.batch_exists(keys) == 3  # kept: 0 deleted
    assert verify_failures(wrong.blocks, tier.name, "secret") == 3
    assert len([r for r in caplog.records if "KVSTORE_SECRET" in r.message]) == 1
    assert right.batch_get_v1(keys, indices([3, 4, 5])) == [True] * 3
    assert src.page_bytes(3) == src.page_bytes(0)
    corrupt(right.blocks, keys[0].encode())  # the control: damage is still deleted
    assert right.batch_get_v1(keys[:1], indices([6])) == [False]
    assert right.batch_exists(keys) == 0


def test_a_hybrid_model_is_refused_at_attach_with_one_error_line(backends, caplog):
    """SGLang registers a hybrid model's side pools (Mamba, SWA, DSA) after the KV pool and
    then calls on_host_pools_registered, whose error fails the attach."""
    backend = backends({"memory_cache_gb": 0.01}, PagePool())
    backend.register_mem_host_pool_v2(PagePool(), PoolName.KV)
    backend.register_mem_host_pool_v2(PagePool(), PoolName.MAMBA)
    with caplog.at_level("ERROR", logger="kvstore.adapters"), pytest.raises(HybridModelError):
        backend.on_host_pools_registered()
    (record,) = caplog.records
    assert "mamba pools (a hybrid model)" in record.message
    transfer = PoolTransfer(PoolName.MAMBA, keys=keys_of(2, "m"))
    assert backend.batch_exists_v2(keys_of(2, "m"), [transfer]).kv_hit_pages == 0  # no raise
    assert backend.batch_get_v2([transfer]) == {PoolName.MAMBA: [False, False]}
    assert backend.batch_set_v2([transfer]) == {PoolName.MAMBA: [False, False]}


def test_a_model_with_kv_pages_only_attaches(backends):
    backend = backends({"memory_cache_gb": 0.01}, PagePool())
    backend.register_mem_host_pool_v2(PagePool(), PoolName.KV)
    backend.on_host_pools_registered()  # no error


def test_a_config_error_stops_sglang_with_one_error_line(caplog):
    config = storage_config({"redis_ur": "redis://127.0.0.1:1/0"}, "org/model")
    with caplog.at_level("ERROR", logger="kvstore.adapters"), pytest.raises(ConfigError):
        StorageBackendFactory.create_backend("dynamic", config, PagePool())
    (record,) = [r for r in caplog.records if r.name == "kvstore.adapters"]
    assert "did you mean 'redis_url'" in record.message
    assert "SGLang does not start" in record.message
