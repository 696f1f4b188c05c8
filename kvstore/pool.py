"""BlockPool: one preallocated paged KV tensor on the device, a free list and ref counts."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np
import torch

from hashing import Namespace
from kvstore.config import CacheConfig, ConfigError
from kvstore.layout import KVLayout, LayerKV, layers_to_blocks, split_layers, tensor_bytes
from kvstore.window_plane import WindowPlane


class PoolExhausted(RuntimeError):
    """Not enough free blocks; the caller should evict first."""


def resolve_device(name: str) -> torch.device:
    """The torch device of a `CacheConfig.device`; `ConfigError` for a CUDA device this
    machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "CUDA is not available (no GPU visible, or a CPU build of torch)"
            raise ConfigError("device", f"{name!r} requested but {why}; use cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
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
    per_layer = _layer_bytes(namespace)
    num_full = namespace.num_layers - num_window_layers
    block = per_layer * (num_full + config.window_share * num_window_layers)
    return max(1, int(_budget_bytes(config) // block))


def _budget_bytes(config: CacheConfig) -> float:
    """`device_cache_gb` (default 1 GiB) in bytes."""
    return (1.0 if config.device_cache_gb is None else config.device_cache_gb) * 2**30


def _layer_bytes(namespace: Namespace) -> float:
    """One layer's K/V of one block, in bytes."""
    return bytes_per_block(namespace) / namespace.num_layers


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
    per_layer = _layer_bytes(namespace)
    left = _budget_bytes(config) - min_slots * per_layer * num_window_layers
    num_full = namespace.num_layers - num_window_layers
    return min_slots, max(0, int(left // (per_layer * num_full)))


class BlockPool:
    """Paged KV storage. A block's ref_cnt counts its owners (the index, queued writes, ...);
    a block is on the free list iff its ref_cnt is 0.

    With `window_layers` (a hybrid model's sliding-window layers), `kv` holds the other
    (full) layers and `window` the window layers, in slots a block can let go of while its
    full part stays (kvstore/window_plane.py). Block reads and writes (`read_blocks`,
    `write_blocks`, `gather`, `scatter`) still speak whole blocks, every layer in order."""

    def __init__(
        self,
        num_blocks: int,
        namespace: Namespace,
        device: torch.device,
        window_layers: Sequence[int] = (),
        num_window_slots: int | None = None,
    ):
        self.layout = KVLayout.of(namespace)
        self.num_blocks = num_blocks
        self.block_size = self.layout.block_size
        self.device = device
        self.dtype = self.layout.dtype
        self.window_layers = _check_window_layers(window_layers, self.layout.num_layers)
        full = [i for i in range(self.layout.num_layers) if i not in self.window_layers]
        self.full_layers = full
        per_layer = self.layout.block_shape[1:]
        # [num_blocks, full layers, 2, kv_heads, block_size, head_dim]; torch.empty commits
        # no pages (every layer when the model has no window plane)
        shape = (num_blocks, len(self.full_layers), *per_layer)
        self.kv = torch.empty(shape, dtype=self.dtype, device=device)
        self.window: WindowPlane | None = None
        if self.window_layers:
            slots = num_blocks if num_window_slots is None else num_window_slots
            slot_shape = (len(self.window_layers), *per_layer)
            self.window = WindowPlane(num_blocks, slots, slot_shape, self.dtype, device)
        self.bytes_per_block = self.layout.bytes_per_block
        # flat and writable, in the entry payload's byte order (a big-endian host has none)
        little_cpu = device.type == "cpu" and sys.byteorder == "little"
        self._raw = tensor_bytes(self.kv) if little_cpu and self.window is None else None
        self.ref_cnt = np.zeros(num_blocks, dtype=np.int32)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack: pops 0, 1, 2...

    @classmethod
    def from_config(
        cls,
        config: CacheConfig,
        namespace: Namespace,
        window_layers: Sequence[int] = (),
        min_window_slots: int | None = None,
    ) -> BlockPool:
        """The configured pool; a hybrid pool with at least `min_window_slots` slots."""
        num_blocks, slots = pool_blocks(config, namespace), None
        if window_layers:
            want = min_window_slots or 1
            slots, num_blocks = _window_split(config, namespace, len(window_layers), want)
            if slots > num_blocks:
                field = "device_blocks" if config.device_blocks is not None else "device_cache_gb"
                raise ConfigError(
                    field,
                    f"the pool holds {num_blocks} blocks, fewer than a request's window and "
                    f"the blocks around it ({slots} blocks of {config.block_size} tokens)",
                )
        device = resolve_device(config.device)
        return cls(num_blocks, namespace, device, window_layers, slots)

    @property
    def nbytes(self) -> int:
        """The pool's KV bytes: its blocks, and a hybrid pool's window slots."""
        planes = [self.kv] if self.window is None else [self.kv, self.window.kv]
        return sum(t.numel() * t.element_size() for t in planes)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (a hybrid pool's window slots are counted apart)."""
        return len(self._free)

    def allocate(self, n: int, window: bool = True) -> list[int]:
        """Take `n` free blocks, each with ref_cnt 1 (owned by the caller). On a hybrid pool,
        with `window` each comes with a window slot the caller holds too; without, the caller
        gives blocks their slots as it needs them (`assign_window`)."""
        plane = self.window if window else None
        if n > len(self._free) or (plane is not None and n > plane.num_free):
            raise PoolExhausted(f"need {n} blocks, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        self.ref_cnt[ids] = 1
        if plane is not None:
            plane.assign(ids)
        return ids

    def assign_window(self, block_ids: Sequence[int]) -> None:
        """Give owned blocks that have none a window slot each, held by their owner."""
        if self.window is not None:
            self.window.assign(block_ids)

    def layer_views(self) -> list[tuple[torch.Tensor, bool]]:
        """Per model layer: its K/V in the pool, [num_blocks or num_slots, 2, kv_heads,
        block_size, head_dim], and whether that is the window plane (addressed by slot)."""
        views: list[tuple[torch.Tensor, bool]] = [(self.kv[:, 0], False)] * self.layout.num_layers
        for i, layer in enumerate(self.full_layers):
            views[layer] = (self.kv[:, i], False)
        for i, layer in enumerate(self.window_layers):
            views[layer] = (self.window.kv[:, i], True)  # type: ignore[union-attr]
        return views

    def whole(self, block_ids: Sequence[int | None]) -> list[int | None]:
        """The ids, None for each block without its window part (its every layer is not
        here: a tier write skips it)."""
        if self.window is None:
            return list(block_ids)
        return [b if b is not None and self.window.slot[b] >= 0 else None for b in block_ids]

    def zero(self, block_ids: Sequence[int]) -> None:
        """Zero blocks: their full part, and their window part where they hold one."""
        self.kv[self._ids(block_ids)] = 0
        if self.window is not None:
            held = self.window.held(block_ids)
            self.zero_window([b for b, h in zip(block_ids, held, strict=True) if h])

    def zero_window(self, block_ids: Sequence[int]) -> None:
        """Zero the window parts of blocks that hold one (a hybrid pool)."""
        if self.window is not None and block_ids:
            self.window.kv[self.window.slots(block_ids)] = 0

    def destinations(self, block_ids: Sequence[int]) -> list[torch.Tensor | memoryview]:
        """Where tier reads land: each block's raw bytes (a CPU pool: no tensor per block)
        or its tensor [layers, 2, kv_heads, block_size, head_dim]."""
        raw, size = self._raw, self.bytes_per_block
        if self.window is not None:  # a block's layers are in two planes: stage, then write
            # them with `write_staged`
            return [torch.empty(self.layout.block_shape, dtype=self.dtype) for _ in block_ids]
        if raw is None:
            return [self.kv[i] for i in block_ids]
        return [raw[i * size : (i + 1) * size] for i in block_ids]

    def write_staged(
        self, block_ids: Sequence[int], staged: Sequence[torch.Tensor | memoryview]
    ) -> None:
        """Write what `destinations` staged for `block_ids` (no-op where they were the
        blocks' own memory)."""
        if self.window is not None:
            self.write_blocks(block_ids, staged)  # type: ignore[arg-type]

    def incref(self, block_ids: Sequence[int], window: bool = True) -> None:
        """One more owner of each block; with `window` (a hybrid pool) it holds the block's
        window part too, which the block must still hold."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] <= 0:
                raise ValueError(f"incref of free block {block_id}")
        if window and self.window is not None:
            self.window.take(block_ids)
        for block_id in block_ids:
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Sequence[int], window: bool = True) -> None:
        """Drop one reference from each block; blocks reaching 0 return to the free list.
        `window`: the owner held the blocks' window parts (a hybrid pool) and lets go of
        them too; False for an owner that let go of them before (`drop_window`)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] <= 0:
                raise ValueError(f"double free of block {block_id}")
        if window and self.window is not None:
            self.window.drop(block_ids)
        for block_id in block_ids:
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self._free.append(block_id)
                if self.window is not None:
                    self.window.on_free(block_id)

    def drop_window(self, block_ids: Sequence[int]) -> int:
        """An owner keeps each block but lets go of its window part (a hybrid pool; no-op
        otherwise). Returns the window slots freed."""
        return 0 if self.window is None else self.window.drop(block_ids)

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(block_ids, dtype=torch.long, device=self.device)

    def gather(self, block_ids: Sequence[int], window_from: int | None = None) -> list[LayerKV]:
        """Per-layer (K, V) of the blocks in order, each [1, kv_heads, n * block_size, head_dim]
        (on a hybrid pool, `window_from` as in `read_blocks`)."""
        n = len(block_ids)
        layers, _, heads, bs, dim = self.layout.block_shape
        if self.window is not None:
            blocks = self.read_blocks(block_ids, window_from)
            out = blocks.permute(1, 2, 3, 0, 4, 5).reshape(layers, 2, heads, n * bs, dim)
            return split_layers(out)
        # one copy: index the block axis of a [layers, 2, heads, blocks, bs, dim] view
        out = torch.index_select(self.kv.permute(1, 2, 3, 0, 4, 5), 3, self._ids(block_ids))
        return split_layers(out.view(layers, 2, heads, n * bs, dim))

    def scatter(
        self, block_ids: Sequence[int], kv: Sequence[LayerKV], start_token: int = 0
    ) -> None:
        """Write tokens [start_token, start_token + n * block_size) of per-layer K/V into blocks."""
        if block_ids:
            blocks = layers_to_blocks(kv, start_token, len(block_ids), self.block_size)
            self.write_blocks(block_ids, blocks)

    def read_blocks(self, block_ids: Sequence[int], window_from: int | None = None) -> torch.Tensor:
        """Independent copy of whole blocks: [n, layers, 2, kv_heads, block_size, head_dim].
        On a hybrid pool every block must hold its window part (else `WindowPlaneError`),
        or, with `window_from`, block_ids[window_from:] (zeros in the window layers before:
        what a hit holds, whose window sees no further back)."""
        ids = self._ids(block_ids)
        if self.window is None:
            return self.kv.index_select(0, ids)
        shape = (len(block_ids), *self.layout.block_shape)
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        out[:, self.full_layers] = self.kv.index_select(0, ids)
        first = window_from or 0
        out[:first, self.window_layers] = 0
        slots = self.window.slots(block_ids[first:])
        out[first:, self.window_layers] = self.window.kv.index_select(0, slots)
        return out

    def write_blocks(
        self, block_ids: Sequence[int], blocks: torch.Tensor | Sequence[torch.Tensor]
    ) -> None:
        """Inverse of read_blocks; `blocks` may also be a list of [layers, 2, heads, bs, dim]."""
        if not isinstance(blocks, torch.Tensor) and self.window is None:
            for block_id, block in zip(block_ids, blocks, strict=True):
                self.kv[block_id].copy_(block)
            return
        if not isinstance(blocks, torch.Tensor):
            if not blocks:
                return
            blocks = torch.stack([block.to(self.device) for block in blocks])
        blocks, ids = blocks.to(self.device, self.dtype), self._ids(block_ids)
        if self.window is None:
            self.kv.index_copy_(0, ids, blocks)
            return
        self.kv.index_copy_(0, ids, blocks[:, self.full_layers])
        self.window.kv.index_copy_(0, self.window.slots(block_ids), blocks[:, self.window_layers])

    def free_block_ids(self) -> list[int]:
        return list(self._free)


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
