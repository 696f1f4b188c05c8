"""The model runner: one forward per step over a ragged batch whose K/V live in the pool.

The batch is flattened into one sequence (input_ids [1, T]), each row's tokens carrying their
own position ids. The model's attention is its `AttentionDispatch` (engine/attention/
dispatch.py): in the runner's step, the runner's `PagedAttention`. A paged step hands the
model a placeholder 4D mask, so HF's mask logic returns at once (given none, it scans the
position ids for packed sequences, a host sync per step on a GPU). A decode step whose
graph was captured is replayed instead (`DecodeGraphs`, engine/loop/graph.py).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from engine.attention.decode_mirror import DecodeMirror
from engine.attention.dispatch import install_dispatch, uninstall_dispatch
from engine.attention.paged import PagedAttention, PagedAttentionError
from engine.attention.step_batch import StepBatch, build_step
from engine.attention.step_cache import StepCache, alibi_of, step_keys
from engine.attention.step_row import Row
from engine.contract import tolerance_for
from engine.loop.graph import DecodeGraphs, GraphError, graph_blocker
from engine.loop.overlap import Feed
from engine.loop.prefill_clock import PrefillClock, prompt_tokens
from engine.model.linear import install_linears, uninstall_linears
from engine.model.loading import LoadedModel, has_window, with_cache
from kvstore.block_tables import BlockTables
from kvstore.config import CODEC_TOLERANCE, POOL_CODECS
from kvstore.device.pool import BlockPool
from kvstore.units import cdiv

log = logging.getLogger("kvstore.engine")


@functools.cache
def _takes_logits_to_keep(model_cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_cls.forward).parameters


def _layer_of(module: torch.nn.Module) -> int:
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise PagedAttentionError(f"{type(module).__name__} has no layer_idx")
    return layer


class PagedRunner:
    """Runs steps of one model on the K/V blocks of one pool tensor, through the attention
    interface."""

    how = "attention interface"
    graphable = True  # decode steps can be captured (`use_graphs`)
    isolates_rows = True  # a row's K/V reach another row's attention only through the
    # scratch block (engine/loop/step_rows.py, `settle_early`)

    def __init__(
        self, model: LoadedModel, pool: BlockPool, scratch_block: int, kernel: str = "dense"
    ):
        """`kernel`: the linear layers' kernel in a step, `onednn` or `dense`
        (engine/model/linear.py)."""
        self.model = model
        self.pool = pool
        self.kv = pool.kv  # [num_blocks, layers, 2, kv_heads, block_size, head_dim]
        self.block_size = pool.block_size
        self.scratch_block = scratch_block
        self.calls = 0  # layer calls that went through the pool: the self-test counts them
        self.closed = False
        self.graphs: DecodeGraphs | None = None  # decode steps replayed (`use_graphs`)
        self.prefill_clock: PrefillClock | None = None  # times prefills for the read gate
        self.placeholder_mask = torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=pool.device)
        self._open()
        self.linears, self.linear_note = None, None  # note: why packed linears gave way
        if kernel == "onednn":
            self._pack()

    def _pack(self) -> None:
        """Packed linears, unless packing fails or they fail their check (then dense)."""
        try:
            self.linears = install_linears(self.model.model)
        except Exception as e:  # optional: any failure means the dense kernels
            self.linear_note = f"packing the linear weights failed ({type(e).__name__}: {e})"
            return
        if self.linears.mismatch is not None:
            self.linear_note = self.linears.mismatch
            self._close_linears()

    def linear_step(self) -> AbstractContextManager:
        """The step's linear kernels for the calling thread (packed, where packed)."""
        return nullcontext() if self.linears is None else self.linears.step()

    def _close_linears(self) -> None:
        if self.linears is not None:
            self.linears = None
            uninstall_linears(self.model.model)

    def _open(self) -> None:
        self.attention = PagedAttention(self.pool.layer_views(), _layer_of)
        self.dispatch = install_dispatch(self.model.model)
        # window layers read the pool (their blocks may be dropped), a quantized pool's reads
        # dequantize: no mirror for either
        quantized = self.pool.quantized
        mirrored = not has_window(self.model.model.config) and not quantized
        self.mirror = DecodeMirror(self.kv) if mirrored else None

    def use_graphs(self, sampled: torch.Tensor, required: bool = False) -> None:
        """Replay decode steps of up to len(`sampled`) rows (the device's sampled tokens,
        which a replay gathers pending tokens from: engine/loop/overlap.py) from captured
        graphs, each row up to the model's positions (engine/loop/graph.py), unless the
        model or device cannot (`GraphError` saying why when `required`)."""
        why = graph_blocker(self)
        if why is not None:
            if required:
                raise GraphError(f"--cuda-graphs on: {why}")
            log.info("model %s: decode steps run eager: %s", self.model.name, why)
            return
        positions = self.pool.num_blocks * self.block_size
        if self.model.max_positions is not None:
            positions = min(positions, self.model.max_positions)
        self.graphs = DecodeGraphs(self, sampled, cdiv(positions, self.block_size))

    def close(self) -> None:
        """Give the model back its plain attention (once no other runner uses it)."""
        if not self.closed:
            self.closed = True
            self.graphs = None  # (their memory goes with them)
            uninstall_dispatch(self.model.model)
            self._close_linears()

    def forward(
        self,
        rows: Sequence[Row],
        token_ids: Sequence[Sequence[int]],
        logit_rows: Sequence[int],
        full_rows: Sequence[int] = (),
        layer_wait: Callable[[int], None] | None = None,
        feed: Feed | None = None,
    ) -> torch.Tensor:
        """Feed each row its tokens; logits float32 of the last fed token of each row listed
        in `logit_rows`, then of every fed token of each row in `full_rows` (a request
        gathering prompt logprobs): [len(logit_rows) + their num_new, vocab]. `layer_wait`:
        called with each layer's index before its attention reads the pool (blocks still
        loading from a tier, kvstore/tiers/layered.py); `feed`: rows whose last token is
        still on the device (engine/loop/overlap.py). A decode step of rows that all sample
        replays its graph, when it has one."""
        every_row = len(logit_rows) == len(rows) and list(logit_rows) == list(range(len(rows)))
        if self.graphs is not None and every_row and not full_rows and layer_wait is None:
            with torch.inference_mode():
                logits = self.graphs.run(rows, [ids[0] for ids in token_ids], feed)
            if logits is not None:
                if self.mirror is not None:
                    self.mirror.invalidate()  # the graph wrote the pool, not the mirror
                return logits.to(torch.float32, copy=True)  # (not the graph's own buffer)
        return self.forward_eager(rows, token_ids, logit_rows, full_rows, layer_wait, feed)

    def forward_eager(
        self,
        rows: Sequence[Row],
        token_ids: Sequence[Sequence[int]],
        logit_rows: Sequence[int],
        full_rows: Sequence[int] = (),
        layer_wait: Callable[[int], None] | None = None,
        feed: Feed | None = None,
    ) -> torch.Tensor:
        """`forward`, the model's modules run now."""
        device = self.model.device
        ids = torch.tensor([t for row_ids in token_ids for t in row_ids], device=device)
        positions = torch.cat([torch.arange(r.start, r.end) for r in rows]).to(device)
        ends = torch.tensor([r.num_new for r in rows]).cumsum(0) - 1
        if feed is not None:  # pending tokens: gathered on the device
            at = ends[feed.rows].to(device)
            ids[at] = feed.sampled[torch.tensor(feed.slots, device=device)]
        every = [
            torch.arange(int(ends[i]) - rows[i].num_new + 1, int(ends[i]) + 1) for i in full_rows
        ]
        keep = torch.cat([ends[list(logit_rows)], *every]).to(device)
        lm = self.model.model
        extra = {"logits_to_keep": keep} if _takes_logits_to_keep(type(lm)) else {}
        inputs = {"input_ids": ids.unsqueeze(0), "position_ids": positions.unsqueeze(0), **extra}
        with torch.inference_mode():
            batch = build_step(rows, self.block_size, self.scratch_block, device)
            batch.layer_wait = layer_wait
            if self.pool.window is not None:  # a hybrid model: its window layers' slots
                _check_window_parts(rows, self.pool, self.block_size)
                batch.slot_map = self.pool.window.slot_map(self.scratch_block)
            batch.mirror = self._mirror(rows, layer_wait is not None)
            try:
                with self.linear_step(), self._timing(rows, layer_wait):
                    logits = self._run(rows, batch, inputs).logits[0]
            except BaseException:
                if self.mirror is not None:
                    self.mirror.invalidate()  # some layers may have written it, some not
                raise
            if batch.mirror is not None:
                batch.mirror.advance(rows[0])
        return (logits if extra else logits[keep]).float()

    def _timing(
        self, rows: Sequence[Row], layer_wait: Callable[[int], None] | None
    ) -> AbstractContextManager:
        """The prefill clock's timing of this forward: not while it waits on tier loads."""
        if self.prefill_clock is None or layer_wait is not None:
            return nullcontext()
        return self.prefill_clock.timing(prompt_tokens([r.num_new for r in rows]))

    def _mirror(self, rows: Sequence[Row], loading: bool) -> DecodeMirror | None:
        """The decode mirror for the step, if it can have one: not while blocks are still
        loading (a one-token prefill on a tier hit would build it from the pool too early)."""
        if self.mirror is None:
            return None
        if loading:
            self.mirror.invalidate()
            return None
        return self.mirror.for_step(rows)

    def _run(self, rows: Sequence[Row], batch: StepBatch, inputs: dict) -> object:
        with self.dispatch.step(self.attention):
            self.attention.batch = batch
            self.attention.calls = 0
            mask = self.placeholder_mask  # HF's mask logic returns at once (no host sync)
            out = self.model.model(attention_mask=mask, use_cache=False, **inputs)
            self.calls += self.attention.calls
        return out


