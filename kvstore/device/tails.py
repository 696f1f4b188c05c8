"""Partial last blocks of finished requests, kept on the device for the request that goes on.

The radix index holds full blocks only, so a request's last, partly filled block is freed
when it finishes, and the next turn of a chat (the same tokens, then more) recomputes its
tokens: up to block_size - 1 of them, about half a block on average. On a small CPU a
turn's suffix is a few dozen tokens, so that is a large share of its prefill.

`TailCache` keeps such blocks instead, up to `capacity`, least recently used first out. A
tail is found by a digest of the whole token prefix before it (xxh3-128 over the cache
salt and the prefix's int64 token ids, not the index's lookup keys, which may be truncated)
and holds the token ids whose K/V it holds. A lookup whose device hit ends where a tail
starts may take the tail's first j tokens that its prompt repeats: `BlockTables.open` copies
the tail into a fresh block of the request (the tail stays for other requests that go on
from the same prefix). Tails live on the device only: they are not indexed, stored to a
tier or announced in KV events, and the pool takes them back first when it runs short.

A running request may also lend its partly filled block (`LentTail`, not kept here: the
lender holds it) to requests that repeat its tokens, a group's other sequences; `copy` gives
each a copy of its own, counted as a tail hit.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from kvstore.metrics import DEVICE_TIER, CacheMetrics

DEFAULT_MAX_TAILS = 64  # tails kept when `tail_blocks` is None (at most 1/16 of the pool)


class Tail(NamedTuple):
    block_id: int  # the pool block; the tail holds one reference to it
    token_ids: np.ndarray  # [n] int64, 1 <= n < block_size: the positions it holds


class TailMatch(NamedTuple):
    block_id: int  # a fresh block of the caller's, the tail copied into it
    num_tokens: int  # leading tokens of the tail that the prompt repeats (>= 1)


class LentTail(NamedTuple):
    """A running request's partly filled last block, lent (one reference, no copy) to the
    requests that go on from the same tokens (a group's branches, engine/loop/group.py)."""

    block_id: int
    start: int  # the tokens before it (a whole number of blocks)
    num_tokens: int  # its leading positions the borrowers repeat, 1 to block_size - 1


def tail_capacity(tail_blocks: int | None, num_blocks: int, keeps_tails: bool) -> int:
    """Tails a pool of `num_blocks` keeps: `tail_blocks`, or by default up to 1/16 of the
    pool; none when the attention kind keeps none (window models' requests drop blocks as
    they decode)."""
    if not keeps_tails:
        return 0
    return min(DEFAULT_MAX_TAILS, num_blocks // 16) if tail_blocks is None else tail_blocks


def prefix_digest(cache_salt: str, token_ids: np.ndarray) -> bytes:
    """The identity of a token prefix under a cache salt (token_ids int64)."""
    h = xxhash.xxh3_128(cache_salt.encode())
    h.update(b"\x00")
    h.update(np.ascontiguousarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int64 arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class TailCache:
    """Tails by prefix digest, at most `capacity` blocks of a pool, least recently used
    first out; every method runs under the cache's (re-entrant) lock.

    `allocate(n)` gives up to n fresh blocks of the caller's (evicting as needed), `free`
    drops a reference; `rows` is the pool's storage, a row per block (`BlockPool.rows`)."""

    def __init__(
        self,
        capacity: int,
        lock: threading.RLock,
        rows: torch.Tensor,
        block_size: int,
        allocate: Callable[[int], list[int]],
        free: Callable[[Sequence[int]], None],
        metrics: CacheMetrics,
    ):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"tail capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self.block_size = block_size
        self._lock, self._kv = lock, rows  # a block's K/V, or a quantized pool's payload
        self._allocate, self._free, self._metrics = allocate, free, metrics
        # (prefix digest, tail token bytes) -> Tail, oldest first
        self._tails: OrderedDict[tuple[bytes, bytes], Tail] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tails)

    def block_ids(self) -> list[int]:
        """The blocks the tails hold, least recently used first."""
        with self._lock:
            return [tail.block_id for tail in self._tails.values()]

    def put(self, cache_salt: str, token_ids: np.ndarray, block_id: int) -> None:
        """Keep `block_id` (the caller's reference passes to the cache): it holds the K/V of
        the tokens of token_ids (int64) past its last full block, 1 to block_size - 1."""
        full = len(token_ids) // self.block_size * self.block_size
        digest = prefix_digest(cache_salt, token_ids[:full])
        tail = Tail(block_id, np.array(token_ids[full:], dtype=np.int64))
        with self._lock:
            old = self._tails.pop((digest, tail.token_ids.tobytes()), None)
            if old is not None:
                self._free([old.block_id])  # the same tokens again: the newer stays
            self._tails[(digest, tail.token_ids.tobytes())] = tail
            self.release(len(self._tails) - self.capacity)

    def take(self, cache_salt: str, token_ids: np.ndarray, num_blocks: int) -> TailMatch | None:
        """For a lookup of token_ids (int64) whose hit holds its first `num_blocks` blocks: a
        fresh block holding the K/V of the tail after them that token_ids repeats furthest
        (copied: the tail stays), or None (no tail repeats a token, or no block is free)."""
        start = num_blocks * self.block_size
        if not self._tails or len(token_ids) <= start:
            return None
        digest = prefix_digest(cache_salt, token_ids[:start])
        nxt = token_ids[start : start + self.block_size - 1]
        with self._lock:
            key, n = self._best(digest, nxt)
            if key is None:
                return None
            tail = self._tails.pop(key)  # out while allocating: the pool cannot take it back
            block = self._copy(tail.block_id)
            self._tails[key] = tail  # the most recently used
        if block is None:
            return None
        return self._hit(block, n)

    def copy(self, lent: LentTail) -> TailMatch | None:
        """A fresh block with the K/V of a lent tail (its positions past `lent.num_tokens`
        are masked until the caller writes them), counted as a tail hit; None when no block
        is free."""
        with self._lock:
            block = self._copy(lent.block_id)
        return None if block is None else self._hit(block, lent.num_tokens)

    def _hit(self, block: int, n: int) -> TailMatch:
        self._metrics.inc("tail_hits_tokens_total", n)
        self._metrics.inc("prefix_cache_hits_tokens_total", n, tier=DEVICE_TIER)
        return TailMatch(block, n)

    def _best(self, digest: bytes, nxt: np.ndarray) -> tuple[tuple[bytes, bytes] | None, int]:
        best, best_n = None, 0
        for key, tail in self._tails.items():
            if key[0] == digest and (n := _common(tail.token_ids, nxt)) > best_n:
                best, best_n = key, n
        return best, best_n

    def _copy(self, src: int) -> int | None:
        """A fresh block with src's K/V (every layer). Its positions past the repeated tokens
        are masked until the caller's request writes them."""
        ids = self._allocate(1)
        if not ids:
            return None
        self._kv[ids[0]] = self._kv[src]
        return ids[0]

    def release(self, n: int) -> int:
        """Free up to n tails, least recently used first; returns how many."""
        with self._lock:
            freed = []
            while len(freed) < n and self._tails:
                freed.append(self._tails.popitem(last=False)[1].block_id)
            self._free(freed)
            return len(freed)

    def clear(self) -> int:
        return self.release(len(self._tails))
