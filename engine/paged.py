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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa


class PagedAttentionError(RuntimeError):
    """The model called attention in a way the paged path cannot serve (the runner falls back)."""


@dataclass(frozen=True)
class Row:
    """One request's part of a step: `num_new` query tokens ending at position `end` - 1."""

    block_table: Sequence[int]  # the row's pool blocks, in position order
    start: int  # first position fed this step (positions below it are in the blocks)
    num_new: int  # tokens fed this step
    num_shared_blocks: int = 0  # leading blocks entered by reference: never written

    @property
    def end(self) -> int:
        return self.start + self.num_new


@dataclass
class _Prefill:
    offset: int  # first query index in the flattened batch
    num_new: int
    table: torch.Tensor  # [blocks] long
    context: int  # keys attended: positions [0, context)
    mask: torch.Tensor  # [num_new, context] bool, causal with the row's offset


@dataclass
class StepBatch:
    """Everything a step's attention needs, built once and shared by every layer."""

    write_blocks: torch.Tensor  # [T] long: the block each new token's K/V goes to
    write_offsets: torch.Tensor  # [T] long: its offset inside the block
    decode_index: torch.Tensor | None  # [B] long: query index of each one-token row
    decode_tables: torch.Tensor | None  # [B, max_blocks] long (padded with the scratch block)
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool
    prefills: list[_Prefill]
    num_tokens: int


def build_step(
    rows: Sequence[Row], block_size: int, scratch_block: int, device: torch.device
) -> StepBatch:
    """The write slots and read tables of `rows`, flattened in order."""
    blocks, offsets, prefills = [], [], []
    decode_rows: list[tuple[int, Row]] = []
    offset = 0
    for row in rows:
        positions = torch.arange(row.start, row.end)
        table = torch.as_tensor(list(row.block_table), dtype=torch.long)
        if len(table) * block_size < row.end:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {row.end} tokens")
        block_index = positions // block_size
        target = table[block_index]
        target[block_index < row.num_shared_blocks] = scratch_block  # a cached block: read only
        blocks.append(target)
        offsets.append(positions % block_size)
        if row.num_new == 1:
            decode_rows.append((offset, row))
        else:
            prefills.append(_prefill(offset, row, table, device))
        offset += row.num_new
    batch = StepBatch(
        torch.cat(blocks).to(device),
        torch.cat(offsets).to(device),
        None,
        None,
        None,
        prefills,
        offset,
    )
    if decode_rows:
        _add_decode(batch, decode_rows, block_size, scratch_block, device)
    return batch


def _prefill(offset: int, row: Row, table: torch.Tensor, device: torch.device) -> _Prefill:
    keys = torch.arange(row.end)
    queries = torch.arange(row.start, row.end)
    mask = keys.unsqueeze(0) <= queries.unsqueeze(1)  # [num_new, end]
    return _Prefill(offset, row.num_new, table.to(device), row.end, mask.to(device))


def _add_decode(
    batch: StepBatch,
    decode_rows: list[tuple[int, Row]],
    block_size: int,
    scratch_block: int,
    device: torch.device,
) -> None:
    width = max((row.end + block_size - 1) // block_size for _, row in decode_rows)
    tables = torch.full((len(decode_rows), width), scratch_block, dtype=torch.long)
    for i, (_, row) in enumerate(decode_rows):
        used = (row.end + block_size - 1) // block_size
        tables[i, :used] = torch.as_tensor(list(row.block_table[:used]), dtype=torch.long)
    lengths = torch.tensor([row.end for _, row in decode_rows])
    mask = torch.arange(width * block_size).unsqueeze(0) < lengths.unsqueeze(1)
    batch.decode_index = torch.tensor([offset for offset, _ in decode_rows], device=device)
    batch.decode_tables = tables.to(device)
    batch.decode_mask = mask[:, None, None, :].to(device)


def _read(kv_layer: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V through block tables: tables [n] -> [heads, n * bs, dim]; tables [B, n] ->
    [B, heads, n * bs, dim] (a view of the one gathered copy)."""
    out = []
    for i in (0, 1):
        x = kv_layer[:, i].transpose(0, 1)[:, tables]  # [heads, (B,) n, bs, dim], one copy
        heads, *lead, n, bs, dim = x.shape
        x = x.reshape(heads, *lead, n * bs, dim)
        out.append(x.transpose(0, 1) if lead else x)
    return out[0], out[1]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """SDPA with grouped K/V heads; q [B, Hq, n, D], k/v [B, Hkv, S, D] -> [B, Hq, n, D]."""
    return sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


class PagedAttention:
    """The attention function of one runner; `batch` is set for the duration of a forward."""

    UNSUPPORTED_KWARGS = ("position_bias", "softcap", "s_aux", "sinks")

    def __init__(self, kv: torch.Tensor, layer_of: Callable[[torch.nn.Module], int]):
        self.kv = kv  # [num_blocks, layers, 2, kv_heads, block_size, head_dim]
        self.layer_of = layer_of
        self.batch: StepBatch | None = None

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
        batch = self._check(query, kwargs)
        layer = self.kv[:, self.layer_of(module)]  # [num_blocks, 2, Hkv, bs, D]
        new = torch.stack((key[0], value[0]), dim=0).permute(2, 0, 1, 3)  # [T, 2, Hkv, D]
        layer[batch.write_blocks, :, :, batch.write_offsets] = new.to(layer.dtype)
        out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
        if batch.decode_index is not None:
            q = query[0, :, batch.decode_index].transpose(0, 1).unsqueeze(2)  # [B, Hq, 1, D]
            k, v = _read(layer, batch.decode_tables)
            o = _attend(q, k.to(q.dtype), v.to(q.dtype), batch.decode_mask, scaling)
            out[0, batch.decode_index] = o[:, :, 0]
        for row in batch.prefills:
            q = query[:, :, row.offset : row.offset + row.num_new]
            k, v = _read(layer, row.table)
            k, v = k[:, : row.context].unsqueeze(0), v[:, : row.context].unsqueeze(0)
            o = _attend(q, k.to(q.dtype), v.to(q.dtype), row.mask, scaling)
            out[:, row.offset : row.offset + row.num_new] = o.transpose(1, 2)
        return out, None

    def _check(self, query: torch.Tensor, kwargs: dict) -> StepBatch:
        batch = self.batch
        if batch is None:
            raise PagedAttentionError("paged attention called outside a runner step")
        if query.shape[0] != 1 or query.shape[2] != batch.num_tokens:
            raise PagedAttentionError(f"query {tuple(query.shape)} is not the flattened batch")
        for name in self.UNSUPPORTED_KWARGS:
            if kwargs.get(name) is not None:
                raise PagedAttentionError(f"attention argument {name!r} is not supported")
        if kwargs.get("sliding_window") not in (None, 0, -1):
            raise PagedAttentionError("sliding-window attention is not supported")
        return batch