def _check_window_parts(rows: Sequence[Row], pool: BlockPool, block_size: int) -> None:
    """Every block a row's window layers may read or write holds its window part (the slot
    map would send a block without one to the scratch block's: wrong keys, not an error)."""
    for row in rows:
        ids = list(row.block_table[row.num_window_dropped : cdiv(row.end, block_size)])
        if ids and not pool.window.held(ids).all():  # type: ignore[union-attr]
            raise PagedAttentionError(
                f"a row reaching position {row.end - 1} has blocks without window parts"
            )


class StepCacheRunner(PagedRunner):
    """For models whose attention is their own code on a `Cache` (Falcon, Bloom): the pool
    is reached through `StepCache` and a block-diagonal mask (engine/attention/step_cache.py)."""

    how = "step cache"
    graphable = False  # the model's own attention code keeps Python state per step
    isolates_rows = False  # every row's keys are in every row's attention, under a mask

    def _open(self) -> None:
        self.mirror = None  # attention here is the model's own code: nothing writes one
        self.layers = [layer for layer, _ in self.pool.layer_views()]
        config = self.model.model.config
        if has_window(config) or self.pool.window is not None:  # the 4D mask given would
            # replace the model's window masks
            raise PagedAttentionError("sliding-window models need the attention interface")
        self.alibi = alibi_of(self.model.model.base_model)

    def close(self) -> None:
        self.closed = True
        self._close_linears()

    def _run(self, rows: Sequence[Row], batch: StepBatch, inputs: dict) -> object:
        lm = self.model.model
        keys = step_keys(rows, self.block_size, self.model.device, self.model.dtype)
        cache = StepCache(lm.config, self.layers, batch, keys)
        if self.alibi is not None:
            self.alibi.local.positions = keys.positions
        try:
            out = lm(attention_mask=keys.mask, use_cache=True, **with_cache(lm, cache), **inputs)
        finally:
            if self.alibi is not None:
                self.alibi.local.positions = None
        self.calls += cache.calls
        return out


