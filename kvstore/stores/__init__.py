"""Spill tiers below the device pool: host memory, LMDB and Redis, behind `SpillStore`."""

from __future__ import annotations

import os

from hashing import Namespace
from kvstore.config import CacheConfig
from kvstore.stores.base import SpillStore, StoreStats
from kvstore.stores.breaker import CircuitBreaker
from kvstore.stores.lmdb import LmdbStore
from kvstore.stores.lmdb_env import prepare_dir
from kvstore.stores.memory import MemoryStore
from kvstore.stores.redis import RedisStore

__all__ = [
    "CircuitBreaker",
    "LmdbStore",
    "MemoryStore",
    "RedisStore",
    "SpillStore",
    "StoreStats",
    "check_local_tiers",
    "make_stores",
]

GIB = 2**30


def make_stores(config: CacheConfig, namespace: Namespace | str) -> list[SpillStore]:
    """The configured spill tiers, fastest first: memory, lmdb, redis (each only if set).

    `namespace` (or its `id`) prefixes the keys of the shared tiers.
    """
    namespace_id = namespace if isinstance(namespace, str) else namespace.id
    stores: list[SpillStore] = []
    if config.memory_cache_gb > 0:
        stores.append(MemoryStore(max(1, int(config.memory_cache_gb * GIB))))
    if config.lmdb_dir is not None:
        map_size = round(config.lmdb_map_size_gb * GIB)
        path = os.path.expanduser(config.lmdb_dir)
        stores.append(LmdbStore(path, map_size, namespace_id=bytes.fromhex(namespace_id)))
    if config.redis_url is not None:
        breaker = CircuitBreaker(
            config.breaker_failures, config.breaker_cooldown_s, name=RedisStore.name
        )
        stores.append(
            RedisStore(
                config.redis_url,
                namespace_id,
                ttl_s=config.redis_ttl_s,
                deadline_ms=config.lookup_deadline_ms,
                breaker=breaker,
            )
        )
    return stores


def check_local_tiers(config: CacheConfig) -> None:
    """`ConfigError` now, before a caller loads a model, for a local tier setting the stores
    would refuse: the LMDB directory must be, or become, a writable directory."""
    if config.lmdb_dir is not None:
        prepare_dir(os.path.realpath(os.path.expanduser(config.lmdb_dir)))
