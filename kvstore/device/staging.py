"""Where a promoted lookup's tier reads land, and how they reach the pool.

A `Stage` hands out one destination per block, in read order (the k-th is row k), and moves
rows into pool blocks with `upload`, which the promotion calls once per tier, as soon as that
tier's blocks are verified:

- `InPlace` (a CPU pool): the destinations are the pool blocks' own bytes, so the verified
  copy out of a store is the only copy and `upload` has nothing to move;
- `HostStaging` (a GPU pool): the destinations are rows of one reusable host buffer, pinned
  on CUDA, that every lookup shares (grown to the largest lookup, one lookup at a time).
  `upload` moves a tier's rows in one transfer on a copy stream, then scatters them into the
  pool blocks; the caller's stream (the forward's) waits for it by event, never the host.
  The next lookup waits for the last transfer out of the buffer before writing it again.

Entries are verified in host memory, where they arrive, before any byte moves to the device:
docs/FORMAT.md, "Verification on read"."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from kvstore.layout import tensor_bytes

Destination = torch.Tensor | memoryview


class Stage(ABC):
    """One lookup's destinations and their way into the pool."""

    @abstractmethod
    def destinations(self, block_ids: Sequence[int]) -> list[Destination]:
        """Where the next len(block_ids) blocks read land (rows in order)."""

    @abstractmethod
    def upload(self, block_ids: Sequence[int], first: int) -> None:
        """Rows [first, first + len(block_ids)) into the pool blocks `block_ids`."""


class InPlace(Stage):
    """The pool's own memory (`raw`: a destination per block id)."""

    def __init__(self, raw: Callable[[Sequence[int]], list[Destination]]):
        self._raw = raw

    def destinations(self, block_ids: Sequence[int]) -> list[Destination]:
        return self._raw(block_ids)

    def upload(self, block_ids: Sequence[int], first: int) -> None:
        return None


class HostStaging:
    """The reusable host buffer of a staged pool's lookups, and its copy stream."""

    def __init__(self, rows: torch.Tensor):
        """`rows`: the pool's storage, one row per block ([num_blocks, *row]: a block's
        K/V, or a quantized pool's payload bytes)."""
        self.kv, self.device = rows, rows.device
        self.row_bytes = rows[0].numel() * rows.element_size()
        self._buffer: torch.Tensor | None = None  # [rows, *row]
        self._lock = threading.Lock()
        on_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if on_cuda else None
        self._done: torch.cuda.Event | None = None  # the last transfer out of the buffer
        self.num_transfers = 0  # uploads into the pool: one per tier of each lookup

    @contextmanager
    def lookup(self, max_blocks: int) -> Iterator[Stage]:
        """The buffer, for one lookup of at most `max_blocks` blocks."""
        with self._lock:
            if self._done is not None:
                self._done.synchronize()  # the previous lookup's rows have left
            yield _StagedLookup(self, self._rows(max_blocks))

    def _rows(self, n: int) -> torch.Tensor:
        """At least `n` rows, pinned on CUDA (grown, never shrunk)."""
        if self._buffer is None or len(self._buffer) < n:
            pin = self.device.type == "cuda"
            shape = (max(n, 1), *self.kv.shape[1:])
            self._buffer = torch.empty(shape, dtype=self.kv.dtype, pin_memory=pin)
        return self._buffer

    def upload(self, rows: torch.Tensor, block_ids: Sequence[int]) -> None:
        """`rows` ([n, *row], host) into pool blocks `block_ids`, in one transfer."""
        if self._stream is None:
            ids = torch.as_tensor(block_ids, dtype=torch.long)
            self.kv.index_copy_(0, ids, rows.to(self.device))
        else:
            compute = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(compute)  # kernels still reading the blocks before
            with torch.cuda.stream(self._stream):
                ids = torch.as_tensor(block_ids, dtype=torch.long).to(self.device)
                self.kv.index_copy_(0, ids, rows.to(self.device, non_blocking=True))
                self._done = torch.cuda.Event()
                self._done.record(self._stream)
            compute.wait_event(self._done)  # the forward reads them after the transfer
        self.num_transfers += 1


class _StagedLookup(Stage):
    def __init__(self, staging: HostStaging, buffer: torch.Tensor):
        self.staging, self.buffer, self._next = staging, buffer, 0
        self._bytes = tensor_bytes(buffer)
        self._size = staging.row_bytes

    def destinations(self, block_ids: Sequence[int]) -> list[Destination]:
        first, size = self._next, self._size
        self._next += len(block_ids)
        if self._next > len(self.buffer):
            raise ValueError(f"{self._next} rows staged, the lookup asked for {len(self.buffer)}")
        rows = range(first, first + len(block_ids))
        return [self._bytes[row * size : (row + 1) * size] for row in rows]

    def upload(self, block_ids: Sequence[int], first: int) -> None:
        if block_ids:
            self.staging.upload(self.buffer[first : first + len(block_ids)], block_ids)