SELF_TEST_BLOCKS = 5


def start_paged(
    model: LoadedModel, tables: BlockTables, kernel: str = "dense"
) -> tuple[PagedRunner | None, str | None]:
    """A runner on the tables' pool that passed `self_test` (it holds one scratch block), or
    None and why not; `kernel`: its linear layers' (engine/model/linear.py)."""
    pool = tables.pool
    if pool.device != model.device:
        return None, f"the pool is on {pool.device}, the model on {model.device}"
    if pool.num_blocks < SELF_TEST_BLOCKS + 2:
        return (
            None,
            f"the pool has {pool.num_blocks} blocks, the self-test needs {SELF_TEST_BLOCKS}",
        )
    scratch, ids = tables.reserve(1), tables.reserve(SELF_TEST_BLOCKS)
    reasons = []
    try:
        for kind in (PagedRunner, StepCacheRunner):
            runner, why = _try(kind, model, pool, scratch[0], ids, kernel)
            if runner is not None:
                return runner, None
            reasons.append(f"{kind.how}: {why}")
    finally:
        tables.release(ids)
    tables.release(scratch)
    return None, "; ".join(reasons)


def _try(
    kind: type[PagedRunner],
    model: LoadedModel,
    pool: BlockPool,
    scratch: int,
    ids: list[int],
    kernel: str,
) -> tuple[PagedRunner | None, str | None]:
    try:
        runner = kind(model, pool, scratch, kernel)
    except PagedAttentionError as e:
        return None, str(e)
    why = self_test(runner, ids) if len(ids) == SELF_TEST_BLOCKS else "the pool is full"
    if why is None:
        return runner, None
    runner.close()
    return None, why


