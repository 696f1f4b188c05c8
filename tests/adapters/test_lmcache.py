"""LMCache: a real LMCacheEngineConfig (a YAML file naming the plugin), LMCache's own
CreateConnector (ConnectorManager -> the plugin loader -> KvstoreConnector) over a real
LocalCPUBackend, then put / exists / get of real MemoryObjs under real CacheEngineKeys."""

from __future__ import annotations

import asyncio
import time

import pytest
import yaml
from adapter_helpers import (
    ROOT,
    compose_redis,
    compose_service,
    corrupt,
    count,
    import_stack,
    verify_failures,
)

import_stack("lmcache", "lmcache.v1.storage_backend.connector")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import CreateConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from kvstore.adapters.lmcache import KvstoreConnector
from kvstore.config import ConfigError

CHUNK = 16


def lmcache_config(tmp_path, settings: dict) -> LMCacheEngineConfig:
    extra = {
        "remote_storage_plugin.kvstore.module_path": "kvstore.adapters.lmcache",
        "remote_storage_plugin.kvstore.class_name": "KvstoreConnector",
        "kvstore": settings,
    }
    doc = {"chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": 0.05,
           "remote_url": "plugin://kvstore", "remote_storage_plugins": ["kvstore"],
           "extra_config": extra}  # fmt: skip
    path = tmp_path / f"lmcache-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return LMCacheEngineConfig.from_file(str(path))


class Worker:
    """One LMCache worker's remote connector, on its own event loop."""

    def __init__(self, tmp_path, settings: dict, model: str = "org/model"):
        self.config = lmcache_config(tmp_path, settings)
        self.metadata = LMCacheMetadata(
            model_name=model, world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, CHUNK, 2, 8),
            chunk_size=CHUNK,
        )  # fmt: skip
        self.backend = LocalCPUBackend(self.config, self.metadata)
        self.loop = asyncio.new_event_loop()
        self.conn = CreateConnector(
            self.config.remote_url, self.loop, self.backend, self.config, self.metadata,
            plugin_name="kvstore",
        )  # fmt: skip
        self.plugin = self.conn._connector
        self.blocks = self.plugin.blocks

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def key(self, chunk_hash: int) -> CacheEngineKey:
        return CacheEngineKey(self.metadata.model_name, 1, 0, chunk_hash, torch.bfloat16)

    def chunk(self, seed: int):
        """A MemoryObj of LMCache's allocator filled with seeded KV; and its bytes."""
        obj = self.backend.allocate(self.metadata.get_shapes(), self.metadata.get_dtypes())
        gen = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=gen).to(obj.tensor.dtype))
        return obj, bytes(memoryview(obj.byte_array).cast("B"))

    def close(self) -> None:
        self.run(self.conn.close())
        self.loop.close()


def raw(obj) -> bytes:
    return bytes(memoryview(obj.byte_array).cast("B"))


@pytest.fixture
def workers(tmp_path):
    made: list[Worker] = []

    def make(settings: dict, model: str = "org/model") -> Worker:
        made.append(Worker(tmp_path, settings, model))
        return made[-1]

    yield make
    for worker in made:
        worker.close()


def test_lmcache_loads_the_plugin_from_its_config(tier, workers):
    worker = workers(tier.settings)
    assert isinstance(worker.plugin, KvstoreConnector)
    assert [s.name for s in worker.blocks.stores] == [tier.name]


def test_put_exists_get_round_trip_bit_exact(tier, workers):
    worker = workers(tier.settings)
    obj, data = worker.chunk(1)
    key = worker.key(0x1234)
    assert worker.run(worker.conn.exists(key)) is False
    worker.run(worker.conn.put(key, obj))
    obj.ref_count_down()  # LMCache releases the object after put: the entry holds a copy
    assert worker.run(worker.conn.exists(key)) is True
    assert worker.conn.exists_sync(key) is True
    got = worker.run(worker.conn.get(key))
    assert raw(got) == data
    assert got.get_shapes() == worker.metadata.get_shapes()
    assert got.get_dtypes() == [torch.bfloat16]
    assert count(worker.blocks, "adapter_writes_blocks_total", tier=tier.name) == 1
    assert count(worker.blocks, "adapter_hits_blocks_total", tier=tier.name) == 1


def test_batched_forms_are_one_call_each_and_prefix_exact(tier, workers):
    worker = workers(tier.settings)
    chunks = [worker.chunk(seed) for seed in range(3)]
    keys = [worker.key(100 + i) for i in range(3)]
    worker.run(worker.plugin.batched_put(keys, [obj for obj, _ in chunks]))
    missing = worker.key(999)
    got = worker.run(worker.plugin.batched_get([*keys, missing]))
    assert [raw(o) for o in got[:3]] == [data for _, data in chunks] and got[3] is None
    assert worker.run(worker.plugin.batched_async_contains("l", [*keys, missing, keys[0]])) == 3
    assert worker.plugin.batched_contains([keys[0], missing]) == 1
    assert count(worker.blocks, "adapter_writes_blocks_total", tier=tier.name) == 3


