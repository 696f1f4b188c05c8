"""BlockPool: one preallocated paged KV tensor on the device, a free list and ref counts.

A hybrid model's pool (full and sliding-window layers) keeps its window layers apart, in a
window plane: `HybridPool` (kvstore/device/hybrid_pool.py). This one holds every layer of a block
in one row; its window arguments and methods are the shared interface's, with nothing to do.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch

from hashing import Namespace
from kvstore.config import CacheConfig, ConfigError
from kvstore.device.quant_kv import (
    block_rows,
    copy_rows,
    dequantize,
    layer_view,
    pool_views,
    quantize_tokens,
)
from kvstore.device.staging import HostStaging, InPlace, Stage
from kvstore.device.window_plane import WindowPlane
from kvstore.entry.quant import QuantError
from kvstore.layout import KVLayout, LayerKV, layers_to_blocks, split_layers, tensor_bytes


def plane_storage(
    num_rows: int, layout: KVLayout, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(rows, kv, scales) of `num_rows` blocks of `layout`'s layers: kv itself (empty: no
    pages committed) and no scales, or a quantized layout's `QuantizedRows`, each row a
    quantized entry payload of one block (kvstore/device/quant_kv.py)."""
    if layout.quant is not None:
        return block_rows(num_rows, layout, device)
    kv = torch.empty((num_rows, *layout.block_shape), dtype=layout.dtype, device=device)
    return kv, kv, None


class PoolExhausted(RuntimeError):
    """Not enough free blocks; the caller should evict first."""


