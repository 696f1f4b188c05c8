"""BlockPool: one preallocated paged KV tensor on the device, a free list and ref counts."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from hashing import Namespace
from kvstore.config import CacheConfig, ConfigError
from kvstore.layout import KVLayout, LayerKV, layers_to_blocks, split_layers, tensor_bytes


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


def pool_blocks(config: CacheConfig, namespace: Namespace) -> int:
    """Pool size in blocks: `device_blocks`, else `device_cache_gb` (default 1 GiB) in bytes."""
    if config.device_blocks is not None:
        return config.device_blocks
    gb = 1.0 if config.device_cache_gb is None else config.device_cache_gb
    return max(1, int(gb * 2**30) // bytes_per_block(namespace))


class BlockPool:
    """Paged KV storage. A block's ref_cnt counts its owners (the index, queued writes, ...);
    a block is on the free list iff its ref_cnt is 0."""

    def __init__(self, num_blocks: int, namespace: Namespace, device: torch.device):
        self.layout = KVLayout.of(namespace)
        self.num_blocks = num_blocks
        self.block_size = self.layout.block_size
        self.device = device
        self.dtype = self.layout.dtype
        # [num_blocks, layers, 2, kv_heads, block_size, head_dim]; torch.empty commits no pages
        shape = (num_blocks, *self.layout.block_shape)
        self.kv = torch.empty(shape, dtype=self.dtype, device=device)
        self.bytes_per_block = self.kv[0].numel() * self.kv.element_size()
        # flat and writable, in the entry payload's byte order (a big-endian host has none)
        little_cpu = device.type == "cpu" and sys.byteorder == "little"
        self._raw = tensor_bytes(self.kv) if little_cpu else None
        self.ref_cnt = np.zeros(num_blocks, dtype=np.int32)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack: pops 0, 1, 2...

    @classmethod
    def from_config(cls, config: CacheConfig, namespace: Namespace) -> BlockPool:
        return cls(pool_blocks(config, namespace), namespace, resolve_device(config.device))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks, each with ref_cnt 1 (owned by the caller)."""
        if n > len(self._free):
            raise PoolExhausted(f"need {n} blocks, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        self.ref_cnt[ids] = 1
        return ids

    def destinations(self, block_ids: Sequence[int]) -> list[torch.Tensor | memoryview]:
        """Where tier reads land: each block's raw bytes (a CPU pool: no tensor per block)
        or its tensor [layers, 2, kv_heads, block_size, head_dim]."""
        raw, size = self._raw, self.bytes_per_block
        if raw is None:
            return [self.kv[i] for i in block_ids]
        return [raw[i * size : (i + 1) * size] for i in block_ids]

    def incref(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            if self.ref_cnt[block_id] <= 0:
                raise ValueError(f"incref of free block {block_id}")
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 return to the free list."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] <= 0:
                raise ValueError(f"double free of block {block_id}")
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self._free.append(block_id)

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(block_ids, dtype=torch.long, device=self.device)

    def gather(self, block_ids: Sequence[int]) -> list[LayerKV]:
        """Per-layer (K, V) of the blocks in order, each [1, kv_heads, n * block_size, head_dim]."""
        n = len(block_ids)
        layers, _, heads, bs, dim = self.kv.shape[1:]
        # one copy: index the block axis of a [layers, 2, heads, blocks, bs, dim] view
        out = torch.index_select(self.kv.permute(1, 2, 3, 0, 4, 5), 3, self._ids(block_ids))
        return split_layers(out.view(layers, 2, heads, n * bs, dim))

    def scatter(
        self, block_ids: Sequence[int], kv: Sequence[LayerKV], start_token: int = 0
    ) -> None:
        """Write tokens [start_token, start_token + n * block_size) of per-layer K/V into blocks."""
        if block_ids:
            blocks = layers_to_blocks(kv, start_token, len(block_ids), self.block_size)
            self.kv.index_copy_(0, self._ids(block_ids), blocks.to(self.dtype))

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Independent copy of whole blocks: [n, layers, 2, kv_heads, block_size, head_dim]."""
        return self.kv.index_select(0, self._ids(block_ids))

    def write_blocks(
        self, block_ids: Sequence[int], blocks: torch.Tensor | Sequence[torch.Tensor]
    ) -> None:
        """Inverse of read_blocks; `blocks` may also be a list of [layers, 2, heads, bs, dim]."""
        if isinstance(blocks, torch.Tensor):
            self.kv.index_copy_(0, self._ids(block_ids), blocks.to(self.device, self.dtype))
            return
        for block_id, block in zip(block_ids, blocks, strict=True):
            self.kv[block_id].copy_(block)

    def free_block_ids(self) -> list[int]:
        return list(self._free)