@pytest.mark.parametrize("tier", ["lmdb", "redis"], indirect=True)
def test_a_second_worker_gets_what_the_first_put(tier, workers):
    writer, reader = workers(tier.settings), workers(tier.settings)
    obj, data = writer.chunk(5)
    writer.run(writer.conn.put(writer.key(7), obj))
    assert raw(reader.run(reader.conn.get(reader.key(7)))) == data


def test_a_corrupted_chunk_is_a_miss_and_is_deleted(tier, workers):
    worker = workers(tier.settings)
    obj, data = worker.chunk(2)
    key = worker.key(42)
    worker.run(worker.conn.put(key, obj))
    assert raw(worker.run(worker.conn.get(key))) == data  # control: intact, it verifies
    corrupt(worker.blocks, key.to_string().encode())
    assert worker.run(worker.conn.get(key)) is None
    assert verify_failures(worker.blocks, tier.name, "checksum") == 1
    assert worker.run(worker.conn.exists(key)) is False


def test_two_models_never_share_a_chunk(tier, workers):
    a, b = workers(tier.settings, "org/model-a"), workers(tier.settings, "org/model-b")
    b.plugin.blocks.stores = a.blocks.stores  # even on the very same stores
    obj, _ = a.chunk(3)
    a.run(a.conn.put(a.key(9), obj))
    same_hash_key = CacheEngineKey("org/model-a", 1, 0, 9, torch.bfloat16)
    assert b.run(b.conn.get(same_hash_key)) is None  # the key names model-a: b's namespace
    assert b.run(b.conn.exists(same_hash_key)) is False


@pytest.mark.parametrize("tier", ["redis"], indirect=True)
def test_redis_killed_is_misses_then_recovery(tier, workers):
    worker = workers(tier.settings)
    obj, data = worker.chunk(4)
    key = worker.key(77)
    worker.run(worker.conn.put(key, obj))
    tier.redis.kill()
    assert worker.run(worker.conn.exists(key)) is False
    assert worker.run(worker.conn.get(key)) is None
    worker.run(worker.conn.put(worker.key(78), obj))  # dropped, not raised
    assert count(worker.blocks, "adapter_dropped_writes_blocks_total", tier="redis") == 1
    tier.redis.restart()
    time.sleep(0.25)  # the breaker's cooldown
    worker.run(worker.conn.put(key, obj))
    assert raw(worker.run(worker.conn.get(key))) == data


@pytest.mark.parametrize("tier", ["redis"], indirect=True)
def test_a_slow_tier_never_blocks_the_event_loop(tier, workers):
    worker = workers(tier.settings)
    tier.redis.pause()  # connections hang until the 500 ms deadline

    async def get_while_ticking() -> tuple[object, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        got = await worker.conn.get(worker.key(1))
        ticker.cancel()
        return got, ticks

    start = time.monotonic()
    got, ticks = worker.run(get_while_ticking())
    elapsed = time.monotonic() - start
    tier.redis.resume()
    assert got is None and elapsed >= 0.4  # the call did wait on the paused server ...
    assert ticks >= 10  # ... while the loop kept running other tasks


def test_an_unknown_setting_is_a_typed_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="redis_uri: is not a kvstore setting"):
        Worker(tmp_path, {"redis_uri": "redis://127.0.0.1:1/0"})


def test_the_compose_fleet_config_loads_through_lmcache(redis_server_factory, monkeypatch):
    """vllm-lmcache's LMCACHE_CONFIG_FILE of docker-compose.yml (docs/lmcache.yaml) as
    LMCache loads it, with a smaller CPU buffer, on a loopback Redis with its password."""
    _, env = compose_service("vllm-lmcache")
    for name, value in compose_redis(redis_server_factory, env).items():
        monkeypatch.setenv(name, value)
    assert env["LMCACHE_CONFIG_FILE"] == "/etc/kvstore/lmcache.yaml"
    config = LMCacheEngineConfig.from_file(str(ROOT / "docs" / "lmcache.yaml"))
    config.max_local_cpu_size = 0.05
    chunk = config.chunk_size
    metadata = LMCacheMetadata(
        model_name="org/model", world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, chunk, 2, 8),
        chunk_size=chunk,
    )  # fmt: skip
    backend = LocalCPUBackend(config, metadata)
    loop = asyncio.new_event_loop()
    conn = CreateConnector(config.remote_url, loop, backend, config, metadata, "kvstore")
    try:
        assert [s.name for s in conn._connector.blocks.stores] == ["redis"]
        obj = backend.allocate(metadata.get_shapes(), metadata.get_dtypes())
        obj.tensor.copy_(torch.arange(obj.tensor.numel()).view(obj.tensor.shape))
        key = CacheEngineKey("org/model", 1, 0, 0xC0FFEE, torch.bfloat16)
        loop.run_until_complete(conn.put(key, obj))
        assert raw(loop.run_until_complete(conn.get(key))) == raw(obj)
    finally:
        loop.run_until_complete(conn.close())
        loop.close()
