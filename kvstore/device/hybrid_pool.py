"""HybridPool: a hybrid model's block pool, its window layers in a window plane.

A hybrid model (full layers and sliding-window layers) needs a block's full layers for as
long as it is cached, its window layers only while some query can still see them. So a
block's full part is its row of `kv` (the full layers) and its window part a slot of the
window plane (kvstore/device/window_plane.py), which the block lets go of on its own. Block reads
and writes (`read_blocks`, `write_blocks`, `gather`, `scatter`) still speak whole blocks,
every layer in model order, so tier entries are the same as a plain pool's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from hashing import Namespace
from kvstore.config import CacheConfig, ConfigError
from kvstore.device.pool import (
    BlockPool,
    PoolExhausted,
    budget_bytes,
    plane_bytes,
    plane_storage,
    pool_blocks,
    resolve_device,
)
from kvstore.device.quant_kv import as_bytes, copy_rows, layer_view, pool_views
from kvstore.device.staging import Stage
from kvstore.device.window_plane import WindowPlane
from kvstore.layout import KVLayout, LayerKV, split_layers


def window_slots(config: CacheConfig, num_blocks: int) -> int:
    """Window-plane slots of a hybrid model's pool of `num_blocks` blocks."""
    return max(1, math.ceil(num_blocks * config.window_share))


