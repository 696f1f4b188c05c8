"""TenantBlocks: device blocks per tenant against `tenant_quota_blocks`, and the cache salt
and tenant of each cached path, remembered by the path's first block key (eviction needs
the tenant to count, write-back the cache salt to write under)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Sized

from hashing import BlockHash

PRUNE_SLACK = 1024  # paths remembered past twice the live ones before forgetting dead ones


class TenantBlocks:
    """Block counts per tenant and the (cache salt, tenant) of each path; the cache's lock
    guards it."""

    def __init__(self, quota_blocks: int | None, pool_blocks: int):
        self.quota_blocks, self.pool_blocks = quota_blocks, pool_blocks
        self.blocks: Counter[str] = Counter()  # device blocks per tenant
        self._path_of: dict[BlockHash, tuple[str, str]] = {}

    def quota_left(self, tenant: str) -> int:
        if self.quota_blocks is None:
            return self.pool_blocks
        return self.quota_blocks - self.blocks[tenant]

    def track(self, keys: list[BlockHash], cache_salt: str, tenant: str, live: Container) -> None:
        """Remember the path of `keys` (its first key) as `cache_salt`'s and `tenant`'s; `live`
        holds the first keys of the cached paths (those of the others are forgotten)."""
        if not keys or not (cache_salt or tenant):
            return
        self._path_of[keys[0]] = (cache_salt, tenant)
        if isinstance(live, Sized) and len(self._path_of) > 2 * len(live) + PRUNE_SLACK:
            self._path_of = {k: v for k, v in self._path_of.items() if k in live}

    def path(self, first_key: BlockHash) -> tuple[str, str]:
        """(cache salt, tenant) of the path starting with `first_key`; ("", "") if untracked."""
        return self._path_of.get(first_key, ("", ""))
