"""Paged attention against dense attention over the same K/V, per row: decode rows that share
leading blocks (read once, merged by log-sum-exp), decode rows that share nothing, and
prefill chunks beside them; a perturbed shared block must change the result."""

from __future__ import annotations

import pytest
import torch

from engine.attention import paged
from engine.attention.paged import PagedAttention
from engine.attention.step_batch import build_step
from engine.attention.step_row import Row

LAYERS, KV_HEADS, Q_HEADS, BS, DIM = 2, 2, 8, 4, 16
SHARED = [3, 7, 1]  # block ids every decode row holds first (a cached system prompt)


class _Layer(torch.nn.Module):
    layer_idx = 1


def _pool(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # [num_blocks, layers, 2, kv_heads, block_size, head_dim]
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(40, LAYERS, 2, KV_HEADS, BS, DIM, generator=generator).to(dtype)


def _views(kv: torch.Tensor) -> list[tuple[torch.Tensor, bool]]:
    """Per layer, its view of a one-plane pool (`BlockPool.layer_views`)."""
    return [(kv[:, i], False) for i in range(kv.shape[1])]


def _rows() -> list[Row]:
    """Three decode rows on the shared blocks (ends in different blocks), one prefill chunk."""
    return [
        Row([*SHARED, 10, 11], 17, 1, num_shared_blocks=3),
        Row([*SHARED, 12], 13, 1, num_shared_blocks=3),
        Row([*SHARED, 13, 14, 15], 22, 1, num_shared_blocks=3),
        Row([20, 21, 22], 5, 4),
    ]


def _dense(kv: torch.Tensor, row: Row, q: torch.Tensor) -> torch.Tensor:
    """Plain attention of a row's queries q [Hq, n, D] over its positions [0, end)."""
    blocks = kv[list(row.block_table), _Layer.layer_idx].float()  # [n, 2, Hkv, bs, D]
    k, v = (blocks[:, i].permute(1, 0, 2, 3).reshape(KV_HEADS, -1, DIM) for i in (0, 1))
    k, v = (x[:, : row.end].repeat_interleave(Q_HEADS // KV_HEADS, 0) for x in (k, v))
    scores = q @ k.transpose(-1, -2) / DIM**0.5  # [Hq, n, end]
    queries = torch.arange(row.start, row.end).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(row.end).unsqueeze(0) > queries, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _paged(kv: torch.Tensor, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
    """(paged output [T, Hq, D], queries [Hq, T, D]) of one step over `rows`."""
    total = sum(row.num_new for row in rows)
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(1, Q_HEADS, total, DIM, generator=generator).to(kv.dtype)
    key, value = torch.randn(2, 1, KV_HEADS, total, DIM, generator=generator).to(kv.dtype)
    attention = PagedAttention(_views(kv), lambda module: module.layer_idx)
    attention.batch = build_step(rows, BS, scratch_block=0, device=torch.device("cpu"))
    out, _ = attention(_Layer(), query, key, value, None)
    return out[0], query[0]


def _worst_error(kv: torch.Tensor, rows: list[Row]) -> float:
    out, query = _paged(kv, rows)
    worst, offset = 0.0, 0
    for row in rows:
        want = _dense(kv, row, query[:, offset : offset + row.num_new].float())
        got = out[offset : offset + row.num_new].transpose(0, 1).float()
        worst = max(worst, float((got - want).abs().max()))
        offset += row.num_new
    return worst


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_decode_rows_sharing_blocks_match_dense_attention(dtype, tol) -> None:
    assert paged._CPU_FLASH is not None  # this torch has the kernel: the test exercises it
    batch = build_step(_rows(), BS, 0, torch.device("cpu"))
    assert batch.decode_shared.tolist() == SHARED  # the shared path runs
    assert _worst_error(_pool(seed=1, dtype=dtype), _rows()) < tol


def test_the_shared_path_without_the_cpu_kernel_matches_too(monkeypatch) -> None:
    monkeypatch.setattr(paged, "_CPU_FLASH", None)  # what other devices and builds use
    assert _worst_error(_pool(seed=2), _rows()) < 1e-5


def test_decode_rows_sharing_nothing_match_dense_attention() -> None:
    rows = [Row([2, 4], 6, 1), Row([5, 6, 8], 9, 1), Row([9], 2, 1)]
    assert build_step(rows, BS, 0, torch.device("cpu")).decode_shared is None
    assert _worst_error(_pool(seed=3), rows) < 1e-5


@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_a_perturbed_shared_block_changes_every_decode_row(monkeypatch, cpu_kernel) -> None:
    if not cpu_kernel:
        monkeypatch.setattr(paged, "_CPU_FLASH", None)
    kv = _pool(seed=4)
    before, _ = _paged(kv.clone(), _rows())
    kv[SHARED[1], _Layer.layer_idx, 0] += 0.5  # K of the middle shared block
    after, _ = _paged(kv, _rows())
    changed = (after - before).abs().amax(dim=(1, 2)) > 1e-3  # per query token
    assert changed.tolist() == [True, True, True, False, False, False, False]


def test_a_layer_reaching_past_a_rows_dropped_blocks_is_refused() -> None:
    # a window model's request let blocks 0, 1 go (positions 0..7): from query 13 on, a
    # window of 6 keys (8..13) is all it can still serve
    rows = [Row([0, 0, 30, 31], 13, 1, num_dropped=2), Row([32, 33, 34], 10, 1)]
    batch = build_step(rows, BS, 0, torch.device("cpu"))
    assert batch.max_window == 6
    query = torch.zeros(1, Q_HEADS, 2, DIM)
    key = value = torch.zeros(1, KV_HEADS, 2, DIM)
    attention = PagedAttention(_views(_pool(seed=6)), lambda module: module.layer_idx)
    attention.batch = batch
    attention(_Layer(), query, key, value, None, sliding_window=6)  # served
    for window in (7, None):
        with pytest.raises(paged.PagedAttentionError, match="past blocks a request dropped"):
            attention(_Layer(), query, key, value, None, sliding_window=window)
