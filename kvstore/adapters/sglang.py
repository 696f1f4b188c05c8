"""SGLang: kvstore's spill tiers as a HiCache storage backend (`dynamic`).

SGLang's HiCache writes host-pool pages to its storage backend under page hashes (hex
strings chained over the page tokens) and prefetches the longest stored prefix back.
`KvstoreHiCache` stores each page's bytes through a `BlockStore`:

- `batch_exists` is the longest present prefix, one round trip per store;
- `batch_get_v1` / `batch_set_v1` (with `interface_v1: 1`) read and write pages of the
  registered host pool at `host_indices`, one batched round trip per call; the legacy
  `batch_get` / `batch_set` take page tensors instead;
- a failing tier is a miss (False, 0 or None), never an exception into SGLang.

Enable it (docs/ADAPTERS.md): `--hicache-storage-backend dynamic
--hicache-storage-backend-extra-config '{"backend_name": "kvstore", "module_path":
"kvstore.adapters.sglang", "class_name": "KvstoreHiCache", "interface_v1": 1,
"kvstore": {"redis_url": ...}}'` (KVSTORE_* variables fill the rest, KVSTORE_SECRET too).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from hashing import StackNamespace
from kvstore.adapters.blocks import (
    BlockStore,
    PutBlock,
    config_from_settings,
    settings_of,
    startup_errors,
)
from kvstore.config import CacheConfig

STACK = "sglang"
log = logging.getLogger("kvstore.adapters")


class HybridModelError(RuntimeError):
    """The model keeps side pools (Mamba, SWA, DSA, draft) besides its KV pages."""


def sglang_namespace(config: HiCacheStorageConfig, pool: Any, tenant: str) -> StackNamespace:
    """The namespace of one rank's pages: model, the host pool's dtype, page size, layout
    and bytes per token, and the rank's shard (MLA pages are shared by the TP ranks)."""
    shard = {
        "pp": (config.pp_rank, config.pp_size),
        "cp": (config.attn_cp_rank, config.attn_cp_size),
        "dcp": (config.dcp_rank, config.dcp_size),
    }
    if not config.is_mla_model:
        shard["tp"] = (config.tp_rank, config.tp_size)
    layout = {
        "page_size": pool.page_size,
        "layout": pool.layout,
        "size_per_token": pool.size_per_token,
        "mla": config.is_mla_model,
        "format": getattr(pool, "storage_format_tag", None),
        **shard,
    }
    text, model = json.dumps(layout, sort_keys=True), config.model_name or "unknown-model"
    return StackNamespace(STACK, model, text, str(pool.dtype), tenant)


def _none_done(transfers: list[PoolTransfer]) -> dict[str, list[bool]]:
    """A v2 call's answer for pools it never stores: False for every page of each."""
    return {t.name: [False] * len(t.keys or ()) for t in transfers}


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().view(torch.uint8).numpy()).cast("B")


class KvstoreHiCache(HiCacheStorage):
    """An SGLang HiCache storage backend on kvstore's spill tiers.

    Built by SGLang's `StorageBackendFactory` for `dynamic` as
    `KvstoreHiCache(storage_config, kwargs)`; kvstore's settings are
    `extra_config["kvstore"]`. Pages are stored once the host pool is registered."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        self.storage_config = storage_config
        extra = storage_config.extra_config or {}
        where = "--hicache-storage-backend-extra-config"
        with startup_errors(STACK, where, "SGLang does not start"):
            self.config: CacheConfig = config_from_settings(
                settings_of(extra, "SGLang extra_config")
            )
        self.blocks: BlockStore | None = None
        self.writer = storage_config.is_storage_writer
        self._side_pools: list[str] = []  # a hybrid model's pools besides KV: refused

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self.blocks is None:
            tenant = self.config.tenant_salt
            namespace = sglang_namespace(self.storage_config, mem_pool_host, tenant)
            self.blocks = BlockStore(self.config, namespace)

    # --- hybrid models: refused ------------------------------------------------------------

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if host_pool_name != PoolName.KV:
            self._side_pools.append(str(host_pool_name))

    def on_host_pools_registered(self) -> None:
        """SGLang's attach ends here: a hybrid model is refused with one line (SGLang then
        fails the attach, so the server does not start with a backend that stores nothing)."""
        if self._side_pools:
            error = HybridModelError(
                f"kvstore's SGLang backend stores KV pages only; this model also keeps "
                f"{', '.join(self._side_pools)} pools (a hybrid model), which it cannot store: "
                f"serve it without --hicache-storage-backend dynamic"
            )
            log.error("%s", error)
            raise error

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """Nothing: the side pools of a hybrid model are never stored (refused above)."""
        return PoolTransferResult.empty()

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return _none_done(transfers)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return _none_done(transfers)

    # --- keys -------------------------------------------------------------------------------

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        return [k.encode() for k in keys]

    # --- existence --------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.blocks is not None and self.blocks.contains(self._keys([key]))[0]

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        if self.blocks is None or not keys:
            return 0
        return self.blocks.count_prefix(self._keys(keys))

    # --- host pool pages (interface_v1) -----------------------------------------------------

    def _page_index(self, host_indices: torch.Tensor, i: int) -> int:
        return int(host_indices[i * self.mem_pool_host.page_size].item())

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read the pages into the host pool at host_indices; True where one was loaded."""
        if self.blocks is None:
            return [False] * len(keys)
        page = self.mem_pool_host.get_dummy_flat_data_page()
        blocks = self.blocks.get(self._keys(keys), payload_bytes=page.numel() * page.element_size())
        out = []
        for i, block in enumerate(blocks):
            if block is not None:
                _tensor_bytes(page)[:] = block.payload
                self.mem_pool_host.set_from_flat_data_page(self._page_index(host_indices, i), page)
            out.append(block is not None)
        return out

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Write the host pool's pages at host_indices in one batch."""
        pages = [
            self.mem_pool_host.get_data_page(self._page_index(host_indices, i), flat=True)
            for i in range(len(keys))
        ]
        return [self._set_pages(keys, pages)] * len(keys)

    def _set_pages(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> bool:
        if self.blocks is None:
            return False
        if not self.writer:
            return True  # MLA: another rank writes the shared pages
        tokens = self.mem_pool_host.page_size
        blocks = [
            PutBlock(k, _tensor_bytes(p), tokens)
            for k, p in zip(self._keys(keys), pages, strict=True)
        ]
        return self.blocks.put(blocks)

    # --- page tensors (the legacy interface) ------------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Each page into its target tensor (a flat data page of the host pool)."""
        if self.blocks is None or target_locations is None:
            return [None] * len(keys)
        size = _tensor_bytes(target_locations[0]).nbytes
        blocks = self.blocks.get(self._keys(keys), payload_bytes=size)
        out: list[torch.Tensor | None] = []
        for block, target in zip(blocks, target_locations, strict=True):
            if block is not None:
                _tensor_bytes(target)[:] = block.payload
            out.append(None if block is None else target)
        return out

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return values is not None and self._set_pages(keys, values)

    # --- admin ------------------------------------------------------------------------------

    def clear(self) -> None:
        if self.blocks is not None:
            self.blocks.clear()

    def close(self) -> None:
        if self.blocks is not None:
            self.blocks.close()

    def stats(self) -> dict[str, Any]:
        """kvstore's counters and tier stats for this backend (docs/ADAPTERS.md)."""
        return {} if self.blocks is None else self.blocks.stats()
