"""Eviction policies by name: `POLICIES` and `make_policy`. Each policy implements the
`Policy` contract of `kvstore.policies.base`: the recency and frequency policies live in
`kvstore.policies.heap`, the FIFO family in `kvstore.policies.fifo`, LHD in `kvstore.policies.lhd`
(docs/POLICIES.md describes them all)."""

from __future__ import annotations

from kvstore.policies.base import IntegrityError, Policy
from kvstore.policies.fifo import MAIN, SMALL, AdaptiveS3FIFOPolicy, ARCPolicy, S3FIFOPolicy
from kvstore.policies.heap import LFUPolicy, LRUPolicy, SLRUPolicy
from kvstore.policies.lhd import LHDPolicy

__all__ = [
    "MAIN",
    "POLICIES",
    "SMALL",
    "ARCPolicy",
    "AdaptiveS3FIFOPolicy",
    "IntegrityError",
    "LFUPolicy",
    "LHDPolicy",
    "LRUPolicy",
    "Policy",
    "S3FIFOPolicy",
    "SLRUPolicy",
    "make_policy",
]


POLICIES: dict[str, type[Policy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "slru": SLRUPolicy,
    "s3fifo": S3FIFOPolicy,
    "as3fifo": AdaptiveS3FIFOPolicy,
    "arc": ARCPolicy,
    "lhd": LHDPolicy,
}


def make_policy(name: str, capacity_blocks: int | None = None) -> Policy:
    """A fresh policy by name; `capacity_blocks` (the pool size) sizes segmented policies."""
    try:
        cls = POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {list(POLICIES)}"
        ) from None
    return cls(capacity_blocks)
