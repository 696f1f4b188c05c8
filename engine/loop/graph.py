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

import numpy as np
import torch

from engine.attention.decode_buffers import DecodeBuffers
from engine.attention.dispatch import AttentionDispatch
from engine.attention.paged import PagedAttention
from engine.attention.step_row import Row
from engine.contract import tolerance_for
from engine.loop.overlap import Feed
from engine.model.loading import LoadedModel, model_window
from kvstore.device.pool import BlockPool
from kvstore.device.quant_kv import dequantize
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
    """Capture on a GPU: CUDA graphs sharing one memory pool, their logits copied into one
    output buffer (so no graph keeps an output of its own alive in the pool)."""

    def __init__(self, device: torch.device, max_batch: int):
        self.device, self.max_batch = device, max_batch
        self.pool: tuple | None = None
        self.out: torch.Tensor | None = None  # [max_batch, vocab]: every graph's logits

    def capture(self, step: Step, inputs: tuple[torch.Tensor, ...]) -> Replay:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            first = step(*inputs)  # lazy initialisations, first allocations: not captured
        current.wait_stream(side)
        if self.out is None:
            self.out = first.new_empty((self.max_batch, first.shape[-1]))
        graph, bucket = torch.cuda.CUDAGraph(), first.shape[0]
        try:  # the outer stream context restores the stream whatever the capture raises
            with (
                torch.cuda.stream(current),
                torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"),
            ):
                self.out[:bucket].copy_(step(*inputs))
        except BaseException:
            torch.cuda.synchronize(self.device)
            raise
        if self.pool is None:
            self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return self.out[:bucket]  # (read before the next replay: stream order)

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


def backend_for(device: torch.device, max_batch: int) -> CudaGraphs | TracedSteps:
    return CudaGraphs(device, max_batch) if device.type == "cuda" else TracedSteps()


