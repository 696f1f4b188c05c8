"""Quantized payloads: int8 and fp8 (e4m3) KV with one scale per token, layer, K/V and head.

A quantized entry's payload (docs/FORMAT.md, "Quantized payloads") is its scales, then its
values, each section starting 16-byte aligned:

- scales: bfloat16 [layers, 2, kv_heads, num_tokens], `amax / QMAX` over the token's
  head_dim values of that layer, K or V and head, rounded to bfloat16 (nearest, ties to
  even), at least 2**-126 (1.0 for all zeros);
- values: [layers, 2, kv_heads, num_tokens, head_dim] of int8 or float8_e4m3fn, each
  `round(x / scale)` (int8, clamped to ±127) or `x / scale` cast to e4m3 (clamped to ±448).

Dequantized, a value is `q * scale` in float32, then cast to the reader's dtype. Scales are
symmetric (no zero point): K and V of real models are centred near zero. A scale per token
(not per block) keeps a token's values independent of its neighbours': an attention sink's
large K/V does not coarsen the rest of its block, and a token quantizes the same whether its
block is written at once or a token at a time.

Everything here is numpy, in the same IEEE float32 steps as torch: a tier writer's thread
must not start a torch parallel region (its OpenMP team would slow the engine's own,
engine/loop/threads.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from kvstore.layout import QUANT_DTYPES, SCALE_BYTES, payload_size, scale_bytes, scale_shape

__all__ = ["QMAX", "QUANT_DTYPES", "payload_size", "scale_bytes", "scale_shape"]
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_MIN_SCALE_BITS = np.uint16(0x0080)  # 2**-126, bfloat16's smallest normal
# the largest scale bits (bfloat16, rounded down) whose `QMAX x scale` is a finite float32
_LARGEST = {
    dtype: np.uint16(np.float32(np.finfo(np.float32).max / qmax).view(np.uint32) >> 16)
    for dtype, qmax in QMAX.items()
}
# torch runs an elementwise op of at most this many values in the calling thread: a tier
# reader's thread must not start a parallel region (engine/loop/threads.py)
_SERIAL_VALUES = 32768
# the numpy dtype a payload's values are viewed as (e4m3 as its bits)
_VALUE_KINDS = {torch.int8: np.int8, torch.float8_e4m3fn: np.uint8}


class QuantError(ValueError):
    """KV that a quantized codec cannot store."""


def quantize(kv: torch.Tensor, stored: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(scales as bfloat16 bits, uint16 [layers, 2, heads, tokens]; values as `stored` bits,
    int8 or uint8, kv's shape) of CPU KV [layers, 2, heads, tokens, dim]."""
    x = _float32_copy(kv)
    amax = np.abs(x).max(axis=-1)
    if not np.isfinite(amax).all():
        raise QuantError("KV holds non-finite values: a quantized codec cannot store them")
    qmax = np.float32(QMAX[stored])
    scale = np.where(amax > 0, amax / qmax, np.float32(1.0)).astype(np.float32)
    bits = np.maximum(bf16_bits(scale), _MIN_SCALE_BITS)
    x /= bf16_values(bits)[..., None]  # the stored scale, so that q * scale reads back
    np.clip(x, -qmax, qmax, out=x)
    if stored == torch.int8:
        return bits, np.rint(x, out=x).astype(np.int8)
    return bits, e4m3_bits(x)