def self_test(runner: PagedRunner, block_ids: list[int]) -> str | None:
    """Check the paged path against plain forwards on this model: two rows prefilled in one
    step (one spanning blocks), then one decoded beside the other's next chunk, then one
    decoded alone. None when it holds, else why not (the engine then serves one request at a
    time). The plain forwards run the step's linear kernels too: this tests the paging."""
    model, bs = runner.model, runner.block_size
    a = [(7 * i + 3) % model.vocab_size for i in range(2 * bs + 3)]
    b = [(5 * i + 1) % model.vocab_size for i in range(bs + 2)]
    table_a, table_b = block_ids[:3], block_ids[3:5]
    tol, quantized = tolerance_for(model.dtype), runner.pool.quantized
    runner.calls = 0
    try:
        first = runner.forward(
            [Row(table_a, 0, len(a) - 1), Row(table_b, 0, 3)], [a[:-1], b[:3]], [0, 1]
        )
        second = runner.forward(
            [Row(table_a, len(a) - 1, 1), Row(table_b, 3, len(b) - 3)], [a[-1:], b[3:]], [0, 1]
        )
        c = [*b, a[0]]  # then b decodes alone: through the decode mirror, where there is one
        third = runner.forward([Row(table_b, len(b), 1, seq=c)], [c[-1:]], [0])
    except Exception as e:  # any failure of the hook means: not servable this way
        return f"{type(e).__name__}: {e}"
    finally:
        if runner.mirror is not None:
            runner.mirror.invalidate()
    calls, layers = runner.calls, runner.pool.layout.num_layers
    if calls != 3 * layers:  # attention computed elsewhere would never read the pool
        return f"{calls} of {3 * layers} attention calls reached the pool"
    got = [first[0], first[1], second[0], second[1], third[0]]
    with runner.linear_step():
        want = [_reference(model, ids) for ids in (a[:-1], b[:3], a, b, c)]
    worst = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    if quantized:  # plain forwards read exact K/V: the codec's tolerance, at the logits' scale
        scale = max(1.0, max(float(w.abs().max()) for w in want))
        tol = max(tol, CODEC_TOLERANCE[POOL_CODECS[runner.pool.kv_cache_dtype]] * scale)
    return None if worst <= tol else f"logits differ from a plain forward by {worst:.2e}"


def _reference(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        x = torch.tensor([ids], device=model.device)
        return model.model(input_ids=x, use_cache=False).logits[0, -1].float()
