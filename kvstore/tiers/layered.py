"""Layer-by-layer loads from the spill tiers (docs/FORMAT.md, "Layer-by-layer loads").

A lookup that hits a spill tier promises its blocks at once and hands their bytes to a loader
thread, which copies them into the promised pool blocks one model layer at a time (layer 0 of
every block, then layer 1, ...). A forward waits in each attention layer for that layer only
(`LayerLoad.wait`), so early layers compute while later ones arrive.

Every entry's whole header is compared with the one the reader expects (namespace, secret's
key id, key, keyed digest of the prefix, parent, token ids, shape, sizes) before a copy: at
lookup time for stores that read in place (host memory, LMDB), on the loader for the others
(Redis: there the promise is a key count, and the values arrive on the loader). Each entry's
checksum is checked on the loader after the last layer. So a forward may compute on bytes
whose checksum is not known yet; the caller then calls `result()` before it uses anything
the forward produced, gives the index only the blocks that verified, and when fewer verified
than were promised drops the forward's output and computes again (the engine preempts the
request; its retry finds the verified blocks in the pool and recomputes the rest).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvstore.entry import CHECKSUM_BYTES, EntryError
from kvstore.entry.expected import ExpectedEntry
from kvstore.layout import KVLayout, as_block
from kvstore.stores import SpillStore

log = logging.getLogger("kvstore.tiers")


class Segment(NamedTuple):
    """Verified blocks fetched from one tier, consecutive in the prompt."""

    tier: str
    num_blocks: int


class LoadEntry(NamedTuple):
    """One tier entry of a load: its key, the header the reader expects, its first block in
    the prompt and the blocks [lo, hi) of it the load copies."""

    key: bytes
    header: bytes
    first: int
    lo: int
    hi: int


@dataclass
class LoadPart:
    """The blocks one store gives a load: consecutive, from block `pos` on, one destination
    each. `values` are read at lookup time (a store that reads in place, its headers already
    compared) or None: read on the loader."""

    store: SpillStore
    entries: list[LoadEntry]
    dst: list[torch.Tensor | memoryview]
    pos: int
    values: list[bytes | memoryview] | None
    num_ok: int = 0  # leading entries whose header matched
    num_verified: int = 0  # leading entries whose checksum matched too
    read_s: float = 0.0  # the loader's read of `values` (0: read at lookup time)

    def blocks_of(self, num_entries: int) -> int:
        return sum(e.hi - e.lo for e in self.entries[:num_entries])


@dataclass(eq=False)
class LayerLoad:
    """Blocks a lookup promised from the tiers, on their way into pool blocks.

    Each layer's copy is one task, claimed once: by the loader thread, in layer order, or
    by a caller of `wait` that needs a layer nobody has claimed yet (on a machine with no
    core to spare, the forward copies each layer itself just before it reads it)."""

    num_layers: int
    parts: list[LoadPart] = field(default_factory=list)
    failures: list[tuple[SpillStore, bytes, EntryError]] = field(default_factory=list)
    load_s: float = 0.0  # the loader's own time: reads, copies, checksums
    wait_s: float = 0.0  # time callers spent blocked in `wait` and `result`
    _layers: list[threading.Event] = field(default_factory=list)
    _ready: threading.Event = field(default_factory=threading.Event)  # values and views
    _done: threading.Event = field(default_factory=threading.Event)
    _claim: threading.Lock = field(default_factory=threading.Lock)
    _next: int = 0  # the first layer nobody has claimed
    _copied: int = 0  # layers copied without an error
    _copies: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=list)
    _contexts: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def __post_init__(self) -> None:
        self._layers = [threading.Event() for _ in range(self.num_layers)]

    @property
    def num_blocks(self) -> int:
        """Blocks promised."""
        return sum(len(part.dst) for part in self.parts)

    def enter(self, context: contextlib.AbstractContextManager) -> list:
        """A store read kept open until `close` (an LMDB read transaction's views)."""
        return list(self._contexts.enter_context(context))

    def wait(self, layer: int) -> None:
        """Until layer `layer` of every promised block is in the pool (or the load ended);
        copies the unclaimed layers up to it itself."""
        if self._layers[layer].is_set():
            return
        start = time.perf_counter()
        self._ready.wait()
        while not self._layers[layer].is_set():
            claimed = self.claim(up_to=layer)
            if claimed is None:
                self._layers[layer].wait()  # the loader is copying it
            else:
                self.copy(claimed)
        self.wait_s += time.perf_counter() - start

    def claim(self, up_to: int | None = None) -> int | None:
        """The next layer to copy (at most `up_to`), now the caller's; None: none left."""
        with self._claim:
            if self._next >= len(self._copies) or (up_to is not None and self._next > up_to):
                return None  # (no copies before `prepare`, none left after `finish`)
            self._next += 1
            return self._next - 1

    def copy(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Copy a claimed layer of every block whose header matched (one call, no GIL);
        `stream`: the loader's own CUDA stream, finished before the layer counts as there
        (a caller's copy runs on its current stream, in order with its forward)."""
        try:
            dst, src = self._copies[layer]
            if dst and stream is not None:
                with torch.cuda.stream(stream):
                    torch._foreach_copy_(dst, src)
                stream.synchronize()
            elif dst:
                torch._foreach_copy_(dst, src)
            with self._claim:
                self._copied += 1
        finally:  # a layer that failed to copy is waited for no more; `result` is then 0
            self._layers[layer].set()

    def prepare(self, layout: KVLayout, header_bytes: int) -> None:
        """Per layer, the destination and source views of every block to copy; then the
        layers may be claimed."""
        per_layer: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [
            ([], []) for _ in range(self.num_layers)
        ]
        for part in self.parts:
            for entry, value in zip(part.entries[: part.num_ok], part.values or (), strict=False):
                blocks = entry_blocks(value, header_bytes, layout)
                for b in range(entry.lo, entry.hi):
                    dst = as_block(part.dst[b - part.pos], layout).unbind(0)
                    src = blocks[b - entry.first].unbind(0)
                    for layer in range(self.num_layers):
                        per_layer[layer][0].append(dst[layer])
                        per_layer[layer][1].append(src[layer])
        self._copies = per_layer
        self._ready.set()

    def result(self) -> int:
        """Waits for the end: the number of leading promised blocks that verified."""
        if not self._done.is_set():
            start = time.perf_counter()
            self._done.wait()
            self.wait_s += time.perf_counter() - start
        if self._copied < self.num_layers:
            return 0  # a copy failed (or never ran): no promised block holds every layer
        verified = 0
        for part in self.parts:
            verified += part.blocks_of(part.num_verified)
            if part.num_verified < len(part.entries):
                break
        return verified

    def segments(self) -> list[Segment]:
        """The verified blocks by tier, in order (waits for the end)."""
        out, left = [], self.result()
        for part in self.parts:
            got = min(left, part.blocks_of(part.num_verified))
            if got:
                out.append(Segment(part.store.name, got))
            left -= got
        return out

    def close(self) -> None:
        """End the reads kept open, on the thread that opened them (after `result`)."""
        self._contexts.close()

    def finish(self) -> None:
        """The load ended (or failed): nothing more is claimed, nobody waits any more."""
        with self._claim:
            self._next = self.num_layers
        for event in self._layers:
            event.set()
        self._ready.set()
        self._done.set()


class LayerLoader:
    """The loader thread of one cache: runs each load's reads, per-layer copies and checks."""

    def __init__(self, layout: KVLayout, device: torch.device):
        self.layout = layout
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-layers")
        # copies to a GPU run beside the forward's kernels, on a stream of their own
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._device = device

    def start(self, load: LayerLoad, expected: ExpectedEntry) -> None:
        if not load.parts:
            load.finish()
            return
        after = None
        if self._stream is not None:  # the pool blocks' earlier kernels end before the copies
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self._device))  # the pool's GPU
        self._pool.submit(self._run, load, expected, after)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _run(
        self, load: LayerLoad, expected: ExpectedEntry, after: torch.cuda.Event | None
    ) -> None:
        start = time.perf_counter()
        try:
            if after is not None and self._stream is not None:
                self._stream.wait_event(after)
            for part in load.parts:
                if part.values is None:
                    _read(part, expected)
            load.prepare(self.layout, expected.header_bytes)
            while (layer := load.claim()) is not None:
                load.copy(layer, self._stream)
            for part in load.parts:
                _verify(part, expected, load.failures)
        except Exception:  # a miss from here on: what verified so far stands
            log.exception("kvstore: a layer-by-layer tier load failed")
        finally:
            load.load_s = time.perf_counter() - start
            load.finish()


def entry_blocks(
    value: bytes | memoryview, header_bytes: int, layout: KVLayout
) -> tuple[torch.Tensor, ...]:
    """The blocks of an entry's payload [layers, 2, heads, n * block_size, head_dim], as n
    views [layers, 2, heads, block_size, head_dim] (zero-copy)."""
    mv = memoryview(value).cast("B") if isinstance(value, memoryview) else memoryview(value)
    n = (len(mv) - header_bytes - CHECKSUM_BYTES) // layout.bytes_per_block
    layers, _, heads, bs, dim = layout.block_shape
    count = n * layout.bytes_per_block
    kv = torch.frombuffer(mv, dtype=torch.uint8, offset=header_bytes, count=count)
    return kv.view(layout.dtype).view(layers, 2, heads, n, bs, dim).unbind(3)


def _read(part: LoadPart, expected: ExpectedEntry) -> None:
    """The part's values from its store, on the loader; the leading entries whose header is
    the expected one count. One that differs is not recorded here: it was promised, so the
    request computes again, and that lookup's whole read records it (once)."""
    start = time.perf_counter()
    with part.store.read_prefix([e.key for e in part.entries]) as values:
        part.values = list(values)
    part.read_s = time.perf_counter() - start
    part.num_ok = leading_headers(part, expected)


def leading_headers(part: LoadPart, expected: ExpectedEntry) -> int:
    """How many leading values of the part have the header its entry expects."""
    values = part.values or []
    for i, (entry, value) in enumerate(zip(part.entries, values, strict=False)):
        if not expected.has_header(value, entry.header):
            return i
    return min(len(values), len(part.entries))


def _verify(part: LoadPart, expected: ExpectedEntry, failures: list) -> None:
    """Checksums of the entries whose header matched, up to the first that fails (damaged)."""
    for i in range(part.num_ok):
        if not expected.checksum_ok(part.values[i]):  # type: ignore[index]
            error = EntryError("checksum", "the payload does not match the entry's checksum")
            failures.append((part.store, part.entries[i].key, error))
            break
        part.num_verified = i + 1


def waits(loads: Iterable[LayerLoad | None]) -> Callable[[int], None] | None:
    """One per-layer wait over several loads (a step's), None when there is none."""
    pending = [load for load in loads if load is not None]
    if not pending:
        return None

    def wait(layer: int) -> None:
        for load in pending:
            load.wait(layer)

    return wait
