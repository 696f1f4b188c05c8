"""Decode steps replayed from captured graphs, as nano-vllm, mini-sglang, vLLM and SGLang
run them: the runner's one place for capture and replay (engine/loop/runner.py calls it).

A decode step (every row feeds one token and samples it) is padded to a batch bucket
(1, 2, 4, 8, 16, 24, ... up to the engine's `max_num_seqs`) and a width bucket (the blocks
its longest row reads, up to a power of two), and replays the graph captured for that
(bucket, width) over static buffers (engine/attention/decode_buffers.py): the model's
Python modules, HF's mask logic and the attention's metadata building run once, at capture,
never per step. Padded rows write the scratch block's slot and read that one key. Prefill
and mixed steps, steps waiting for a tier's layers, and rows gathering prompt logprobs run
eager.

Two backends, one contract (`capture(step) -> replay`):
- a GPU: CUDA graphs (`torch.cuda.CUDAGraph`), every graph in one memory pool, warmed up on
  a side stream; the capture runs on padding, so it writes only the scratch block.
- a CPU: TorchScript traces of the same step (`torch.jit.trace`, which torch 2.13 marks
  deprecated in favour of compile/export; both of those cost seconds to minutes per shape,
  a trace well under one). A replay runs the step's aten ops from C++ with no Python: on
  the micro model a decode forward goes from ~1.5 ms eager to ~0.5 ms.

Both freeze whatever the step's Python decided at capture, so a model whose forward reads
a tensor's value on the host (a dynamic RoPE, a data-dependent branch) must not be
captured: a CUDA capture fails on the sync; a trace cannot tell such a read from a shape's
(nn.Embedding compares its padding index with a size), so the known cases are refused up
front (`graph_blocker`) and every new graph is checked at its first replay, on real rows
unlike the padding it was captured on, against the eager forward of the same rows (logits
within the dtype's tolerance, and the K/V it wrote). A graph that fails to capture or to
match turns graphs off for the engine, with a warning, and the step runs eager.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.attention.decode_buffers import DecodeBuffers
from engine.attention.dispatch import AttentionDispatch
from engine.attention.paged import PagedAttention
from engine.attention.step_row import Row
from engine.contract import tolerance_for
from engine.loop.overlap import Feed
from engine.model.loading import LoadedModel
from kvstore.device.pool import BlockPool
from kvstore.units import cdiv

log = logging.getLogger("kvstore.engine")

GRAPH_MODES = ("auto", "on", "off")
Replay = Callable[[], torch.Tensor]
Step = Callable[..., torch.Tensor]
WARM_RUNS = 3  # a trace's runs at capture, before its first checked replay


class GraphError(RuntimeError):
    """A decode graph could not be captured, or its replay differs from the eager step."""


@dataclass(frozen=True)
class GraphConfig:
    """Decode graphs: `auto` (on where the model and device allow them, `graph_blocker`;
    a capture or check that fails later turns them off with a warning), `on` (the same, a
    blocker an error at start) or `off` (every step eager)."""

    mode: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in GRAPH_MODES:
            raise ValueError(f"cuda_graphs must be one of {GRAPH_MODES}, got {self.mode!r}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to `max_batch` (itself included)."""
    buckets = [b for b in (1, 2, 4) if b < max_batch]
    buckets += list(range(8, max_batch, 8))
    return [*buckets, max_batch]


def width_bucket(blocks: int, max_width: int) -> int | None:
    """The width a step reading `blocks` blocks per row replays at: the next power of two,
    at most `max_width`; None when it reads more."""
    if blocks > max_width:
        return None
    return min(1 << max(blocks - 1, 0).bit_length(), max_width)


