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
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvstore.scopes import Scope

if TYPE_CHECKING:
    from kvstore.index import RadixIndex
    from kvstore.tiers import Tiers


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


class HandOvers:
    """The cache's hand-overs: its device pool's blocks (`index`, under the cache's `lock`,
    which keeps them cached while they are copied out) to the shared stores of `tiers`."""

    def __init__(self, tiers: Tiers | None, index: RadixIndex, lock: threading.RLock):
        self.tiers, self.index, self.lock = tiers, index, lock

    def hand_over(
        self, scope: Scope, keys: list[bytes], token_ids: np.ndarray, timeout_s: float
    ) -> HandOver:
        """Make blocks `keys` (the whole blocks of `token_ids`) readable from every shared
        store, writing what they lack from the device pool."""
        tiers = self.tiers
        if tiers is None or not tiers.shared:
            return HandOver(len(keys), 0, 0, False)
        deadline = time.monotonic() + timeout_s
        tiers.writer.barrier(timeout_s)  # a timeout here shows as blocks not present yet
        present = min(tiers.shared_prefix(keys), len(keys))
        written = 0
        if present < len(keys):
            with self.lock:
                ids = self.index.peek_prefix(keys, token_ids).block_ids
                written = tiers.write_shared(scope, keys[: len(ids)], token_ids, present, ids)
        done = not written or tiers.writer.barrier(max(0.0, deadline - time.monotonic()))
        return HandOver(len(keys), present, written, done)