def _float32_copy(kv: torch.Tensor) -> np.ndarray:
    """A float32 numpy copy of CPU KV (float32, float16 or bfloat16: exact)."""
    kv = kv.detach().to("cpu")
    if kv.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits are a float32's top half
        return bf16_values(kv.contiguous().view(torch.int16).numpy().view(np.uint16))
    return np.array(kv.numpy(), dtype=np.float32, order="C", copy=True)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """Finite float32 values rounded to bfloat16 (nearest, ties to even), as uint16 bits."""
    b = x.view(np.uint32)
    return ((b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) as float32 values (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def e4m3_bits(x: np.ndarray) -> np.ndarray:
    """float32 values within ±448 as float8 e4m3fn bits (uint8), rounded to nearest even."""
    bits = x.view(np.uint32)
    sign = ((bits >> 31) << 7).astype(np.uint8)
    mag = bits & np.uint32(0x7FFFFFFF)
    # normal: keep 3 of 23 mantissa bits, ties to even; a carry moves the exponent up
    rounded = (mag + np.uint32(0x7FFFF) + ((mag >> 20) & np.uint32(1))) >> 20
    normal = (rounded.astype(np.int64) - (120 << 3)).clip(0, 0x7E)  # exponent bias 127 -> 7
    subnormal = np.rint(np.abs(x) * np.float32(512.0)).astype(np.int64)  # steps of 2**-9
    small = mag < np.uint32(0x3C800000)  # below 2**-6, e4m3's smallest normal
    return np.where(small, subnormal, normal).astype(np.uint8) | sign


def scales_ok(bits: np.ndarray, stored: torch.dtype) -> bool:
    """Whether every scale (bfloat16 bits) is one a writer makes: at least 2**-126, and
    small enough that `QMAX x scale` is a finite float32. Positive bfloat16 values order as
    their bits do; a sign bit, an infinity or a NaN is past the largest."""
    return bool(
        bits.size == 0 or (bits.min() >= _MIN_SCALE_BITS and bits.max() <= _LARGEST[stored])
    )


def leading_scales_ok(bits: np.ndarray, stored: torch.dtype) -> int:
    """How many leading rows of `bits` [entries, scales] pass `scales_ok` (two reductions
    for all of them)."""
    if bits.shape[1] == 0:  # no scales: none is wrong (as `scales_ok`)
        return len(bits)
    ok = (bits.min(axis=1) >= _MIN_SCALE_BITS) & (bits.max(axis=1) <= _LARGEST[stored])
    return len(ok) if ok.all() else int(ok.argmin())


def dequantize(bits: np.ndarray, values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """KV of `dtype` from `quantize`'s output."""
    out = torch.empty(values.shape, dtype=dtype)
    dequantize_into(bits, values, out)
    return out


def dequantize_into(bits: np.ndarray, values: np.ndarray, out: torch.Tensor) -> None:
    """`dequantize` into `out` (a contiguous CPU tensor of values' shape, any float dtype):
    `q x scale` in float32, rounded once to out's dtype. `values` are int8, or e4m3 bits
    (uint8). One pass for int8 into float32, three for e4m3 (through float16); float16 is
    clamped to its range (a scale rounded up may carry a value just past 65504)."""
    if not out.is_contiguous() or tuple(out.shape) != values.shape or out.device.type != "cpu":
        raise ValueError(f"out must be contiguous CPU {values.shape}, got {tuple(out.shape)}")
    rows = bits.size  # one row per scale: [layers * 2 * heads * tokens, head_dim]
    factor = bf16_values(bits).reshape(rows, 1)
    _rows_into(values.reshape(rows, -1), factor, out.view(rows, -1))


def payloads_into(bits: np.ndarray, values: Sequence[np.ndarray], outs: list[torch.Tensor]) -> None:
    """Quantized payloads' KV into `outs` as `dequantize_into` does: bits [entries, scales],
    values[i] [scales, head_dim] and outs[i] [scales, head_dim] the i-th's. The scales of all
    of them are widened at once, in numpy."""
    factor = bf16_values(bits).reshape(*bits.shape, 1)
    for q, factor_i, out in zip(values, factor, outs, strict=True):
        _rows_into(q, factor_i, out)


def _rows_into(q: np.ndarray, factor: np.ndarray, out: torch.Tensor) -> None:
    """out = q x factor, q [rows, dim] int8 or e4m3 bits (uint8), factor [rows, 1] float32,
    out [rows, dim] contiguous, of any float dtype."""
    if q.dtype == np.int8:
        _int8_into(torch.from_numpy(q), torch.from_numpy(factor), out)
    else:
        _fp8_into(q, factor, out)


def _int8_into(q: torch.Tensor, factor: torch.Tensor, out: torch.Tensor) -> None:
    """out = q x factor, q [rows, dim] int8, factor [rows, 1] float32: the
    product is exact in float32 (8 by 8 significant bits) and rounded once to out's dtype.
    In torch (twice numpy's speed on int8), in pieces small enough to run serially."""
    rows, dim = q.shape
    if rows * dim > _SERIAL_VALUES:
        step = max(1, _SERIAL_VALUES // dim)
        for part in zip(*(t.split(step) for t in (q, factor, out)), strict=True):
            _int8_into(*part)
        return
    out.copy_(q)
    out.mul_(factor)
    if out.dtype == torch.float16:  # a scale rounded up may carry a value past 65504
        out.clamp_(-65504.0, 65504.0)


def _fp8_into(q: np.ndarray, factor: np.ndarray, out: torch.Tensor) -> None:
    """out = value(q) x factor, q [rows, dim] e4m3 bits (uint8), factor [rows, 1] float32:
    `e4m3_over_256`'s steps, the integer ones in numpy (on a block's 32768 values three
    numpy passes cost less than torch's dispatches), the widening and the product (the 256
    joins the factor: the float32 product is the e4m3 value x factor's, rounded once) in
    torch, in serial pieces as `_int8_into`."""
    half = q.view(np.int8).astype(np.int16)  # the sign bit fills bits 8-15
    np.left_shift(half, 7, out=half)
    np.bitwise_and(half, np.int16(~0x4000), out=half)  # the sign at bit 15 alone
    values, scaled = torch.from_numpy(half.view(np.float16)), torch.from_numpy(factor * 256)
    step = max(1, _SERIAL_VALUES // q.shape[1])
    if len(q) <= step:  # one piece (a block of most models): no split, whose cost shows
        _fp8_piece(values, scaled, out)
        return
    for part in zip(*(t.split(step) for t in (values, scaled, out)), strict=True):
        _fp8_piece(*part)


def _fp8_piece(values: torch.Tensor, scaled: torch.Tensor, out: torch.Tensor) -> None:
    """out = values (float16) x scaled, in float32, rounded once to out's dtype."""
    if out.dtype == torch.float32:
        out.copy_(values).mul_(scaled)
        return
    x = values.float().mul_(scaled)
    if out.dtype == torch.float16:  # a scale rounded up may carry a value past 65504
        x.clamp_(-65504.0, 65504.0)
    out.copy_(x)


def e4m3_over_256(values: torch.Tensor) -> torch.Tensor:
    """float32 of e4m3 `values` (float8_e4m3fn, or their bits as uint8) / 256, exactly,
    through float16: a byte with its sign at bit 15 and the rest at bits 7-13 is float16's
    bits of that, subnormals included (e4m3's exponent field lands on float16's low exponent
    bits; float16's subnormals reach below e4m3's). A CPU cast from float8 is scalar code;
    these steps are vector code, 4-10x faster. The two bytes no writer makes (0x7F, 0xFF:
    e4m3's NaN) read as ±480 / 256, not as NaN. A TorchScript trace cannot record the dtype
    views."""
    half = values.view(torch.int8).to(torch.int16)  # the sign bit fills bits 8-15
    half.bitwise_left_shift_(7).bitwise_and_(~0x4000)  # the sign at bit 15 alone
    return half.view(torch.float16).float()


def pack_payload(bits: np.ndarray, values: np.ndarray) -> bytes:
    """The payload of `quantize`'s output: scales (little-endian), padding, values."""
    pad = bytes(scale_bytes(values.shape) - SCALE_BYTES * bits.size)
    return b"".join((bits.astype("<u2", copy=False).data, pad, values.data))


def split_payload_rows(
    rows: np.ndarray, shape: tuple[int, ...], stored: torch.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """`split_payload` of payloads a row each (uint8 [entries, payload bytes], a
    little-endian host's): bits [entries, scales] and values [entries, scales, head_dim],
    views of `rows`."""
    count, at = math.prod(scale_shape(shape)), scale_bytes(shape)
    bits = rows[:, : SCALE_BYTES * count].view("<u2")
    kind = _VALUE_KINDS[stored]
    values = rows[:, at : at + math.prod(shape)].view(kind).reshape(len(rows), count, -1)
    return bits, values


def split_payloads(
    payloads: Sequence[memoryview], shape: tuple[int, ...], stored: torch.dtype
) -> tuple[np.ndarray, list[np.ndarray]]:
    """`split_payload_rows` of payloads that lie apart (a lookup's entries, each in its own
    buffer): their scale bits copied together, [entries, scales] (a few KB), and each one's
    values [scales, head_dim], viewed where it lies (megabytes: never copied)."""
    count, at, numel = math.prod(scale_shape(shape)), scale_bytes(shape), math.prod(shape)
    bits, values, kind = np.empty((len(payloads), count), "<u2"), [], _VALUE_KINDS[stored]
    for i, payload in enumerate(payloads):
        bits[i] = np.frombuffer(payload, "<u2", count=count)
        values.append(np.frombuffer(payload, kind, count=numel, offset=at).reshape(count, -1))
    return bits, values


def split_payload(
    payload: memoryview, shape: tuple[int, ...], stored: torch.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """(scale bits, values) viewed in a quantized payload of KV `shape`, without a copy;
    e4m3 values as their uint8 bits."""
    count = math.prod(scale_shape(shape))
    bits = np.frombuffer(payload, dtype="<u2", count=count).reshape(scale_shape(shape))
    kind = _VALUE_KINDS[stored]
    at = scale_bytes(shape)
    values = np.frombuffer(payload, dtype=kind, count=math.prod(shape), offset=at)
    return bits, values.reshape(shape)
