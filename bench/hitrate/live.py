"""A block trace through the live cache: a real `PrefixCache` (device tier, CPU pool), against
the replay on the bare index (`bench.hitrate.replay`) and block-exact LRU
(`bench.hitrate.offline.block_lru_hits`), which all three must equal under LRU.

A served request stores more than its prompt's cacheable blocks: the engine caches the K/V of
the prompt and of its answer, so the prompt's last partial block, completed by the answer, and
the answer's full blocks follow the prompt on its path. The next turn's prompt resends the
answer as the trace has it, not as the model wrote it, so its hit ends at the earlier prompt's
cacheable blocks, partway into that run: the answer's blocks are the unused tail a hit must not
refresh. `with_answers` makes such a trace: every request's chain is its cacheable blocks and
then its answer's blocks (ids no other request shares), and a lookup may hit only the former.

Per request, as the engine does it: `lookup` the cacheable blocks (a hit locks them), `store`
the whole chain (it evicts for the blocks it adds), `release`. One token a block: a block's id
is its token, so the cache's chained hashes name exactly the trace's chains.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from bench.hitrate.simulate import ReplayResult
from bench.traces import BlockTrace, cacheable_blocks, from_chains
from hashing import Namespace
from kvstore.cache import PrefixCache
from kvstore.config import CacheConfig

__all__ = ["live_replay", "mooncake_answers", "serve", "with_answers"]


def mooncake_answers(path: str | Path) -> list[int]:
    """The `output_length` of every request of a Mooncake-format trace, in order."""
    with open(path, encoding="utf-8") as f:
        return [int(json.loads(line)["output_length"]) for line in f if line.strip()]


def with_answers(trace: BlockTrace, answer_tokens: Sequence[int]) -> tuple[BlockTrace, list[int]]:
    """(the trace with each request's answer blocks after its cacheable blocks, each request's
    cacheable block count). A request of L prompt tokens and an answer of A tokens stores the
    full blocks of its L + A tokens."""
    if len(answer_tokens) != trace.num_requests:
        raise ValueError(f"got {len(answer_tokens)} answer lengths for {trace.num_requests}")
    bt, fresh, chains, lookup = trace.block_tokens, trace.num_unique, [], []
    lengths = trace.num_tokens.tolist()
    for r, (length, answer) in enumerate(zip(lengths, answer_tokens, strict=True)):
        blocks = trace.request(r).tolist()
        extra = max((length + int(answer)) // bt - cacheable_blocks(length, bt), 0)
        chains.append(blocks + list(range(fresh, fresh + extra)))
        lookup.append(len(blocks))
        fresh += extra
    return from_chains(chains, bt, f"{trace.name}+answers"), lookup


def live_replay(
    trace: BlockTrace, capacity: int, lookup: Sequence[int] | None = None
) -> ReplayResult:
    """Device block hits of a `PrefixCache` of `capacity` blocks (LRU) serving `trace`;
    `lookup[r]` (default: all) is how many leading blocks request r may hit."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 block, got {capacity}")
    ns = Namespace("bench-live", "float32", 1, 1, 1, 1)
    cache = PrefixCache(CacheConfig(block_size=1, device_blocks=capacity), ns)
    offsets, hits = trace.offsets.tolist(), 0
    for r in range(trace.num_requests):
        tokens = trace.blocks[offsets[r] : offsets[r + 1]].astype(np.uint32)
        hits += serve(cache, tokens, len(tokens) if lookup is None else lookup[r])
    cache.close()
    return ReplayResult(hits, hits * trace.block_tokens)


def serve(cache: PrefixCache, tokens: np.ndarray, lookup: int) -> int:
    """One request as the engine serves it (one token a block): the device hit of its first
    `lookup` blocks, then its whole chain stored. Returns the blocks hit."""
    hit = cache.lookup(tokens[:lookup], whole_prompt=True)
    kv = torch.zeros(1, 1, len(tokens), 1)
    cache.store(tokens, [(kv, kv)])
    cache.release(hit)
    return hit.num_cached_tokens
