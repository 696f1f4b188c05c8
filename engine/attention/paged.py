"""Paged attention through transformers' attention interface: K/V live in `BlockPool` blocks.

One forward runs a ragged batch flattened into one sequence, input_ids [1, T]: each row (a
request) contributes its next chunk of tokens, with its own position ids. The model code is
HF's; only its attention function is ours, registered under a per-runner name. For each
layer it (1) writes the new tokens' K/V in place into the rows' own blocks, one index_put
for the whole batch, then (2) attends each row's queries to that row's K/V read through its
block table: decode rows (one query each) as one padded batch, prefill chunks one by one.

A token whose block is shared (a cached block entered by reference) is never written: its
slot points at the runner's scratch block (the whole-prompt hit re-runs the last prompt
token only for its logits; its K/V is already cached).

Sliding-window layers (the `sliding_window` argument HF passes per layer) attend keys in
(q - window, q], as HF's own masks do; they read only the blocks that hold such keys. Logit
softcapping (`softcap`, Gemma 2) runs the scores through tanh before the mask, as HF's eager
attention does. Both come from the model through the attention interface: no model code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from engine.attention.eager import Extras, attend_eager
from engine.attention.step_batch import Reads, StepBatch
from kvstore.device.quant_kv import QuantizedLayer


class PagedAttentionError(RuntimeError):
    """The model called attention in a way the paged path cannot serve (the runner falls back)."""


def _read(
    kv_layer: torch.Tensor | QuantizedLayer, tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V through block tables: tables [n] -> [heads, n * bs, dim]; tables [B, n] ->
    [B, heads, n * bs, dim]. One gather from a [2, heads, blocks, bs, dim] view of the layer
    writes the blocks already position-major, so K and V are views of it (the layer itself
    is a strided slice of the pool: gathering whole blocks from it and transposing after
    took ~20x longer on CPU)."""
    lead, n = tables.shape[:-1], tables.shape[-1]
    if isinstance(kv_layer, QuantizedLayer):  # dequantized, float32: callers round once
        out = kv_layer.read(tables.reshape(-1))
    else:
        out = kv_layer.permute(1, 2, 0, 3, 4).index_select(2, tables.reshape(-1))
    _, heads, _, bs, dim = out.shape  # [2, heads, B * n, bs, dim]
    out = out.view(2, heads, *lead, n * bs, dim)
    if lead:
        out = out.movedim(2, 1)  # [2, B, heads, n * bs, dim]
    return out[0], out[1]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """SDPA with grouped K/V heads; q [B, Hq, n, D], k/v [B, Hkv, S, D] -> [B, Hq, n, D].
    No mask: causal from position 0 (n == S)."""
    gqa = bool(q.shape[1] != k.shape[1])  # (a traced shape compares to a tensor)
    return sdpa(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)


def _sdpa_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask as is; an additive one in the query's dtype (SDPA's CPU kernels ask it)."""
    return mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)


def _flash_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its log-sum-exp per query: q [B, H, n, D], k/v [B, H, S, D] (same H),
    bias [B, 1, 1, S] additive or None -> ([B, H, n, D], [B, H, n] float32)."""
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        out, lse = _CPU_FLASH(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        return out, lse.float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, H, n, S]
    if bias is not None:
        scores = scores + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


# Flash attention on CPU that also returns the log-sum-exp (what merging partial attention
# over the shared blocks and each row's own blocks needs); None on builds without it.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype` (no op recorded when it is already: a captured step keeps fewer)."""
    return x if x.dtype == dtype else x.to(dtype)