def resolve_device(name: str) -> torch.device:
    """The torch device of a `CacheConfig.device`, a GPU's with its index (`cuda` is
    `cuda:0` on most machines, as a model's parameters say); `ConfigError` for a CUDA device
    this machine does not have."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        why = "CUDA is not available (no GPU visible, or a CPU build of torch)"
        raise ConfigError("device", f"{name!r} requested but {why}; use cpu or auto")
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ConfigError("device", f"{name!r} requested but there are {count} CUDA devices")
    return device


def bytes_per_block(namespace: Namespace) -> int:
    return KVLayout.of(namespace).bytes_per_block


def pool_blocks(config: CacheConfig, namespace: Namespace, num_window_layers: int = 0) -> int:
    """Pool size in blocks: `device_blocks`, else `device_cache_gb` (default 1 GiB) in bytes.
    With `num_window_layers` (a hybrid model's), a block costs its full layers' bytes and
    `window_share` of its window layers' (the window plane's slots)."""
    if config.device_blocks is not None:
        return config.device_blocks
    num_full = namespace.num_layers - num_window_layers
    block = plane_bytes(namespace, num_full)
    block += config.window_share * plane_bytes(namespace, num_window_layers)
    return max(1, int(budget_bytes(config) // block))


def budget_bytes(config: CacheConfig) -> float:
    """`device_cache_gb` (default 1 GiB) in bytes."""
    return (1.0 if config.device_cache_gb is None else config.device_cache_gb) * 2**30


def plane_bytes(namespace: Namespace, num_layers: int) -> int:
    """A block's part of `num_layers` of its layers, in bytes, as a pool row of only those
    layers holds it (a quantized one pads its own scales); 0 for none."""
    if num_layers == 0:
        return 0
    return KVLayout.of(namespace).with_layers(num_layers).bytes_per_block


class BlockPool:
    """Paged KV storage. A block's ref_cnt counts its owners (the index, queued writes, ...);
    a block is on the free list iff its ref_cnt is 0."""

    window: WindowPlane | None = (
        None  # a hybrid pool's window plane (kvstore/device/hybrid_pool.py)
    )

    def __init__(self, num_blocks: int, namespace: Namespace, device: torch.device):
        self.layout = KVLayout.of(namespace)
        self.kv_cache_dtype = namespace.kv_cache_dtype  # auto, or a quantized pool's
        self.num_blocks = num_blocks
        self.block_size = self.layout.block_size
        self.device = device
        self.dtype = self.layout.dtype  # what attention computes in and loads return
        self.bytes_per_block = self.layout.bytes_per_block
        # a row per block: what a tail copies and a tier moves; kv [num_blocks, layers, 2,
        # kv_heads, block_size, head_dim], a quantized pool's values (scales: [num_blocks,
        # layers, 2, kv_heads, block_size], else None)
        self.rows, self.kv, self.scales = plane_storage(num_blocks, self._row_layout(), device)
        # flat and writable, in the entry payload's byte order (a big-endian host has none)
        little_cpu = device.type == "cpu" and sys.byteorder == "little"
        self._raw = tensor_bytes(self.rows) if little_cpu else None
        # a GPU pool: tier reads land in host staging, verified there in one pass, and reach
        # the pool in a transfer per tier (with a copy per block, a 112-block hit took 13 ms
        # over the ideal on an H100: docs/BENCHMARKS.md)
        self.stages_on_host = device.type != "cpu" and sys.byteorder == "little"
        self._staging: HostStaging | None = None  # made at the first staged lookup
        self.ref_cnt = np.zeros(num_blocks, dtype=np.int32)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack: pops 0, 1, 2...
        self.num_allocated = 0  # blocks `allocate` handed out since the pool was made

    def _row_layout(self) -> KVLayout:
        """The layout of a row of `kv`: the layers it holds."""
        return self.layout

    @classmethod
    def from_config(cls, config: CacheConfig, namespace: Namespace) -> BlockPool:
        """The configured pool (`device_blocks`, or `device_cache_gb` of blocks)."""
        return cls(pool_blocks(config, namespace), namespace, resolve_device(config.device))

    @property
    def nbytes(self) -> int:
        """The pool's KV bytes (a quantized pool's scales included)."""
        return self.rows.numel() * self.rows.element_size()

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner."""
        return len(self._free)

    def allocate(self, n: int, window: bool = True) -> list[int]:
        """Take `n` free blocks, each with ref_cnt 1 (owned by the caller)."""
        if n > len(self._free):
            raise PoolExhausted(f"need {n} blocks, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        self.ref_cnt[ids] = 1
        self.num_allocated += n
        return ids

    def assign_window(self, block_ids: Sequence[int]) -> None:
        """Give owned blocks their window parts (a hybrid pool's)."""
        return None

    def layer_views(self) -> list[tuple[torch.Tensor, bool]]:
        """Per model layer: its K/V in the pool, [num_blocks or num_slots, 2, kv_heads,
        block_size, head_dim], and whether that is a window plane (addressed by slot)."""
        return [(layer_view(self.kv, self.scales, i), False) for i in range(self.layout.num_layers)]

    def whole(self, block_ids: Sequence[int | None]) -> list[int | None]:
        """The ids, None for each block that does not hold every layer (a tier write skips it)."""
        return list(block_ids)

    def zero(self, block_ids: Sequence[int]) -> None:
        """Zero blocks (every part they hold)."""
        self.rows[self._ids(block_ids)] = 0

    def zero_window(self, block_ids: Sequence[int]) -> None:
        """Zero the window parts of blocks (a hybrid pool's)."""
        return None

    def destinations(self, block_ids: Sequence[int]) -> list[torch.Tensor | memoryview]:
        """The pool blocks' own memory, where reads may land: each block's raw bytes (a CPU
        pool: no tensor per block), or (a GPU pool, a big-endian host) the block's tensor
        [layers, 2, kv_heads, block_size, head_dim]."""
        raw, size = self._raw, self.bytes_per_block
        if raw is None:
            return [self.rows[i] for i in block_ids]
        return [raw[i * size : (i + 1) * size] for i in block_ids]

    def staged_reads(self, max_blocks: int) -> AbstractContextManager[Stage]:
        """Where a promoted lookup of at most `max_blocks` blocks lands and how it reaches
        the pool (kvstore/device/staging.py): reusable host staging and a transfer per tier
        on a GPU pool, the pool's own bytes on a CPU one."""
        if not self.stages_on_host:
            return nullcontext(InPlace(self.destinations))
        if self._staging is None:
            self._staging = HostStaging(self.rows)
        return self._staging.lookup(max_blocks)

    @property
    def num_transfers(self) -> int:
        """Staged uploads into the pool so far (one per tier of each promoted lookup)."""
        return 0 if self._staging is None else self._staging.num_transfers

    def incref(self, block_ids: Sequence[int], window: bool = True) -> None:
        """One more owner of each block (with `window`, of its window part too: a hybrid
        pool's)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] <= 0:
                raise ValueError(f"incref of free block {block_id}")
        for block_id in block_ids:
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Sequence[int], window: bool = True) -> None:
        """Drop one reference from each block; blocks reaching 0 return to the free list
        (`window`: the owner let go of the blocks' window parts too, a hybrid pool's)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] <= 0:
                raise ValueError(f"double free of block {block_id}")
        for block_id in block_ids:
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self._free.append(block_id)
                self._on_freed(block_id)

    def _on_freed(self, block_id: int) -> None:
        """A block went back to the free list."""
        return None

    def drop_window(self, block_ids: Sequence[int]) -> int:
        """An owner keeps each block but lets go of its window part (a hybrid pool's).
        Returns the window slots freed."""
        return 0

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(block_ids, dtype=torch.long, device=self.device)

    def gather(self, block_ids: Sequence[int], window_from: int | None = None) -> list[LayerKV]:
        """Per-layer (K, V) of the blocks in order, each [1, kv_heads, n * block_size, head_dim]
        (`window_from` as in `read_blocks`)."""
        n, ids = len(block_ids), self._ids(block_ids)
        layers, _, heads, bs, dim = self.layout.block_shape
        # one copy: index the block axis of a [layers, 2, heads, blocks, bs, dim] view
        out = torch.index_select(self.kv.permute(1, 2, 3, 0, 4, 5), 3, ids)
        if self.quantized:
            scales = torch.index_select(self.scales.permute(1, 2, 3, 0, 4), 3, ids)
            out = dequantize(out, scales, self.dtype)
        return split_layers(out.reshape(layers, 2, heads, n * bs, dim))

    def scatter(
        self, block_ids: Sequence[int], kv: Sequence[LayerKV], start_token: int = 0
    ) -> None:
        """Write tokens [start_token, start_token + n * block_size) of per-layer K/V into blocks.
        QuantError (a quantized pool) if they hold an inf or a NaN; nothing is written then."""
        if not block_ids:
            return
        blocks = layers_to_blocks(kv, start_token, len(block_ids), self.block_size)
        if not self.quantized:
            self.write_blocks(block_ids, blocks)
            return
        blocks = blocks.to(self.device, self.dtype)  # as the paged path: the model's dtype first
        values, scales = quantize_tokens(blocks, self.layout.quant)  # type: ignore[arg-type]
        if not bool(torch.isfinite(scales).all()):  # an inf or NaN makes its scale one
            why = f"a pool of kv_cache_dtype {self.kv_cache_dtype} cannot store them"
            raise QuantError(f"K/V hold an inf or a NaN: {why}")
        self._write_quantized(block_ids, values, scales)

    def _write_quantized(
        self, block_ids: Sequence[int], values: torch.Tensor, scales: torch.Tensor
    ) -> None:
        """Quantized blocks: values [n, layers, 2, heads, bs, dim], scales [n, layers, 2,
        heads, bs]."""
        ids = self._ids(block_ids)
        copy_rows(self.kv, ids, values)
        copy_rows(self.scales, ids, scales)  # type: ignore[arg-type]

    def read_blocks(self, block_ids: Sequence[int], window_from: int | None = None) -> torch.Tensor:
        """Independent copy of whole blocks: [n, layers, 2, kv_heads, block_size, head_dim]
        (`window_from`: a hybrid pool's, where window parts start); a quantized pool's rows
        [n, bytes_per_block], the tier entries' payloads as they are."""
        return self.rows.index_select(0, self._ids(block_ids))

    @property
    def quantized(self) -> bool:
        """Whether it holds quantized K/V (`kv_cache_dtype` int8 or fp8_e4m3)."""
        return self.scales is not None

    def read_kv_blocks(
        self, block_ids: Sequence[int], window_from: int | None = None
    ) -> torch.Tensor:
        """Whole blocks as K/V of the model's dtype: [n, layers, 2, kv_heads, block_size,
        head_dim] (a quantized pool's dequantized; `window_from` as in `read_blocks`)."""
        rows = self.read_blocks(block_ids, window_from)
        if not self.quantized:
            return rows
        return dequantize(*pool_views(rows, self.layout), self.dtype)

    def copy_into(
        self, block_ids: Sequence[int], dst: torch.Tensor, block_table: Sequence[int]
    ) -> None:
        """Blocks block_ids into a caller's paged buffer, block i to dst[block_table[i]]
        (ValueError for a buffer of another layout or dtype, or a short table)."""
        n, shape = len(block_ids), self.layout.block_shape
        if len(block_table) < n:
            raise ValueError(f"block_table has {len(block_table)} entries, the hit needs {n}")
        if dst.shape[1:] != shape or dst.dtype != self.dtype:
            raise ValueError(f"dst must be [N, {', '.join(map(str, shape))}] {self.dtype}")
        table = torch.as_tensor(list(block_table[:n]), dtype=torch.long, device=dst.device)
        dst.index_copy_(0, table, self.read_kv_blocks(block_ids).to(dst.device))

    def write_blocks(
        self, block_ids: Sequence[int], blocks: torch.Tensor | Sequence[torch.Tensor]
    ) -> None:
        """Inverse of read_blocks; `blocks` may also be a list of [layers, 2, heads, bs, dim]."""
        if not isinstance(blocks, torch.Tensor):
            for block_id, block in zip(block_ids, blocks, strict=True):
                self.rows[block_id].copy_(block)
            return
        blocks = blocks.to(self.device, self.rows.dtype)
        self.rows.index_copy_(0, self._ids(block_ids), blocks)

    def free_block_ids(self) -> list[int]:
        return list(self._free)
