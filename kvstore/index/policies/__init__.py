"""Eviction policies by name: `POLICIES` and `make_policy`. Each policy implements the
`Policy` contract of `base.py`: the recency and frequency policies live in `heap.py`, the
FIFO family in `fifo.py`, LHD in `lhd.py` (docs/POLICIES.md describes them all)."""

from __future__ import annotations

from kvstore.index.policies.base import IntegrityError, Policy
from kvstore.index.policies.fifo import MAIN, SMALL, AdaptiveS3FIFOPolicy, ARCPolicy, S3FIFOPolicy
from kvstore.index.policies.heap import LFUPolicy, LRUPolicy, SLRUPolicy
from kvstore.index.policies.lhd import LHDPolicy

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
    "as_policy",
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


def as_policy(policy: Policy | str) -> Policy:
    """`policy` itself, or a fresh one by name; TypeError for anything else."""
    if isinstance(policy, str):
        policy = make_policy(policy)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy or a policy name, got {type(policy).__name__}")
    return policy
