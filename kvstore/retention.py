"""Retention: prefixes a client asked to keep (Anthropic `cache_control`, OpenAI
`prompt_cache_retention`, or `PrefixCache.retain`), on the device and in the spill tiers.

On the device a retained block is evicted only after every evictable unretained block, or
once its TTL passed (`RetainingPolicy`, the index's policy). Retention never blocks
admission: the device blocks retained are capped in total (`retention_max_fraction` of the
pool) and per tenant (`retention_quota_blocks`); a prefix is retained from its first block
on until a cap is reached, and the rest is not retained on the device. A tenant's blocks
past its quota stay ordinary blocks, so they cannot make another tenant's blocks go sooner
than plain eviction would. In the spill tiers every entry of the prefix is kept at least
until the TTL ends (`SpillStore.retain`), whatever the device kept.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from hashing import BlockHash
from kvstore.config import CacheConfig
from kvstore.index import RadixIndex, TreeNode
from kvstore.index.policies.retaining import RetainingPolicy
from kvstore.scopes import Scope

if TYPE_CHECKING:
    from kvstore.tiers import Tiers


def check_ttl(ttl_s: object) -> float:
    """A retention's TTL in seconds, or a ValueError that says what is wrong."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not ttl_s > 0:
        raise ValueError(f"ttl_s must be a number of seconds > 0, got {ttl_s!r}")
    return float(ttl_s)


class RetainResult(NamedTuple):
    num_blocks: int  # full blocks of the prefix cached on the device when asked
    num_device_blocks: int  # of those, retained on the device (within the caps)
    num_tier_entries: int  # spill-tier entries (chunks) given the TTL, per tier


class DeviceRetention:
    """The retained part of the radix index; every method expects the cache's lock held."""

    def __init__(self, config: CacheConfig, index: RadixIndex, pool_blocks: int):
        if not isinstance(index.policy, RetainingPolicy):
            raise TypeError("the index's policy must be a RetainingPolicy")
        self.index, self.policy = index, index.policy
        self.max_blocks = int(config.retention_max_fraction * pool_blocks)
        self.quota_blocks = config.retention_quota_blocks

    def retain(
        self, keys: Sequence[BlockHash], tokens: np.ndarray, ttl_s: float, tenant: str
    ) -> tuple[int, int]:
        """Retain the cached prefix of `keys` for ttl_s; returns (blocks cached, of which
        retained). A block retained already is refreshed and stays its first tenant's."""
        nodes = self.index.cut_path(keys, tokens)
        self.policy.expire()
        room, kept = self.room(tenant), 0
        for node in nodes:
            if self.policy.retained(node.id) is None:
                if room < node.num_held:
                    kept += self._retain_head(node, room, ttl_s, tenant)
                    break
                room -= node.num_held
            self.policy.retain(node.id, node.num_held, ttl_s, tenant)
            kept += node.num_held
        return sum(n.num_blocks for n in nodes), kept

    def _retain_head(self, node: TreeNode, room: int, ttl_s: float, tenant: str) -> int:
        """Retain the first `room` blocks of a run that does not fit whole (split off)."""
        if room <= 0 or node.num_held != node.num_blocks:  # a run with holes stays whole
            return 0
        head = self.index.split(node, room)
        self.policy.retain(head.id, room, ttl_s, tenant)
        return room

    def room(self, tenant: str) -> int:
        """Blocks `tenant` may still retain: under the total cap and its quota."""
        room = self.max_blocks - sum(self.policy.blocks.values())
        if self.quota_blocks is not None:
            room = min(room, self.quota_blocks - self.policy.blocks[tenant])
        return max(room, 0)

    def release(self, keys: Sequence[BlockHash], tokens: np.ndarray) -> int:
        """End every retention on the cached prefix of `keys`; returns the blocks released."""
        return sum(self.policy.release(node.id) for node in self.index.cut_path(keys, tokens))

    def stats(self) -> dict:
        self.policy.expire()
        counts = self.policy.counts
        return {
            "blocks_by_tenant": {t: n for t, n in self.policy.blocks.items() if n},
            "expired_blocks_total": counts.expired,
            "forced_blocks_total": counts.forced,
            "deferred_evictions_total": counts.deferred,
        }


class PrefixRetention:
    """A prompt's retention as the cache runs it: the device's part (`device`) and every
    spill tier's TTL (`tiers`), under the cache's `lock`."""

    def __init__(self, device: DeviceRetention, tiers: Tiers | None, lock: threading.RLock):
        self.device, self.tiers, self.lock = device, tiers, lock

    def retain(
        self, scope: Scope, keys: list[BlockHash], tokens: np.ndarray, ttl_s: float, tenant: str
    ) -> RetainResult:
        """Retain the prefix `keys` of `tokens` (`PrefixCache.retain`)."""
        ttl_s = check_ttl(ttl_s)
        with self.lock:
            num_blocks, kept = self.device.retain(keys, tokens, ttl_s, tenant)
            if not self.tiers:
                return RetainResult(num_blocks, kept, 0)
            ids = self.device.index.peek_prefix(keys, tokens).block_ids
            entries = self.tiers.retain(scope, keys, tokens, ids, ttl_s)
        return RetainResult(num_blocks, kept, entries)

    def release(self, keys: list[BlockHash], tokens: np.ndarray) -> int:
        """End the device retention of the prefix `keys` now; returns the blocks released."""
        with self.lock:
            return self.device.release(keys, tokens)
