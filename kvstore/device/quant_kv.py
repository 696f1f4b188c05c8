"""A quantized device pool's K/V (`kv_cache_dtype` int8 or fp8_e4m3), in torch on the pool's
device: quantized where K/V are written, dequantized where they are read.

A block is a quantized entry payload of one block (kvstore/entry/quant.py, docs/FORMAT.md):
bfloat16 scales [layers, 2, kv_heads, block_size], padding, then values [layers, 2,
kv_heads, block_size, head_dim] of one byte. The same steps as the entry codec's numpy: a
token's bytes here are the bytes the codec writes for it, so a pool block goes to a tier as
it is, and comes back the same.

A scale is per token (and layer, K/V, head), never per block: a token's bytes depend on its
own K/V only, so they are the same whether its block was written by one prefill or a token
at a time by decode steps, and a hit reads exactly what the miss that wrote it read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvstore.entry.quant import QMAX, e4m3_over_256
from kvstore.layout import KVLayout

MIN_SCALE = 2.0**-126  # bfloat16's smallest normal: a scale is never 0


def pool_views(rows: torch.Tensor, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [n, layers, 2, heads, bs, dim] of layout.quant, scales [n, layers, 2, heads,
    bs] bfloat16): strided views of `rows` ([n, bytes_per_block] uint8), no copy."""
    n, scales_at = rows.shape[0], layout.scale_bytes
    count = 2 * int(torch.Size(layout.scale_shape).numel())
    scales = rows[:, :count].view(torch.bfloat16).view(n, *layout.scale_shape)
    values = rows[:, scales_at:].view(layout.quant).view(n, *layout.block_shape)  # type: ignore[arg-type]
    return values, scales


def block_rows(num_rows: int, layout: KVLayout, device: torch.device) -> QuantizedRows:
    """Rows of `layout`'s blocks (of its layers): zeros (a row never written reads as zeros,
    never as a NaN scale; zeros also commit the memory now), with their views."""
    rows = torch.zeros((num_rows, layout.bytes_per_block), dtype=torch.uint8, device=device)
    return QuantizedRows(rows, *pool_views(rows, layout))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """One-byte values as uint8 (a view): CPU index kernels have no float8 ones."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def copy_rows(dst: torch.Tensor, at: torch.Tensor, src: torch.Tensor) -> None:
    """`dst[at] = src` along dim 0 (one-byte values as bytes)."""
    as_bytes(dst).index_copy_(0, at, as_bytes(src))


def quantize_tokens(x: torch.Tensor, quant: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(values `quant` [..., dim], scales bfloat16 [...]) of K/V `x` [..., dim]: a scale per
    token and head, `amax / QMAX` rounded to bfloat16 (at least 2**-126; 1 for zeros; inf or
    NaN for a token holding an inf or a NaN)."""
    qmax = QMAX[quant]
    amax = x.abs().amax(dim=-1).float()
    # a tensor divisor: CUDA divides by a Python number as `x * (1 / qmax)`, which can round
    # to another bfloat16 scale than the codec's numpy `amax / qmax`. An inf or a NaN in a
    # token's K/V makes its scale inf or NaN, a scale no writer makes (kvstore/entry/quant.py)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, qmax))
    scale = scale.to(torch.bfloat16).clamp_min(MIN_SCALE)
    q = (x.float() / scale.float().unsqueeze(-1)).clamp(-qmax, qmax)
    return (q.round() if quant == torch.int8 else q).to(quant), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values x scales` in float32, rounded once to `dtype`: [..., dim] from [..., dim] and
    [...] (the entry codec's arithmetic, kvstore/entry/quant.py)."""
    if values.dtype == torch.float8_e4m3fn and _vector_e4m3(values):
        x = e4m3_over_256(values).mul_((scales.float() * 256).unsqueeze(-1))  # the same product
    else:
        x = values.float() * scales.float().unsqueeze(-1)
    if dtype == torch.float16:  # a scale rounded up may carry a value just past 65504
        x = x.clamp(-65504.0, 65504.0)
    return x.to(dtype)


def _vector_e4m3(values: torch.Tensor) -> bool:
    """Whether `e4m3_over_256` reads `values`: on a CPU, outside a TorchScript trace (a
    trace cannot record a dtype view; a CPU decode graph keeps torch's cast)."""
    return values.device.type == "cpu" and not torch.jit.is_tracing()


def layer_view(
    kv: torch.Tensor, scales: torch.Tensor | None, i: int
) -> torch.Tensor | QuantizedLayer:
    """Layer `i` of a pool's (or window plane's) rows as paged attention reads it: [rows,
    2, kv_heads, block_size, head_dim], or with `scales` a `QuantizedLayer`."""
    return kv[:, i] if scales is None else QuantizedLayer(kv[:, i], scales[:, i])


class QuantizedRows(NamedTuple):
    """A quantized pool's (or window plane's) storage: `rows` [n, bytes_per_block] uint8,
    each a quantized entry payload of one block of its layers, and its `values` [n, layers,
    2, kv_heads, block_size, head_dim] and `scales` [n, layers, 2, kv_heads, block_size]
    (views of rows)."""

    rows: torch.Tensor
    values: torch.Tensor
    scales: torch.Tensor


class QuantizedLayer(NamedTuple):
    """One layer of a quantized pool, as paged attention sees it: values [num_blocks, 2,
    kv_heads, block_size, head_dim] and scales [num_blocks, 2, kv_heads, block_size]."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def write(self, blocks: torch.Tensor, offsets: torch.Tensor, new: torch.Tensor) -> None:
        """New tokens' K/V `new` [T, 2, kv_heads, head_dim] into (blocks[t], offsets[t])."""
        q, s = quantize_tokens(new, self.values.dtype)
        self.values[blocks, :, :, offsets] = q  # no dtype view: a traced decode step has none
        self.scales[blocks, :, :, offsets] = s

    def read_slots(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The K/V at (blocks[j], offsets[j]) as [S, 2, kv_heads, head_dim] float32,
        dequantized (the caller rounds once to its dtype)."""
        values = self.values[blocks, :, :, offsets]  # [S, 2, heads, dim]
        return dequantize(values, self.scales[blocks, :, :, offsets], torch.float32)

    def read(self, tables: torch.Tensor) -> torch.Tensor:
        """Blocks `tables` (flat) as [2, heads, n, bs, dim] float32, dequantized (the caller
        rounds once to its dtype)."""
        values = self.values.permute(1, 2, 0, 3, 4).index_select(2, tables)
        scales = self.scales.permute(1, 2, 0, 3).index_select(2, tables)
        return dequantize(values, scales, torch.float32)
