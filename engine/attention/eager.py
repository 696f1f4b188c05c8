"""Attention in the order of HF's eager attention, for what SDPA cannot do: logit
softcapping (Gemma 2) and attention sinks (gpt-oss). `PagedAttention` uses it for the layers
that ask for either."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Extras:
    """What a layer asks beyond plain softmax attention: HF eager does these in order."""

    softcap: float | None = None  # scores -> tanh(scores / softcap) * softcap (Gemma 2)
    sinks: torch.Tensor | None = None  # [Hq]: a per-head logit with no value (gpt-oss)

    @property
    def plain(self) -> bool:
        return self.softcap is None and self.sinks is None


def attend_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    extras: Extras,
) -> torch.Tensor:
    """Attention in HF eager's order (scale, softcap, mask, sinks, softmax in float32):
    q [B, Hq, n, D], k/v [B, Hkv, S, D] -> [B, Hq, n, D]; mask bool (True: attend),
    additive, or None (causal)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, Hq, n, S]
    if extras.softcap is not None:
        scores = torch.tanh(scores / extras.softcap) * extras.softcap
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.to(scores.dtype)
    if extras.sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:  # one extra logit per head that takes a share of the softmax and no value
        sink = extras.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        weights = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)
        weights = weights[..., :-1]
    return torch.matmul(weights.to(q.dtype), v)