def _window_split(
    config: CacheConfig, namespace: Namespace, num_window_layers: int, min_slots: int
) -> tuple[int, int]:
    """(window slots, blocks) of a hybrid pool: `window_share` slots per block, at least
    `min_slots`; those past the share come out of a byte budget's blocks."""
    num_blocks = pool_blocks(config, namespace, num_window_layers)
    slots = window_slots(config, num_blocks)
    if slots >= min_slots:
        return slots, num_blocks
    if config.device_blocks is not None:
        return min_slots, num_blocks
    left = budget_bytes(config) - min_slots * plane_bytes(namespace, num_window_layers)
    num_full = namespace.num_layers - num_window_layers
    return min_slots, max(0, int(left // plane_bytes(namespace, num_full)))


def make_pool(
    config: CacheConfig,
    namespace: Namespace,
    window_layers: Sequence[int] = (),
    min_window_slots: int | None = None,
) -> BlockPool:
    """The configured pool: a plain one, or with `window_layers` a hybrid one with at least
    `min_window_slots` window slots."""
    if not window_layers:
        return BlockPool.from_config(config, namespace)
    slots, num_blocks = _window_split(config, namespace, len(window_layers), min_window_slots or 1)
    if slots > num_blocks:
        field = "device_blocks" if config.device_blocks is not None else "device_cache_gb"
        raise ConfigError(
            field,
            f"the pool holds {num_blocks} blocks, fewer than a request's window and "
            f"the blocks around it ({slots} blocks of {config.block_size} tokens)",
        )
    device = resolve_device(config.device)
    return HybridPool(num_blocks, namespace, device, window_layers, slots)


class HybridPool(BlockPool):
    """`kv` holds the full layers, `window` the window layers, in slots a block lets go of
    while its full part stays. `ref_cnt` counts a block's owners; `window.ref_cnt` those
    that hold its window part too."""

    def __init__(
        self,
        num_blocks: int,
        namespace: Namespace,
        device: torch.device,
        window_layers: Sequence[int],
        num_window_slots: int | None = None,
    ):
        num_layers = namespace.num_layers
        self.window_layers = _check_window_layers(window_layers, num_layers)
        self.full_layers = [i for i in range(num_layers) if i not in self.window_layers]
        super().__init__(num_blocks, namespace, device)
        self._raw = None  # a block's layers are in two planes: tier reads are staged
        slots = num_blocks if num_window_slots is None else num_window_slots
        storage = plane_storage(slots, self.layout.with_layers(len(self.window_layers)), device)
        self.window = WindowPlane(num_blocks, slots, storage)

    def _row_layout(self) -> KVLayout:
        return self.layout.with_layers(len(self.full_layers))  # the full part

    @property
    def nbytes(self) -> int:
        """The pool's KV bytes: its blocks' full parts and the window slots (a quantized
        pool's scales included)."""
        return self.rows.numel() * self.rows.element_size() + self.window.nbytes

    def allocate(self, n: int, window: bool = True) -> list[int]:
        """With `window` each block comes with a window slot the caller holds too; without,
        the caller gives blocks their slots as it needs them (`assign_window`)."""
        if window and n > self.window.num_free:
            raise PoolExhausted(f"need {n} window slots, {self.window.num_free} free")
        ids = super().allocate(n)
        if window:
            self.window.assign(ids)
        return ids

    def assign_window(self, block_ids: Sequence[int]) -> None:
        """Give owned blocks that have none a window slot each, held by their owner."""
        self.window.assign(block_ids)

    def layer_views(self) -> list[tuple[torch.Tensor, bool]]:
        views: list = [None] * self.layout.num_layers
        planes = ((self.kv, self.scales, self.full_layers, False),
                  (self.window.kv, self.window.scales, self.window_layers, True))  # fmt: skip
        for kv, scales, layers, plane in planes:
            for i, layer in enumerate(layers):
                views[layer] = (layer_view(kv, scales, i), plane)
        return views

    def whole(self, block_ids: Sequence[int | None]) -> list[int | None]:
        """None for each block without its window part."""
        return [b if b is not None and self.window.slot[b] >= 0 else None for b in block_ids]

    def zero(self, block_ids: Sequence[int]) -> None:
        """Zero blocks: their full part, and their window part where they hold one."""
        super().zero(block_ids)
        held = self.window.held(block_ids)
        self.zero_window([b for b, h in zip(block_ids, held, strict=True) if h])

    def zero_window(self, block_ids: Sequence[int]) -> None:
        """Zero the window parts of blocks that hold one."""
        if block_ids:
            self.window.rows[self.window.slots(block_ids)] = 0

    def destinations(self, block_ids: Sequence[int]) -> list[torch.Tensor | memoryview]:
        """Staging blocks: a block's layers are in two planes (`staged_reads` writes them).
        Each is a whole block's K/V, or a quantized pool's whole payload row."""
        if self.quantized:
            return [torch.empty(self.bytes_per_block, dtype=torch.uint8) for _ in block_ids]
        return [torch.empty(self.layout.block_shape, dtype=self.dtype) for _ in block_ids]

    def staged_reads(self, max_blocks: int) -> AbstractContextManager[Stage]:
        """Whole blocks in host tensors, written into both planes per tier."""
        return nullcontext(_PlaneStage(self))

    def incref(self, block_ids: Sequence[int], window: bool = True) -> None:
        """With `window` the new owner holds the block's window part too, which the block
        must still hold."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] <= 0:
                raise ValueError(f"incref of free block {block_id}")
        if window:
            self.window.take(block_ids)
        super().incref(block_ids)

    def free(self, block_ids: Sequence[int], window: bool = True) -> None:
        """`window`: the owner held the blocks' window parts and lets go of them too; False
        for an owner that let go of them before (`drop_window`)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] <= 0:
                raise ValueError(f"double free of block {block_id}")
        if window:
            self.window.drop(block_ids)
        super().free(block_ids)

    def _on_freed(self, block_id: int) -> None:
        self.window.on_free(block_id)  # its slot goes too, whoever still counted on it

    def drop_window(self, block_ids: Sequence[int]) -> int:
        return self.window.drop(block_ids)

    def gather(self, block_ids: Sequence[int], window_from: int | None = None) -> list[LayerKV]:
        n = len(block_ids)
        layers, _, heads, bs, dim = self.layout.block_shape
        blocks = self.read_kv_blocks(block_ids, window_from)
        out = blocks.permute(1, 2, 3, 0, 4, 5).reshape(layers, 2, heads, n * bs, dim)
        return split_layers(out)

    def read_blocks(self, block_ids: Sequence[int], window_from: int | None = None) -> torch.Tensor:
        """Every block must hold its window part (else `WindowPlaneError`), or, with
        `window_from`, block_ids[window_from:] (zeros in the window layers before: what a
        hit holds, whose window sees no further back). A quantized pool's rows [n,
        bytes_per_block]: every layer's scales, then every layer's values, in model order
        (the tier entries' payloads)."""
        n, first = len(block_ids), window_from or 0
        if self.quantized:  # zeros: the padding after the scales, and no window part
            out = torch.zeros((n, self.bytes_per_block), dtype=torch.uint8, device=self.device)
            parts = [*pool_views(out, self.layout)]  # values, scales: views of out
        else:
            out = torch.empty((n, *self.layout.block_shape), dtype=self.dtype, device=self.device)
            out[:first, self.window_layers] = 0
            parts = [out]
        ids, slots = self._ids(block_ids), self.window.slots(block_ids[first:])
        for dst, own, plane in zip(parts, self._planes(), self._planes(window=True), strict=True):
            dst, own, plane = as_bytes(dst), as_bytes(own), as_bytes(plane)
            dst[:, self.full_layers] = own.index_select(0, ids)
            dst[first:, self.window_layers] = plane.index_select(0, slots)
        return out

    def write_blocks(
        self, block_ids: Sequence[int], blocks: torch.Tensor | Sequence[torch.Tensor]
    ) -> None:
        if not isinstance(blocks, torch.Tensor):
            if not blocks:
                return
            blocks = torch.stack(list(blocks))  # staged on the host: one transfer to a GPU
        blocks = blocks.to(self.device, self.rows.dtype)
        if self.quantized:
            self._write_quantized(block_ids, *pool_views(blocks, self.layout))
        else:
            self._write_planes(block_ids, [blocks])

    def _write_quantized(
        self, block_ids: Sequence[int], values: torch.Tensor, scales: torch.Tensor
    ) -> None:
        self._write_planes(block_ids, [values, scales])

    def _write_planes(self, block_ids: Sequence[int], parts: Sequence[torch.Tensor]) -> None:
        """Whole blocks' parts (K/V, or a quantized pool's values and scales), each [n,
        layers, ...] in model order, into the full rows and the window slots."""
        ids, slots = self._ids(block_ids), self.window.slots(block_ids)
        for src, own, plane in zip(parts, self._planes(), self._planes(window=True), strict=True):
            copy_rows(own, ids, src[:, self.full_layers])
            copy_rows(plane, slots, src[:, self.window_layers])

    def _planes(self, window: bool = False) -> list[torch.Tensor]:
        """The full rows' (or window slots') K/V, or a quantized pool's values and scales."""
        kv, scales = (self.window.kv, self.window.scales) if window else (self.kv, self.scales)
        return [kv] if scales is None else [kv, scales]


def _check_window_layers(window_layers: Sequence[int], num_layers: int) -> list[int]:
    """The window plane's layers, sorted: some of the model's, not all (a model whose every
    layer is windowed needs no plane: its blocks go whole)."""
    layers = sorted(set(window_layers))
    if any(not 0 <= i < num_layers for i in layers):
        raise ValueError(f"window_layers {layers} out of range for {num_layers} layers")
    if layers and len(layers) == num_layers:
        raise ValueError(
            f"window_layers lists all {num_layers} layers: a model whose every layer is "
            "windowed is a window-only model (pass the window alone)"
        )
    return layers


class _PlaneStage(Stage):
    """A hybrid pool's lookup: each block read into a tensor of its own, then written."""

    def __init__(self, pool: HybridPool):
        self.pool, self.staged = pool, []

    def destinations(self, block_ids: Sequence[int]) -> list[torch.Tensor | memoryview]:
        fresh = self.pool.destinations(block_ids)
        self.staged += fresh
        return fresh

    def upload(self, block_ids: Sequence[int], first: int) -> None:
        self.pool.write_blocks(block_ids, self.staged[first : first + len(block_ids)])
