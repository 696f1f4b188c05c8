"""The three KV layouts of a namespace, the views between them, and the one dtype map.

- model layer: per layer (K, V), each [1, kv_heads, tokens, head_dim] (`LayerKV`), what
  an HF attention layer produces and a `DynamicCache` holds;
- pool block: [layers, 2, kv_heads, block_size, head_dim], one row of the device pool
  [num_blocks, layers, 2, kv_heads, block_size, head_dim];
- tier entry: [layers, 2, kv_heads, n * block_size, head_dim], the KV of one stored entry
  of n consecutive blocks (docs/FORMAT.md), K and V position-major like the model layer.

Raw bytes are little-endian and C-ordered in every layout (a CPU pool block's bytes are an
entry payload's bytes when n = 1).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from hashing import Namespace

# kv_dtype names (Namespace.kv_dtype, model --dtype) -> torch dtypes
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NP_DTYPES = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16)}
LayerKV = tuple[torch.Tensor, torch.Tensor]  # K, V: [1, kv_heads, tokens, head_dim]


# quantized KV (docs/FORMAT.md "Quantized payloads"): the value dtype of each tier codec and
# of each quantized pool (Namespace.kv_cache_dtype); a pool block is a one-block payload
QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QUANT_POOL_DTYPES = {"int8": QUANT_DTYPES["int8"], "fp8_e4m3": QUANT_DTYPES["fp8"]}
_QUANT_STORED = frozenset(QUANT_DTYPES.values())
SCALE_BYTES = 2  # a bfloat16 scale per token, layer, K/V and head
_ALIGN = 16  # the values start 16-byte aligned after the scales


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """A quantized payload's scales, [layers, 2, kv_heads, num_tokens], for KV `shape`
    [layers, 2, heads, tokens, dim]."""
    return (shape[0], shape[1], shape[2], shape[3])


def scale_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of a quantized payload's scales section, padding included."""
    return -(-SCALE_BYTES * math.prod(scale_shape(shape)) // _ALIGN) * _ALIGN


def payload_size(shape: tuple[int, ...], stored: torch.dtype) -> int:
    """Bytes of an entry payload of KV `shape` stored as `stored` (before compression): a
    quantized one's scales and values, else the values."""
    scales = scale_bytes(shape) if stored in _QUANT_STORED else 0
    return scales + math.prod(shape) * stored.itemsize


@dataclass(frozen=True)
class KVLayout:
    """The KV shapes of one namespace. `dtype` is the model's (what attention computes in
    and a load returns); `quant`, a quantized pool's value dtype (None: the pool holds
    `dtype`), whose block is a quantized entry payload of one block (docs/FORMAT.md)."""

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype
    quant: torch.dtype | None = None

    @classmethod
    def of(cls, namespace: Namespace) -> KVLayout:
        ns = namespace
        quant = QUANT_POOL_DTYPES.get(ns.kv_cache_dtype)
        shape = (ns.num_layers, ns.num_kv_heads, ns.block_size, ns.head_dim)
        return cls(*shape, DTYPES[ns.kv_dtype], quant)

    def with_layers(self, num_layers: int) -> KVLayout:
        """The layout of a block's part of `num_layers` of its layers (a hybrid pool's
        planes)."""
        return replace(self, num_layers=num_layers)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """[layers, 2, kv_heads, block_size, head_dim]"""
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    def entry_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """[layers, 2, kv_heads, num_blocks * block_size, head_dim]"""
        tokens = num_blocks * self.block_size
        return (self.num_layers, 2, self.num_kv_heads, tokens, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        if self.quant is not None:  # an entry payload of one block
            return payload_size(self.block_shape, self.quant)
        return int(np.prod(self.block_shape)) * self.dtype.itemsize

    @property
    def scale_bytes(self) -> int:
        """A quantized block's bfloat16 scales, padded to 16 bytes (its values follow)."""
        return scale_bytes(self.block_shape)

    @property
    def scale_shape(self) -> tuple[int, int, int, int]:
        """A quantized block's scales: [layers, 2, kv_heads, block_size]."""
        return scale_shape(self.block_shape)


# --- views between the layouts --------------------------------------------------------------


def split_layers(kv: torch.Tensor) -> list[LayerKV]:
    """[layers, 2, heads, tokens, dim] -> per layer (K, V) views [1, heads, tokens, dim]."""
    return [(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)) for i in range(kv.shape[0])]


def layers_to_blocks(
    kv: Sequence[LayerKV], start_token: int, num_blocks: int, block_size: int
) -> torch.Tensor:
    """Tokens [start_token, start_token + num_blocks * block_size) of per-layer K/V as pool
    blocks [num_blocks, layers, 2, heads, bs, dim] (a permuted view of one stacked copy)."""
    end = start_token + num_blocks * block_size
    stacked = torch.stack(
        [torch.stack((k[0, :, start_token:end], v[0, :, start_token:end])) for k, v in kv]
    )  # [layers, 2, heads, tokens, dim]
    if stacked.shape[3] != num_blocks * block_size:
        raise ValueError(f"kv covers {stacked.shape[3] + start_token} tokens, need {end}")
    layers, _, heads, _, dim = stacked.shape
    return stacked.view(layers, 2, heads, num_blocks, block_size, dim).permute(3, 0, 1, 2, 4, 5)


def blocks_to_entries(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """Pool blocks [E * n, layers, 2, heads, bs, dim] -> contiguous CPU entries
    [E, layers, 2, heads, n * bs, dim] (what an entry of n blocks stores)."""
    blocks = blocks.detach().to("cpu")
    if n == 1:
        return blocks.contiguous()
    e, layers, _, heads, bs, dim = blocks.shape
    grouped = blocks.view(e // n, n, layers, 2, heads, bs, dim).permute(0, 2, 3, 4, 1, 5, 6)
    return grouped.contiguous().view(e // n, layers, 2, heads, n * bs, dim)


def entry_to_blocks(kv: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """An entry [layers, 2, heads, n * bs, dim] -> n block views [layers, 2, heads, bs, dim]."""
    if n == 1:
        return (kv,)
    layers, _, heads, tokens, dim = kv.shape
    return kv.view(layers, 2, heads, n, tokens // n, dim).unbind(3)


# --- raw bytes --------------------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    view = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    arr = view.numpy()
    if sys.byteorder != "little":
        arr = arr.byteswap()
    return memoryview(arr).cast("B")


def frombuffer_le(
    buf: bytes | memoryview | np.ndarray, dtype: torch.dtype, count: int
) -> torch.Tensor:
    """`count` values of `dtype` from little-endian bytes (zero-copy on a little-endian host)."""
    t = torch.frombuffer(buf, dtype=dtype, count=count)
    if sys.byteorder != "little":
        t = torch.from_numpy(t.numpy().byteswap())
    return t


def as_block(dst: torch.Tensor | memoryview, layout: KVLayout) -> torch.Tensor:
    """A destination pool block as a tensor (a CPU pool hands out raw bytes: viewed, no copy)."""
    if isinstance(dst, torch.Tensor):
        return dst
    return torch.frombuffer(dst, dtype=torch.uint8).view(layout.dtype).view(layout.block_shape)


def token_bytes(token_ids: np.ndarray) -> bytes:
    """Token ids as the little-endian uint32 bytes entries and hashes use."""
    return token_ids.astype("<u4", copy=False).tobytes()


def _silence_readonly_warning() -> None:
    # Decoded KV is a zero-copy view of immutable bytes. torch warns once per process that
    # such a buffer is read-only; spend those warnings here, at import, in one thread.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(bytes(4), dtype=torch.uint8)
        torch.from_numpy(np.frombuffer(bytes(4), dtype=np.uint8))


_silence_readonly_warning()