class CudaGraphs:
    """Capture on a GPU: CUDA graphs sharing one memory pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool: tuple | None = None

    def capture(self, step: Step, inputs: tuple[torch.Tensor, ...]) -> Replay:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            step(*inputs)  # lazy initialisations and first allocations, outside the capture
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step(*inputs)
        if self.pool is None:
            self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class TracedSteps:
    """Capture on a CPU: a TorchScript trace, run from C++. The static buffers are the
    trace's inputs: as constants, the executor's optimisations would fold their contents
    of the first replays into the graph."""

    def capture(self, step: Step, inputs: tuple[torch.Tensor, ...]) -> Replay:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # see the module's docstring
            # shape reads warn too (nn.Embedding's padding check): values are caught by
            # the replay check instead
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            traced = torch.jit.trace(step, inputs, check_trace=False)
        for _ in range(WARM_RUNS):  # the executor profiles, then optimises: replays check
            traced(*inputs)  # the graph it settles on (on padding: the scratch block)
        return lambda: traced(*inputs)


def backend_for(device: torch.device) -> CudaGraphs | TracedSteps:
    return CudaGraphs(device) if device.type == "cuda" else TracedSteps()


def graph_blocker(runner: StepRunner) -> str | None:
    """Why the runner's decode steps cannot be captured, or None when they can."""
    device = runner.pool.device.type
    if device not in ("cpu", "cuda"):
        return f"no decode graphs on {device}"
    if device == "cpu" and runner.linears is not None:
        return "a CPU trace cannot hold oneDNN's packed linears (--linear-kernel dense: traced)"
    config = runner.model.model.config.get_text_config()
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "dynamic" in str(rope.get("rope_type", "")):
        return "its dynamic RoPE reads the positions on the host each step"
    return None


class StepRunner(Protocol):
    """What the graphs need of a runner (engine/loop/runner.py's `PagedRunner`)."""

    model: LoadedModel
    pool: BlockPool
    block_size: int
    scratch_block: int
    attention: PagedAttention
    dispatch: AttentionDispatch
    placeholder_mask: torch.Tensor
    linears: object | None

    def linear_step(self) -> AbstractContextManager: ...

    def forward_eager(
        self,
        rows: Sequence[Row],
        token_ids: Sequence[Sequence[int]],
        logit_rows: Sequence[int],
        *,
        feed: Feed | None = None,
    ) -> torch.Tensor: ...


