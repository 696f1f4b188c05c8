"""Batching for models whose attention is their own code on a transformers `Cache` (Falcon,
Bloom): they never call the attention interface, but every layer calls `cache.update(key,
value, layer_idx)` and attends to what it returns under the mask it is given.

`StepCache.update` writes the step's new K/V into the rows' pool blocks (the same write slots
as `PagedAttention`) and returns every row's keys, concatenated in row order: [1, H, S, D]
with S = the rows' lengths summed. On a quantized pool the new K/V are quantized when written
and every key returned is read back dequantized, the step's own included: what a hit of
these blocks reads later. The forward gets a 4D mask [1, 1, T, S] that lets each
query see its own row's keys up to its position (block-diagonal causal), so the model's own
softmax over S keys is each row's attention. The work is T x S per layer rather than each
row's own length squared: fine for the older architectures served this way.

ALiBi (Bloom) biases each key by its position; the model builds that bias with its
`build_alibi_tensor` method from a mask. During a step, `AlibiPositions` answers that method
with the bias at each key's position in its own row (thread-locally: other callers of the
same model get the model's own method).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from engine.attention.paged import PagedAttentionError
from engine.attention.step_batch import StepBatch
from engine.attention.step_row import Row
from kvstore.device.quant_kv import QuantizedLayer

PoolLayer = torch.Tensor | QuantizedLayer


@dataclass(frozen=True)
class StepKeys:
    """Where each of the step's S keys lives, its position in its row, and the mask."""

    blocks: torch.Tensor  # [S] long: the pool block of key j
    offsets: torch.Tensor  # [S] long: its offset in the block
    positions: torch.Tensor  # [S] long: its position in its own row
    mask: torch.Tensor  # [1, 1, T, S] model dtype: 0 where a query sees a key, else dtype min


def step_keys(
    rows: Sequence[Row], block_size: int, device: torch.device, dtype: torch.dtype
) -> StepKeys:
    blocks, positions, key_rows, query_rows, query_positions = [], [], [], [], []
    for i, row in enumerate(rows):
        keys = torch.arange(row.end)
        blocks.append(torch.as_tensor(list(row.block_table), dtype=torch.long)[keys // block_size])
        positions.append(keys)
        key_rows.append(torch.full((row.end,), i))
        query_rows.append(torch.full((row.num_new,), i))
        query_positions.append(torch.arange(row.start, row.end))
    key_pos, q_pos = torch.cat(positions), torch.cat(query_positions)
    seen = (torch.cat(query_rows)[:, None] == torch.cat(key_rows)[None, :]) & (
        key_pos[None, :] <= q_pos[:, None]
    )  # [T, S]
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)
    return StepKeys(
        blocks=torch.cat(blocks).to(device),
        offsets=(key_pos % block_size).to(device),
        positions=key_pos.to(device),
        mask=mask[None, None].to(device),
    )


class StepCache(DynamicCache):
    """The `Cache` a model sees during one step: its K/V live in the pool, not in here."""

    def __init__(
        self, config: object, layers: Sequence[PoolLayer], batch: StepBatch, keys: StepKeys
    ):
        super().__init__(config=config)
        self.layers = layers  # per model layer: [num_blocks, 2, kv_heads, block_size, head_dim]
        self.batch, self.keys = batch, keys
        self.calls = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kw
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value [1, H, T, D] -> every row's keys and values [1, H, S, D]."""
        if key_states.shape[0] != 1 or key_states.shape[2] != self.batch.num_tokens:
            raise PagedAttentionError(f"keys {tuple(key_states.shape)} are not the step's")
        if self.batch.layer_wait is not None:
            self.batch.layer_wait(layer_idx)
        layer = self.layers[layer_idx]
        new = torch.stack((key_states[0], value_states[0]), dim=0).permute(2, 0, 1, 3)
        blocks, offsets = self.batch.write_blocks, self.batch.write_offsets
        if isinstance(layer, QuantizedLayer):  # every key read back dequantized, new ones too
            layer.write(blocks, offsets, new)
            read = layer.read_slots(self.keys.blocks, self.keys.offsets)
        else:
            layer[blocks, :, :, offsets] = new.to(layer.dtype)
            read = layer[self.keys.blocks, :, :, self.keys.offsets]  # [S, 2, H, D]
        self.calls += 1
        k, v = (read[:, i].transpose(0, 1).unsqueeze(0) for i in (0, 1))
        return k.to(key_states.dtype), v.to(value_states.dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return len(self.keys.positions) - self.batch.num_tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return len(self.keys.positions), 0


class AlibiPositions:
    """Replaces a model's `build_alibi_tensor` method on the instance: during a step (in its
    thread) the bias at each key's own position, else the model's method."""

    def __init__(self, base_model: torch.nn.Module):
        self.own: Callable = type(base_model).build_alibi_tensor.__get__(base_model)
        self.local = threading.local()  # .positions: [S] long during a step
        base_model.build_alibi_tensor = self

    def __call__(self, mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        positions = getattr(self.local, "positions", None)
        if positions is None:
            return self.own(mask, num_heads, dtype)
        ones = torch.ones(1, int(positions.max()) + 1, dtype=torch.long, device=positions.device)
        return self.own(ones, num_heads, dtype)[..., positions]  # [H, 1, S]


def alibi_of(base_model: torch.nn.Module) -> AlibiPositions | None:
    """The model's `AlibiPositions`, installed once; None for a model without that method.
    A model that adds ALiBi some other way (Falcon with `alibi=True`) is refused."""
    if isinstance(getattr(base_model, "build_alibi_tensor", None), AlibiPositions):
        return base_model.build_alibi_tensor
    if hasattr(type(base_model), "build_alibi_tensor"):
        return AlibiPositions(base_model)
    if getattr(base_model.config, "alibi", False):
        raise PagedAttentionError("ALiBi built outside a build_alibi_tensor method")
    return None