# config keys of mixture-of-experts models: HF routes tokens to experts with nonzero() and
# Python loops over the experts hit, on the host each step
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def graph_blocker(runner: StepRunner) -> str | None:
    """Why the runner's decode steps cannot be captured, or None when they can."""
    device = runner.pool.device.type
    if device not in ("cpu", "cuda"):
        return f"no decode graphs on {device}"
    if device == "cpu" and runner.linears is not None:
        return "a CPU trace cannot hold oneDNN's packed linears (--linear-kernel dense: traced)"
    config = runner.model.model.config.get_text_config()
    if any(getattr(config, key, None) for key in _EXPERT_KEYS):
        return "its experts are picked on the host each step (data-dependent routing)"
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None)
    if "dynamic" in str(rope):  # (per layer type, rope_parameters nest one dict a type)
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
        plane = 0 if pool.window is None else pool.num_blocks  # a hybrid pool's slot map
        self.buffers = DecodeBuffers(
            max_batch, max_width, runner.block_size, runner.scratch_block, pool.device, plane
        )
        self.buckets = batch_buckets(max_batch)
        self.backend = backend_for(pool.device, max_batch)
        self.graphs: dict[tuple[int, int], Replay] = {}
        self.eager: set[tuple[int, int]] = set()  # shapes the device had no memory for
        self.window = model_window(self.model.config)
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
        self.buffers.fill(rows, token_ids, *key, self._sources(feed), self._slot_map())
        logits = replay()[: len(rows)]
        self.replays += 1
        if fresh:
            return self._checked(key, rows, token_ids, feed, logits)
        return logits

    def _key(self, rows: Sequence[Row]) -> tuple[int, int] | None:
        """The step's (bucket, width), or None: no graph for it."""
        if self.disabled is not None or not rows or len(rows) > self.buckets[-1]:
            return None
        if any(row.num_new != 1 for row in rows) or not self._window_held(rows):
            return None
        bucket = next(b for b in self.buckets if b >= len(rows))
        blocks = max(cdiv(row.end, self.buffers.block_size) for row in rows)
        width = width_bucket(blocks, self.buffers.max_width)
        return None if width is None or (bucket, width) in self.eager else (bucket, width)

    def _window_held(self, rows: Sequence[Row]) -> bool:
        """Whether every row still holds the model's window (else the eager step says what
        is wrong: a graph reads a dropped block's keys as the scratch block's)."""
        if self.window is None:
            return True
        bs = self.buffers.block_size
        for row in rows:
            dropped = max(row.num_dropped, row.num_window_dropped)
            if dropped and row.start + 1 - dropped * bs < self.window:
                return False
        return True

    @staticmethod
    def _sources(feed: Feed | None) -> dict[int, int] | None:
        return None if feed is None else dict(zip(feed.rows, feed.slots, strict=True))

    def _slot_map(self) -> np.ndarray | None:
        window = self.runner.pool.window
        return None if window is None else window.slot_array(self.runner.scratch_block)

    def _inputs(self) -> tuple[torch.Tensor, ...]:
        """The static buffers a step reads (what a trace takes as its inputs)."""
        return self.buffers.device_buffer, self.sampled

    def _step(self, bucket: int, width: int) -> Step:
        """The step a (bucket, width) graph captures: the model over the static buffers,
        its attention reading them; the logits of every row, [bucket, vocab]."""
        buffers, runner = self.buffers, self.runner

        def step(buffer: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
            ids = buffers.input_ids(bucket, buffer, sampled).unsqueeze(0)
            positions = buffers.header(1, buffer)[:bucket].unsqueeze(0)
            batch = buffers.step_batch(bucket, width, buffer)
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
        self.buffers.pad(bucket, width, self._slot_map())  # writes the scratch block only
        try:
            replay = self.backend.capture(self._step(bucket, width), self._inputs())
        except torch.OutOfMemoryError:
            self.eager.add((bucket, width))
            log.warning("no device memory to capture %d rows x %d blocks: eager", bucket, width)
            return None
        except Exception as e:  # any other failure: this model is served eager
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
        logits and the K/V it wrote. The eager logits either way (they are the reference);
        a mismatch turns graphs off."""
        written = self._written(rows).clone()
        fed = [[t] for t in token_ids]
        eager = self.runner.forward_eager(rows, fed, range(len(rows)), feed=feed)
        why = _differs(logits.float(), eager, self._written(rows), written, self.runner)
        if why is not None:
            self.graphs.pop(key)
            self._disable(f"a replay differs from the eager step ({why})")
        return eager

    def _written(self, rows: Sequence[Row]) -> torch.Tensor:
        """The K/V slots the rows' tokens were written to, but those of rows writing the
        scratch block (a cached block's position: rows share that slot):
        [rows, layers, 2, heads, dim]."""
        n = len(rows)
        blocks, offsets = self.buffers.header(2)[:n], self.buffers.header(3)[:n]
        own = blocks != self.runner.scratch_block
        pool = self.runner.pool
        kv = pool.kv[blocks[own], :, :, :, offsets[own]]  # of [blocks, layers, 2, heads, bs, dim]
        if not pool.quantized:
            return kv
        return dequantize(kv, pool.scales[blocks[own], :, :, :, offsets[own]], torch.float32)

    def _disable(self, why: str) -> None:
        self.disabled = why
        self.graphs.clear()
        log.warning("model %s: decode graphs off: %s", self.runner.model.name, why)


def _differs(
    logits: torch.Tensor,
    eager: torch.Tensor,
    kv: torch.Tensor,
    kv_replayed: torch.Tensor,
    runner: StepRunner,
) -> str | None:
    """How a replay's logits and K/V differ from the eager step's beyond the contract (in
    half precision, relative to the largest logit: a rounding step of a logit near 10 is
    0.06; the same argmax past a near-tie), or None."""
    dtype = runner.model.dtype
    tol = tolerance_for(dtype)
    scale = 1.0 if dtype == torch.float32 else max(1.0, float(eager.abs().max()))
    bound = tol * scale
    worst = float((logits - eager).abs().max())
    top2 = eager.topk(2, dim=-1).values
    tied = (top2[:, 0] - top2[:, 1]) <= bound
    argmax = bool(((logits.argmax(-1) == eager.argmax(-1)) | tied).all())
    moved = float((kv.float() - kv_replayed.float()).abs().max()) if kv.numel() else 0.0
    if worst <= bound and argmax and moved <= bound:
        return None
    return f"logits by {worst:.2e}, K/V by {moved:.2e}, argmax kept: {argmax}"
