"""LMCache: kvstore's spill tiers as a remote storage plugin.

LMCache's remote backend hands a `RemoteConnector` its chunks as `MemoryObj`s under
`CacheEngineKey`s. `KvstoreConnector` stores each chunk's bytes through a `BlockStore`,
with LMCache's own `RemoteMetadata` (shapes, dtypes, memory format) as the entry's stack
metadata, and reads them back into `MemoryObj`s allocated from LMCache's CPU backend.

The async methods never block the event loop: every store call runs on the connector's
own thread pool (`run_in_executor`); `put` returns once the chunk's bytes are copied into
the encoded entry, so LMCache may release the `MemoryObj` right after. Batched forms are one
round trip per store. A failing tier reads as a miss; a put no tier took raises
`WriteDropped`, which LMCache counts; `ping` tells LMCache's health check whether every tier
answers.

Enable it (docs/ADAPTERS.md, docs/lmcache.yaml): `remote_storage_plugins: [kvstore]` (not
`remote_url` too: LMCache would build a second backend), and in `extra_config`:
`remote_storage_plugin.kvstore.module_path: kvstore.adapters.lmcache`,
`remote_storage_plugin.kvstore.class_name: KvstoreConnector`, `kvstore: {redis_url: ...}`
(KVSTORE_* variables fill the rest, KVSTORE_SECRET included).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from hashing import StackNamespace
from kvstore.adapters.blocks import (
    Block,
    BlockStore,
    PutBlock,
    config_from_settings,
    settings_of,
    startup_errors,
)
from kvstore.config import ConfigError

STACK = "lmcache"
# What LMCache 0.5.6 does when the connector cannot be built (docs/ADAPTERS.md)
CONSEQUENCE = (
    "LMCache runs on without this remote backend, retries it every 10 s and its health "
    "check reports the backend down"
)
UNREACHABLE = 1  # ping's error code when a kvstore tier does not answer (0: all answer)
T = TypeVar("T")


class WriteDropped(RuntimeError):
    """No kvstore tier took a put (down or full): raised so that LMCache counts it."""


def lmcache_namespace(metadata: Any, tenant: str) -> StackNamespace:
    """The namespace of one LMCache engine's chunks: model, KV dtype and layout (the KV
    shape, MLA, chunk size). World size, worker id and dtype are in every key as well."""
    layout = {
        "kv_shape": list(metadata.kv_shape),
        "use_mla": bool(metadata.use_mla),
        "chunk_size": metadata.chunk_size,
        "shapes": [list(s) for s in metadata.get_shapes()],
    }
    dtype = ",".join(str(d) for d in metadata.get_dtypes())
    text = json.dumps(layout, sort_keys=True)
    return StackNamespace(STACK, metadata.model_name, text, dtype, tenant)


def stack_key(key: CacheEngineKey) -> bytes:
    """A CacheEngineKey's identity: model, world size, worker, chunk hash, dtype, tags."""
    return key.to_string().encode()


class KvstoreConnector(RemoteConnector):
    """An LMCache remote connector on kvstore's spill tiers (memory, LMDB, Redis, Cluster).

    Built by LMCache's plug-in loader as `KvstoreConnector(loop=, local_cpu_backend=,
    config=)`; kvstore's settings are `extra_config["kvstore"]` (a mapping) and
    `extra_config["kvstore.io_threads"]` (default 4)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any):
        metadata = getattr(local_cpu_backend, "metadata", None)
        with startup_errors(STACK, "extra_config in LMCACHE_CONFIG_FILE", CONSEQUENCE):
            if metadata is None:
                raise ConfigError("kvstore", "KvstoreConnector needs LMCache's worker-side backend")
            extra = getattr(config, "extra_config", None) or {}
            cache_config = config_from_settings(settings_of(extra, "LMCache extra_config"))
            threads = extra.get("kvstore.io_threads", 4)
            if not isinstance(threads, int) or threads < 1:
                raise ConfigError("kvstore.io_threads", f"must be an int >= 1, got {threads!r}")
        super().__init__(config, metadata)
        self.loop, self.local_cpu_backend = loop, local_cpu_backend
        namespace = lmcache_namespace(metadata, cache_config.tenant_salt)
        self.blocks = BlockStore(cache_config, namespace)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstore-lmcache")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the connector's threads: the event loop keeps running."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # --- existence --------------------------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._run(self.exists_sync, key)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.blocks.contains([stack_key(key)])[0]

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return self.blocks.count_prefix([stack_key(k) for k in keys])

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        return await self._run(self.batched_contains, keys)

    # --- reads ------------------------------------------------------------------------------

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self._run(self._get_many, [key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return await self._run(self._get_many, keys)

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey]
    ) -> list[MemoryObj]:
        """The leading chunks found (later ones are released)."""
        objs = await self._run(self._get_many, keys)
        n = next((i for i, obj in enumerate(objs) if obj is None), len(objs))
        for obj in objs[n:]:
            if obj is not None:
                obj.ref_count_down()
        return objs[:n]

    def _get_many(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        blocks = self.blocks.get([stack_key(k) for k in keys])
        return [None if b is None else self._memory_obj(b) for b in blocks]

    def _memory_obj(self, block: Block) -> MemoryObj | None:
        """A MemoryObj of LMCache's allocator holding the block (None if none is free)."""
        try:
            meta = RemoteMetadata.deserialize(block.meta)
        except Exception:  # not LMCache's metadata: not a chunk this connector can serve
            return None
        if meta.length != len(block.payload):
            return None
        obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
        if obj is None:
            return None
        target = obj.byte_array
        if len(target) < meta.length:
            obj.ref_count_down()
            return None
        memoryview(target).cast("B")[: meta.length] = block.payload
        return self.reshape_partial_chunk(obj, meta.length)

    # --- writes -----------------------------------------------------------------------------

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self._run(self._put_many, [key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        await self._run(self._put_many, keys, memory_objs)

    def _put_many(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> None:
        """Encode (copy) every chunk and write them in one batch; `WriteDropped` if no tier
        took it (LMCache counts a failed put in its put_failed_count)."""
        blocks = [self._block(k, obj) for k, obj in zip(keys, objs, strict=True)]
        if not self.blocks.put(blocks):
            raise WriteDropped(f"no kvstore tier took {len(blocks)} chunks (see kvstore's log)")

    def _block(self, key: CacheEngineKey, obj: MemoryObj) -> PutBlock:
        payload = memoryview(obj.byte_array).cast("B")
        shapes, dtypes = obj.get_shapes(), obj.get_dtypes()
        meta = RemoteMetadata(len(payload), shapes, dtypes, obj.get_memory_format())
        tokens = shapes[0][2] if len(shapes[0]) == 4 else shapes[0][0]
        return PutBlock(stack_key(key), payload, int(tokens), meta.serialize())

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return self.blocks.delete([stack_key(key)]) > 0

    # --- health -----------------------------------------------------------------------------

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when every tier answers, else `UNREACHABLE` (LMCache's health check then
        reports the backend down and records the code)."""
        return await self._run(self._ping)

    def _ping(self) -> int:
        return UNREACHABLE if any(s.probe() is not None for s in self.blocks.stores) else 0

    # --- admin ------------------------------------------------------------------------------

    async def list(self) -> list[str]:
        """Empty: the tiers index hashed keys, which do not map back to CacheEngineKeys."""
        return []

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.blocks.close()

    def stats(self) -> dict[str, Any]:
        """kvstore's counters and tier stats for this connector (docs/ADAPTERS.md)."""
        return self.blocks.stats()