def _decode_attention(
    q: torch.Tensor, layer: torch.Tensor, batch: StepBatch, scale: float | None
) -> torch.Tensor:
    """One query per row, q [B, Hq, D] -> [B, Hq, D]. Each row's own blocks are read through
    its table; the blocks every row shares are read once and attended by all rows' queries
    as one batch; the two partial results merge by their log-sum-exp. Query head h uses K/V
    head h // (Hq / Hkv), as HF's repeat_kv; the grouping is a view, so K/V are never
    repeated."""
    rows, q_heads, dim = q.shape
    kv_heads = layer.shape[2]
    scale = dim**-0.5 if scale is None else scale
    qg = q.view(rows, kv_heads, q_heads // kv_heads, dim)  # [B, Hkv, G, D]
    k2, v2 = (_as(x, q.dtype) for x in _read(layer, batch.decode_tables))  # [B, Hkv, S2, D]
    bias = _as(batch.decode_bias, q.dtype)  # what SDPA's CPU flash kernel requires
    if batch.decode_shared is None:  # the G query heads of a K/V head as G query rows
        out = sdpa(qg, k2, v2, attn_mask=bias, scale=scale)
        return out.reshape(rows, q_heads, dim)
    out2, lse2 = _flash_with_lse(qg, k2, v2, bias, scale)
    k1, v1 = (x.to(q.dtype).unsqueeze(0) for x in _read(layer, batch.decode_shared))
    q1 = qg.transpose(0, 1).reshape(1, kv_heads, -1, dim)  # [1, Hkv, B * G, D]
    out1, lse1 = _flash_with_lse(q1, k1, v1, None, scale)
    out1 = out1.view(kv_heads, rows, -1, dim).transpose(0, 1)  # [B, Hkv, G, D]
    lse1 = lse1.view(kv_heads, rows, -1).transpose(0, 1)  # [B, Hkv, G]
    top = torch.maximum(lse1, lse2)
    w1 = torch.exp(lse1 - top).unsqueeze(-1)
    w2 = torch.exp(lse2 - top).unsqueeze(-1)
    out = (out1.float() * w1 + out2.float() * w2) / (w1 + w2)
    return out.reshape(rows, q_heads, dim).to(q.dtype)


def _mirror_attention(query: torch.Tensor, kv: torch.Tensor, scale: float | None) -> torch.Tensor:
    """One query over every key before it: query [1, Hq, 1, D], kv [2, Hkv, S, D] (a view of
    the mirror) -> [1, 1, Hq, D]. The G query heads of a K/V head are G query rows."""
    _, q_heads, _, dim = query.shape
    kv_heads = kv.shape[1]
    qg = query[0, :, 0].reshape(1, kv_heads, q_heads // kv_heads, dim)  # [1, Hkv, G, D]
    k, v = (x.unsqueeze(0).to(query.dtype) for x in (kv[0], kv[1]))  # [1, Hkv, S, D]
    return sdpa(qg, k, v, scale=scale).reshape(1, 1, q_heads, dim)


class PagedAttention:
    """The attention function of one runner; `batch` is set for the duration of a forward."""

    UNSUPPORTED_KWARGS = ("position_bias",)

    def __init__(
        self,
        layers: Sequence[tuple[torch.Tensor, bool]],
        layer_of: Callable[[torch.nn.Module], int],
    ):
        # per layer: [num_blocks (or window slots), 2, kv_heads, block_size, head_dim], and
        # whether it is in a hybrid pool's window plane (`BlockPool.layer_views`)
        self.layers = layers
        self.layer_of = layer_of
        self.batch: StepBatch | None = None
        self.calls = 0  # attention calls served: the self-test checks every layer came here

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,  # [1, Hq, T, D]
        key: torch.Tensor,  # [1, Hkv, T, D]
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: object,
    ) -> tuple[torch.Tensor, None]:
        layer_idx = self.layer_of(module)
        layer, plane = self.layers[layer_idx]  # [num_blocks or slots, 2, Hkv, bs, D]
        batch, window, extras = self._check(query, kwargs, plane)
        if batch.layer_wait is not None:
            batch.layer_wait(layer_idx)
        new = torch.stack((key[0], value[0]), dim=0).permute(2, 0, 1, 3)  # [T, 2, Hkv, D]
        writes = batch.plane_writes() if plane else batch.write_blocks
        if isinstance(layer, QuantizedLayer):  # quantized here; every read dequantizes
            layer.write(writes, batch.write_offsets, new)
        else:
            layer[writes, :, :, batch.write_offsets] = new.to(layer.dtype)
        if batch.mirror is not None:  # one decode row: its K/V is also kept contiguous
            seen = batch.mirror.write(layer_idx, batch.decode_rows[0].start, new[0])
            if window is None and extras.plain:
                return _mirror_attention(query, seen, scaling), None
        if batch.all_decode:  # a captured decode step: query i is row i, no gather, no scatter
            q = query[0].transpose(0, 1)  # [B, Hq, D]
            return self._decode(q, layer, plane, batch, window, scaling, extras).unsqueeze(0), None
        out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
        if batch.decode_index is not None:
            q = query[0, :, batch.decode_index].transpose(0, 1)  # [B, Hq, D]
            o = self._decode(q, layer, plane, batch, window, scaling, extras)
            out[0, batch.decode_index] = o
        for i, row in enumerate(batch.prefills):
            q = query[:, :, row.offset : row.offset + row.num_new]
            if window is None and extras.plain:
                reads = Reads(row.table, row.context, row.mask)
            else:
                reads = batch.prefill_reads(i, window)
            if plane:
                reads = batch.plane_reads(reads, ("prefill", i, window))
            o = self._attend_reads(q, layer, reads, scaling, extras)
            out[:, row.offset : row.offset + row.num_new] = o.transpose(1, 2)
        return out, None

    def _decode(
        self,
        q: torch.Tensor,  # [B, Hq, D]: the decode rows' queries
        layer: torch.Tensor,
        plane: bool,
        batch: StepBatch,
        window: int | None,
        scale: float | None,
        extras: Extras,
    ) -> torch.Tensor:
        """The decode rows' attention: [B, Hq, D]."""
        if window is None and extras.plain:
            return _decode_attention(q, layer, batch, scale)
        reads = batch.decode_reads(window)
        if plane:
            reads = batch.plane_reads(reads, ("decode", window))
        return self._attend_reads(q.unsqueeze(2), layer, reads, scale, extras).squeeze(2)

    @staticmethod
    def _attend_reads(
        q: torch.Tensor,  # [B, Hq, n, D]: one prefill row (B = 1), or decode rows (n = 1)
        layer: torch.Tensor,
        reads: Reads,
        scale: float | None,
        extras: Extras,
    ) -> torch.Tensor:
        k, v = _read(layer, reads.tables)
        k, v = k[..., : reads.context, :].to(q.dtype), v[..., : reads.context, :].to(q.dtype)
        if reads.tables.dim() == 1:
            k, v = k.unsqueeze(0), v.unsqueeze(0)
        if not extras.plain:
            return attend_eager(q, k, v, reads.mask, scale, extras)
        return _attend(q, k, v, _sdpa_mask(reads.mask, q.dtype), scale)

    def _check(
        self, query: torch.Tensor, kwargs: dict, plane: bool
    ) -> tuple[StepBatch, int | None, Extras]:
        """The step's batch, the layer's window (None: full) and what else it asks; `plane`:
        the layer's K/V is in a hybrid pool's window plane."""
        batch = self.batch
        if batch is None:
            raise PagedAttentionError("paged attention called outside a runner step")
        if query.shape[0] != 1 or query.shape[2] != batch.num_tokens:
            raise PagedAttentionError(f"query {tuple(query.shape)} is not the flattened batch")
        for name in self.UNSUPPORTED_KWARGS:
            if kwargs.get(name) is not None:
                raise PagedAttentionError(f"attention argument {name!r} is not supported")
        window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
        if window in (0, -1):
            window = None  # how some models spell "no window"
        if window is not None and (not isinstance(window, int) or window < 1):
            raise PagedAttentionError(f"sliding_window {window!r} is not a positive int")
        if plane and (window is None or batch.slot_map is None):
            raise PagedAttentionError(
                "a layer whose K/V is in the window plane attends every key, or the step "
                "has no slot map (the cache's window layers are not the model's)"
            )
        held = batch.max_plane_window if plane else batch.max_window
        if held is not None and (window is None or window > held):
            raise PagedAttentionError(
                f"a layer attends {window or 'every'} keys back, past blocks a request "
                f"dropped after they left the model's sliding window ({held})"
            )
        sinks = kwargs.get("s_aux", kwargs.get("sinks"))
        self.calls += 1
        return batch, window, Extras(float(softcap) if softcap else None, sinks)
