"""How the engine's steps are shaped (`SchedulerConfig`): the token budget of a step, the
requests running at once, and whether a step runs ahead of the host's tokens
(engine/loop/scheduler.py plans the steps, engine/loop/overlap.py runs ahead)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# Default tokens per step by device. On a CPU prefill costs the same per token in any batch
# (its matmuls are compute-bound past ~64 rows), so a larger step buys no throughput and only
# delays every token in it: under a burst, 256 lets prompts finish one after another (TTFT
# p50 of 8 simultaneous chat turns: 240 ms at 256, 400 ms at 512; docs/BENCHMARKS.md). An
# accelerator batches prefill nearly for free: 2048, as vLLM uses for online serving.
BATCHED_TOKENS_BY_DEVICE = {"cpu": 256}
BATCHED_TOKENS_ACCELERATOR = 2048


@dataclass(frozen=True)
class SchedulerConfig:
    """Step shape: tokens fed per step (all rows; None: by device) and requests running at
    once; `async_scheduling`: a step launches before the previous step's greedy tokens reach
    the host (engine/loop/overlap.py; None: on an accelerator, not on a CPU, where nothing
    runs ahead of the host)."""

    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 32
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if value is None and name == "max_num_batched_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(
                f"async_scheduling must be a bool or None, got {self.async_scheduling!r}"
            )

    def for_device(self, device: torch.device) -> SchedulerConfig:
        """This config with the token budget and async scheduling set (the device's
        defaults where None)."""
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = BATCHED_TOKENS_BY_DEVICE.get(device.type, BATCHED_TOKENS_ACCELERATOR)
        overlap = self.async_scheduling
        if overlap is None:
            overlap = device.type != "cpu"
        return replace(self, max_num_batched_tokens=budget, async_scheduling=overlap)
