"""Hand-over: a prefill replica makes a prompt's blocks readable from its shared tiers (those
other processes read: Redis, LMDB) before it answers, so that a decode replica that reads the
same tier loads them as verified entries, like any other tier hit (docs/ARCHITECTURE.md
"Prefill and decode replicas").

Order of the steps, and why:
1. the writes queued before the call finish (the prompt's write-through writes among them):
   a barrier in the writer's queue, which later writes cannot hold up;
2. one presence check per shared store says which leading blocks they hold;
3. the blocks they lack are written from the device pool (whatever the stores' write
   policies), and a second barrier waits for those writes.
Each entry is put whole (one SET, one LMDB transaction), so a reader never sees part of
one; the decode replica is sent the request only after this returns. A block that is neither
in a shared store nor on the device any more is `missing`: the decode replica recomputes it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from kvstore.scopes import Scope


class HandOver(NamedTuple):
    """What one hand-over did, in blocks of the prompt."""

    num_blocks: int  # the prompt's whole blocks
    present: int  # leading blocks every shared store already held
    written: int  # blocks written now, from the device pool
    complete: bool  # every write finished within the timeout

    @property
    def missing(self) -> int:
        """Blocks a decode replica will not find: it recomputes them."""
        return self.num_blocks - self.present - (self.written if self.complete else 0)


class Cached(NamedTuple):
    """The device pool's blocks of the prompt: `peek()` (their block ids, leading blocks
    first), called under `lock`, which keeps them cached while they are copied out."""

    lock: threading.RLock | threading.Lock
    peek: Callable[[], list[int]]


class _Writer(Protocol):
    def barrier(self, timeout: float) -> bool: ...


class _Tiers(Protocol):
    shared: tuple[int, ...]
    writer: _Writer

    def shared_prefix(self, keys: Sequence[bytes]) -> int: ...

    def write_shared(
        self, scope: Scope, keys: list[bytes], token_ids: np.ndarray, start: int, ids: list[int]
    ) -> int: ...


def hand_over(
    tiers: _Tiers,
    scope: Scope,
    keys: list[bytes],
    token_ids: np.ndarray,
    cached: Cached,
    timeout_s: float,
) -> HandOver:
    """Make blocks `keys` (the whole blocks of `token_ids`) readable from every shared store
    of `tiers`, writing what they lack from the device blocks `cached`."""
    if not tiers.shared:
        return HandOver(len(keys), 0, 0, False)
    deadline = time.monotonic() + timeout_s
    tiers.writer.barrier(timeout_s)  # a timeout here shows as blocks not present yet
    present = min(tiers.shared_prefix(keys), len(keys))
    written = 0
    if present < len(keys):
        with cached.lock:
            ids = cached.peek()
            written = tiers.write_shared(scope, keys[: len(ids)], token_ids, present, ids)
    done = not written or tiers.writer.barrier(max(0.0, deadline - time.monotonic()))
    return HandOver(len(keys), present, written, done)
