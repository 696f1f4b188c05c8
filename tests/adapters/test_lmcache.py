"""LMCache: a real LMCacheEngineConfig (a YAML file naming the plugin), LMCache's own
CreateConnector (ConnectorManager -> the plugin loader -> KvstoreConnector) over a real
LocalCPUBackend, then put / exists / get of real MemoryObjs under real CacheEngineKeys."""

from __future__ import annotations

import asyncio
import threading
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
from lmcache.v1.health_monitor.checks.remote_backend_check import RemoteBackendHealthCheck
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend import CreateStorageBackends
from lmcache.v1.storage_backend.connector import CreateConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from kvstore.adapters.lmcache import UNREACHABLE, KvstoreConnector, WriteDropped
from kvstore.config import ConfigError

CHUNK = 16
PLUGIN_URL = "plugin://kvstore"  # the URL LMCache's RemoteBackend builds for the plugin


def lmcache_config(tmp_path, settings: dict) -> LMCacheEngineConfig:
    extra = {
        "remote_storage_plugin.kvstore.module_path": "kvstore.adapters.lmcache",
        "remote_storage_plugin.kvstore.class_name": "KvstoreConnector",
        "kvstore": settings,
    }
    doc = {"chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": 0.05,
           "remote_storage_plugins": ["kvstore"], "extra_config": extra}  # fmt: skip
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
            PLUGIN_URL, self.loop, self.backend, self.config, self.metadata, plugin_name="kvstore"
        )
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
    with pytest.raises(WriteDropped):  # LMCache counts it in put_failed_count
        worker.run(worker.conn.put(worker.key(78), obj))
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
    with pytest.raises(ConfigError, match=r"redis_uri: .* unknown; did you mean 'redis_url'"):
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
    assert config.remote_url is None  # one backend: the plugin, not the legacy URL too
    conn = CreateConnector(PLUGIN_URL, loop, backend, config, metadata, "kvstore")
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


class Backends:
    """LMCache's own storage backends (CreateStorageBackends) from a config, on an event
    loop in a thread as LMCache runs it."""

    def __init__(self, config: LMCacheEngineConfig):
        self.metadata = LMCacheMetadata(
            model_name="org/model", world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(2, 2, config.chunk_size, 2, 8),
            chunk_size=config.chunk_size,
        )  # fmt: skip
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.all = CreateStorageBackends(config, self.metadata, self.loop)
        self.remote = [b for b in self.all.values() if isinstance(b, RemoteBackend)]
        self.cpu = self.all["LocalCPUBackend"]

    def put(self, n: int) -> None:
        """n chunks through every backend, as LMCache's StorageManager.batched_put does."""
        keys = [CacheEngineKey("org/model", 1, 0, 0xBEEF + i, torch.bfloat16) for i in range(n)]
        objs = [self.cpu.allocate(self.metadata.get_shapes(), self.metadata.get_dtypes())
                for _ in range(n)]  # fmt: skip
        for backend in self.remote:
            backend.batched_submit_put_task(keys, objs)
        self.drain()
        for obj in objs:
            obj.ref_count_down()  # the allocation's own reference, as LMCache drops it

    def drain(self) -> None:
        """Wait until the loop runs no task but this check (every put has finished)."""

        async def others() -> int:
            return len(asyncio.all_tasks()) - 1

        deadline = time.monotonic() + 10
        while asyncio.run_coroutine_threadsafe(others(), self.loop).result(5):
            assert time.monotonic() < deadline, "LMCache's puts did not finish"
            time.sleep(0.01)

    def close(self) -> None:
        for backend in self.remote:
            backend.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def sets(server) -> int:
    return server.client().info("commandstats").get("cmdstat_set", {}).get("calls", 0)


def test_the_docs_config_makes_one_backend_that_writes_each_chunk_once(redis_server, monkeypatch):
    monkeypatch.setenv("KVSTORE_REDIS_URL", redis_server.url)
    config = LMCacheEngineConfig.from_file(str(ROOT / "docs" / "lmcache.yaml"))
    config.max_local_cpu_size = 0.05
    backends = Backends(config)
    try:
        assert len(backends.remote) == 1
        before = sets(redis_server)
        backends.put(4)
        assert sets(redis_server) - before == 4  # one SET per chunk
        assert redis_server.client().dbsize() == 4
    finally:
        backends.close()


def test_a_config_error_is_an_error_line_and_lmcache_reports_the_backend_down(tmp_path, caplog):
    """LMCache 0.5.6 catches a plugin that cannot start and runs on: kvstore logs why at
    ERROR with the fix, and LMCache's health check reports the backend down."""
    config = lmcache_config(tmp_path, {"redis_ur": "redis://127.0.0.1:1/0"})
    with caplog.at_level("ERROR", logger="kvstore.adapters"):
        backends = Backends(config)
    try:
        (remote,) = backends.remote
        assert remote.connection is None  # LMCache kept the backend, without a connection
        (record,) = [r for r in caplog.records if r.name == "kvstore.adapters"]
        assert record.levelname == "ERROR"
        assert "redis_ur" in record.message and "did you mean 'redis_url'" in record.message
        assert RemoteBackendHealthCheck(remote).check() is False
    finally:
        backends.close()


@pytest.mark.parametrize("tier", ["redis"], indirect=True)
def test_an_outage_shows_in_lmcache_health_check_and_failure_counters(tier, tmp_path):
    backends = Backends(lmcache_config(tmp_path, tier.settings))
    try:
        (remote,) = backends.remote
        check = RemoteBackendHealthCheck(remote)
        assert check.check() is True  # ping: every tier answers
        tier.redis.kill()
        assert remote.connection.getWrappedConnector()._ping() == UNREACHABLE
        assert check.check() is False
        obj = backends.cpu.allocate(backends.metadata.get_shapes(), backends.metadata.get_dtypes())
        key = CacheEngineKey("org/model", 1, 0, 0xDEAD, torch.bfloat16)
        remote.submit_put_task(key, obj).exception(timeout=5)
        obj.ref_count_down()
        assert remote.put_failed_count == 1  # LMCache counted the dropped write
        tier.redis.restart()
        assert check.check() is True
    finally:
        backends.close()


def test_two_secrets_on_one_tier_keep_each_others_chunks(tier, workers, caplog):
    right = workers({**tier.settings, "secret": "right"})
    wrong = workers({**tier.settings, "secret": "wrong"})
    wrong.plugin.blocks.stores = right.blocks.stores  # the very same stores
    objs = [right.chunk(seed) for seed in range(3)]
    keys = [right.key(300 + i) for i in range(3)]
    right.run(right.plugin.batched_put(keys, [obj for obj, _ in objs]))
    with caplog.at_level("WARNING", logger="kvstore.tiers"):
        assert wrong.run(wrong.plugin.batched_get(keys)) == [None] * 3
    assert wrong.run(wrong.plugin.batched_async_contains("l", keys)) == 3  # kept: 0 deleted
    assert verify_failures(wrong.blocks, tier.name, "secret") == 3
    assert len([r for r in caplog.records if "KVSTORE_SECRET" in r.message]) == 1
    got = right.run(right.plugin.batched_get(keys))
    assert [raw(o) for o in got] == [data for _, data in objs]
    corrupt(right.blocks, keys[0].to_string().encode())  # the control: damage is deleted
    assert right.run(right.conn.get(keys[0])) is None
    assert right.run(right.conn.exists(keys[0])) is False
