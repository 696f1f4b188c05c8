"""A real cache over one spill store, its prompts, and what the store holds: for the tier
events tests (tests/tiers/test_tier_events.py, tests/engine/test_kv_events_tiers.py)."""

from __future__ import annotations

import numpy as np
import torch

from hashing import Namespace
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig
from kvstore.fleet.events import EventSink
from kvstore.stores import MemoryStore, SpillStore

LAYERS, HEADS, BS, DIM = 2, 2, 4, 8
ENTRY_BYTES = LAYERS * 2 * HEADS * BS * DIM * 4  # one block's KV, float32


def make_cache(store: SpillStore, sink: EventSink, chunk_blocks: int = 1) -> PrefixCache:
    ns = Namespace("fp", "float32", LAYERS, HEADS, DIM, BS)
    config = CacheConfig(block_size=BS, device_blocks=12, device="cpu", chunk_blocks=chunk_blocks)
    return PrefixCache(config, ns, stores=[store], events=sink)


def run_prompts(cache: PrefixCache, num_prompts: int, seed: int = 0) -> list[list[bytes]]:
    """Distinct prompts of 4-8 blocks: the pool (12 blocks) evicts, the tier fills and
    evicts. Returns each prompt's block keys."""
    rng = np.random.default_rng(seed)
    chains = []
    for _ in range(num_prompts):
        prompt = rng.integers(0, 1000, BS * int(rng.integers(4, 9)) + 1).astype(np.uint32)
        hit = cache.lookup(prompt)
        kv = torch.randn(1, HEADS, len(prompt), DIM)
        cache.store(prompt, [(kv, kv)] * LAYERS, keys=hit.keys)
        cache.release(hit)
        chains.append(cache.hasher.hash_blocks(prompt))
    assert cache.tiers.flush(10)
    return chains


def tier_blocks(store: SpillStore, chains: list[list[bytes]], n: int) -> set[bytes]:
    """The blocks of every entry the store holds now (an entry: n blocks, by its last key)."""
    held = set()
    for keys in chains:
        whole = len(keys) // n * n
        present = store.contains_many([keys[i] for i in range(n - 1, whole, n)])
        for j, there in enumerate(present):
            if there:
                held.update(keys[j * n : (j + 1) * n])
    return held


def device_blocks(cache: PrefixCache) -> set[bytes]:
    return {key for event in cache.snapshot_events() for key in event.block_hashes}


def memory_store(entries: int) -> MemoryStore:
    return MemoryStore(entries * (ENTRY_BYTES + 512))
