"""TenantBlocks: device blocks per tenant against `tenant_quota_blocks`, and the cache salt
of each cached path, remembered by the path's first block key (write-back writes under it).
A cached run's blocks are counted against the tenant that inserted it, its owner
(`TreeNode.owner`): eviction and window punches give them back to that tenant."""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Sized

from hashing import BlockHash

PRUNE_SLACK = 1024  # paths remembered past twice the live ones before forgetting dead ones


class TenantBlocks:
    """Block counts per tenant and the cache salt of each path; the cache's lock guards it."""

    def __init__(self, quota_blocks: int | None, pool_blocks: int):
        self.quota_blocks, self.pool_blocks = quota_blocks, pool_blocks
        self.blocks: Counter[str] = Counter()  # device blocks per tenant
        self._salt_of: dict[BlockHash, str] = {}

    def quota_left(self, tenant: str) -> int:
        if self.quota_blocks is None:
            return self.pool_blocks
        return self.quota_blocks - self.blocks[tenant]

    def track(self, keys: list[BlockHash], cache_salt: str, live: Container) -> None:
        """Remember the path of `keys` (its first key) as `cache_salt`'s; `live` holds the
        first keys of the cached paths (those of the others are forgotten)."""
        if not keys or not cache_salt:
            return
        self._salt_of[keys[0]] = cache_salt
        if isinstance(live, Sized) and len(self._salt_of) > 2 * len(live) + PRUNE_SLACK:
            self._salt_of = {k: v for k, v in self._salt_of.items() if k in live}

    def salt(self, first_key: BlockHash) -> str:
        """The cache salt of the path starting with `first_key`; "" if untracked."""
        return self._salt_of.get(first_key, "")

    def check(self, owned: Counter[str], num_cached: int) -> None:
        """The counts are those of the cached runs' owners (`owned`), none negative, and add
        up to the cached blocks; AssertionError otherwise."""
        counts = {t: n for t, n in self.blocks.items() if n}
        if any(n < 0 for n in counts.values()):
            raise AssertionError(f"a tenant's block count is negative: {counts}")
        if counts != {t: n for t, n in owned.items() if n}:
            raise AssertionError(f"tenant block counts {counts} != their runs' {dict(owned)}")
        total = sum(counts.values())
        if total != num_cached:
            raise AssertionError(f"tenant counts add up to {total}, not {num_cached}")