class DecodeGraphs:
    """The captured decode steps of one runner."""

    def __init__(self, runner: StepRunner, sampled: torch.Tensor, max_width: int):
        """Steps of up to len(`sampled`) rows; `sampled`: the device's sampled tokens
        (engine/loop/overlap.py), where a row's pending token is gathered from."""
        self.runner = runner
        self.model = runner.model.model
        self.sampled = sampled
        pool = runner.pool
        max_batch = sampled.shape[0]
        self.buffers = DecodeBuffers(
            max_batch, max_width, runner.block_size, runner.scratch_block, pool.device
        )
        self.buckets = batch_buckets(max_batch)
        self.backend = backend_for(pool.device)
        self.graphs: dict[tuple[int, int], Replay] = {}
        # a hybrid pool's window plane: its slot map, copied in before each replay
        self.slot_map = None if pool.window is None else torch.zeros(
            pool.num_blocks, dtype=torch.long, device=pool.device
        )  # fmt: skip
        self.disabled: str | None = None  # why graphs were turned off
        self.replays = 0

    def run(
        self, rows: Sequence[Row], token_ids: Sequence[int], feed: Feed | None = None
    ) -> torch.Tensor | None:
        """The logits [len(rows), vocab] of a decode step from its graph, or None when the
        step has none (too many rows, a row too long, graphs off): it runs eager. `feed`:
        rows whose token is still on the device."""
        key = self._key(rows)
        if key is None:
            return None
        replay = self.graphs.get(key)
        fresh = replay is None
        if fresh:
            replay = self._capture(*key)
            if replay is None:
                return None
        self._fill(rows, token_ids, feed, *key)
        logits = replay()[: len(rows)]
        self.replays += 1
        if fresh:
            return self._checked(key, rows, token_ids, feed, logits)
        return logits

    def _key(self, rows: Sequence[Row]) -> tuple[int, int] | None:
        if self.disabled is not None or not rows or len(rows) > self.buckets[-1]:
            return None
        if any(row.num_new != 1 for row in rows):
            return None
        bucket = next(b for b in self.buckets if b >= len(rows))
        blocks = max(cdiv(row.end, self.buffers.block_size) for row in rows)
        width = width_bucket(blocks, self.buffers.max_width)
        return None if width is None else (bucket, width)

    def _fill(
        self,
        rows: Sequence[Row],
        token_ids: Sequence[int],
        feed: Feed | None,
        bucket: int,
        width: int,
    ) -> None:
        sources = None if feed is None else dict(zip(feed.rows, feed.slots, strict=True))
        self.buffers.fill(rows, token_ids, bucket, width, sources)
        if self.slot_map is not None:
            window = self.runner.pool.window
            self.slot_map.copy_(window.slot_map(self.runner.scratch_block), non_blocking=True)

    def _inputs(self) -> tuple[torch.Tensor, ...]:
        """The static buffers a step reads (what a trace takes as its inputs)."""
        maps = () if self.slot_map is None else (self.slot_map,)
        return (self.buffers.device_buffer, self.sampled, *maps)

    def _step(self, bucket: int, width: int) -> Step:
        """The step a (bucket, width) graph captures: the model over the static buffers,
        its attention reading them; the logits of every row, [bucket, vocab]."""
        buffers, runner = self.buffers, self.runner

        def step(
            buffer: torch.Tensor, sampled: torch.Tensor, slot_map: torch.Tensor | None = None
        ) -> torch.Tensor:
            ids = buffers.input_ids(bucket, buffer, sampled).unsqueeze(0)
            positions = buffers.header(1, buffer)[:bucket].unsqueeze(0)
            batch = buffers.step_batch(bucket, width, slot_map, buffer)
            with runner.dispatch.step(runner.attention), runner.linear_step():
                runner.attention.batch = batch
                out = self.model(
                    input_ids=ids,
                    position_ids=positions,
                    attention_mask=runner.placeholder_mask,  # HF's mask logic: none
                    use_cache=False,
                )
            return out.logits[0]

        return step

    def _capture(self, bucket: int, width: int) -> Replay | None:
        self.buffers.pad(bucket, width)  # the capture writes the scratch block only
        if self.slot_map is not None:
            window = self.runner.pool.window
            self.slot_map.copy_(window.slot_map(self.runner.scratch_block))
        try:
            replay = self.backend.capture(self._step(bucket, width), self._inputs())
        except Exception as e:  # any failure: this model is served eager
            self._disable(f"capturing a decode step failed ({type(e).__name__}: {e})")
            return None
        self.graphs[(bucket, width)] = replay
        log.debug("captured the decode graph of %d rows x %d blocks", bucket, width)
        return replay

    def _checked(
        self,
        key: tuple[int, int],
        rows: Sequence[Row],
        token_ids: Sequence[int],
        feed: Feed | None,
        logits: torch.Tensor,
    ) -> torch.Tensor:
        """A new graph's first replay against the eager forward of the same rows: its
        logits within the dtype's tolerance and the K/V it wrote. The eager logits either
        way (they are the reference); a mismatch turns graphs off."""
        written = self._written(rows).clone()
        fed = [[t] for t in token_ids]
        eager = self.runner.forward_eager(rows, fed, range(len(rows)), feed=feed)
        tol = tolerance_for(self.runner.model.dtype)
        worst = float((logits.float() - eager).abs().max())
        kv = float((written.float() - self._written(rows).float()).abs().max())
        if worst > tol or kv > tol:
            self.graphs.pop(key)
            self._disable(f"a replay differs from the eager step (logits by {worst:.2e}, "
                          f"K/V by {kv:.2e})")  # fmt: skip
        return eager

    def _written(self, rows: Sequence[Row]) -> torch.Tensor:
        """The K/V slots the rows' tokens were written to: [n, layers, 2, heads, dim]."""
        n = len(rows)
        blocks = self.buffers.header(2)[:n]
        offsets = self.buffers.header(3)[:n]
        kv = self.runner.pool.kv  # [num_blocks, layers, 2, heads, block_size, dim]
        return kv[blocks, :, :, :, offsets]

    def _disable(self, why: str) -> None:
        self.disabled = why
        self.graphs.clear()
        log.warning("model %s: decode graphs off: %s", self.runner.model.name, why)
