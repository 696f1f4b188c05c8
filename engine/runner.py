"""The model runner: one forward per step over a ragged batch whose K/V live in the pool.

The batch is flattened into one sequence (input_ids [1, T]), each row's tokens carrying their
own position ids. The model's attention becomes a per-model `AttentionDispatch`, registered
with transformers' attention (and mask) interface: in a thread running a paged step it is
that runner's `PagedAttention` (and no mask is built); anywhere else it is plain SDPA with
HF's own masks, so other users of the same model object (a reference forward, the
per-request path, another engine) are not affected, whatever thread they run in.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from engine.contract import tolerance_for
from engine.model import LoadedModel
from engine.paged import PagedAttention, PagedAttentionError, Row, build_step
from kvstore.sequences import BlockTables

log = logging.getLogger("kvstore.engine")


class AttentionDispatch:
    """The attention of one model: the calling thread's paged step, else SDPA."""

    def __init__(self) -> None:
        self.local = threading.local()  # .attention: the PagedAttention of this thread's step
        self.users = 0  # runners on this model; the last to close restores plain SDPA

    def active(self) -> PagedAttention | None:
        return getattr(self.local, "attention", None)

    def attention(self, module: torch.nn.Module, *args: object, **kwargs: object) -> object:
        paged = self.active()
        return (paged or sdpa_attention_forward)(module, *args, **kwargs)

    def mask(self, *args: object, **kwargs: object) -> object:
        return None if self.active() is not None else sdpa_mask(*args, **kwargs)

    @contextmanager
    def step(self, attention: PagedAttention) -> Iterator[None]:
        self.local.attention = attention
        try:
            yield
        finally:
            self.local.attention = None
            attention.batch = None


def install_dispatch(model: torch.nn.Module) -> AttentionDispatch:
    """The model's dispatch, installed by its first runner (its attention must be SDPA)."""
    dispatch = getattr(model, "_kvstore_dispatch", None)
    if dispatch is None:
        config = model.config
        if config._attn_implementation != "sdpa":
            raise PagedAttentionError(f"attention is {config._attn_implementation!r}, not sdpa")
        dispatch, name = AttentionDispatch(), f"kvstore_dispatch_{id(model):x}"
        AttentionInterface.register(name, dispatch.attention)
        AttentionMaskInterface.register(name, dispatch.mask)
        config._attn_implementation = name
        model._kvstore_dispatch = dispatch
    dispatch.users += 1
    return dispatch


def uninstall_dispatch(model: torch.nn.Module) -> None:
    """Undo one `install_dispatch`; the last one gives the model plain SDPA back (so other
    libraries that check the implementation's name, as transformers' own batching does,
    accept the model again)."""
    dispatch = getattr(model, "_kvstore_dispatch", None)
    if dispatch is None:
        return
    dispatch.users -= 1
    if dispatch.users == 0:
        model.config._attn_implementation = "sdpa"
        del model._kvstore_dispatch


@functools.cache
def _takes_logits_to_keep(model_cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_cls.forward).parameters


def _layer_of(module: torch.nn.Module) -> int:
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise PagedAttentionError(f"{type(module).__name__} has no layer_idx")
    return layer


class PagedRunner:
    """Runs steps of one model on the K/V blocks of one pool tensor."""

    def __init__(self, model: LoadedModel, kv: torch.Tensor, scratch_block: int):
        self.model = model
        self.kv = kv  # [num_blocks, layers, 2, kv_heads, block_size, head_dim]
        self.block_size = kv.shape[4]
        self.scratch_block = scratch_block
        self.attention = PagedAttention(kv, _layer_of)
        self.dispatch = install_dispatch(model.model)
        self.closed = False

    def close(self) -> None:
        """Give the model back its plain attention (once no other runner uses it)."""
        if not self.closed:
            self.closed = True
            uninstall_dispatch(self.model.model)

    def forward(
        self, rows: Sequence[Row], token_ids: Sequence[Sequence[int]], logit_rows: Sequence[int]
    ) -> torch.Tensor:
        """Feed each row its tokens; logits [len(logit_rows), vocab] float32 of the last fed
        token of each row listed in `logit_rows`."""
        device = self.model.device
        ids = torch.tensor([t for row_ids in token_ids for t in row_ids], device=device)
        positions = torch.cat([torch.arange(r.start, r.end) for r in rows]).to(device)
        ends = torch.tensor([r.num_new for r in rows]).cumsum(0) - 1
        keep = ends[list(logit_rows)].to(device)
        lm = self.model.model
        extra = {"logits_to_keep": keep} if _takes_logits_to_keep(type(lm)) else {}
        with torch.inference_mode(), self.dispatch.step(self.attention):
            self.attention.batch = build_step(rows, self.block_size, self.scratch_block, device)
            out = lm(
                input_ids=ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=False,
                **extra,
            )
        logits = out.logits[0]
        return (logits if extra else logits[keep]).float()


SELF_TEST_BLOCKS = 5


def start_paged(model: LoadedModel, tables: BlockTables) -> tuple[PagedRunner | None, str | None]:
    """A runner on the tables' pool that passed `self_test` (it holds one scratch block), or
    None and why not."""
    pool = tables.pool
    if pool.device != model.device:
        return None, f"the pool is on {pool.device}, the model on {model.device}"
    if pool.num_blocks < SELF_TEST_BLOCKS + 2:
        return (
            None,
            f"the pool has {pool.num_blocks} blocks, the self-test needs {SELF_TEST_BLOCKS}",
        )
    scratch, ids = tables.reserve(1), tables.reserve(SELF_TEST_BLOCKS)
    try:
        runner = PagedRunner(model, pool.kv, scratch[0])
        why = self_test(runner, ids) if len(ids) == SELF_TEST_BLOCKS else "the pool is full"
    except PagedAttentionError as e:
        runner, why = None, str(e)
    finally:
        tables.release(ids)
    if why is not None:
        if runner is not None:
            runner.close()
        tables.release(scratch)
        return None, why
    return runner, None


def self_test(runner: PagedRunner, block_ids: list[int]) -> str | None:
    """Check the paged path against plain forwards on this model: two rows prefilled in one
    step (one spanning blocks), then one decoded beside the other's next chunk. None when it
    holds, else why not (the engine then serves one request at a time)."""
    model, bs = runner.model, runner.block_size
    a = [(7 * i + 3) % model.vocab_size for i in range(2 * bs + 3)]
    b = [(5 * i + 1) % model.vocab_size for i in range(bs + 2)]
    table_a, table_b = block_ids[:3], block_ids[3:5]
    tol = tolerance_for(model.dtype)
    try:
        first = runner.forward(
            [Row(table_a, 0, len(a) - 1), Row(table_b, 0, 3)], [a[:-1], b[:3]], [0, 1]
        )
        second = runner.forward(
            [Row(table_a, len(a) - 1, 1), Row(table_b, 3, len(b) - 3)], [a[-1:], b[3:]], [0, 1]
        )
    except Exception as e:  # any failure of the hook means: not servable this way
        return f"{type(e).__name__}: {e}"
    got = [first[0], first[1], second[0], second[1]]
    want = [_reference(model, a[:-1]), _reference(model, b[:3]), _reference(model, a)]
    want.append(_reference(model, b))
    worst = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    return None if worst <= tol else f"logits differ from a plain forward by {worst:.2e}"


def _reference(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        x = torch.tensor([ids], device=model.device)
        return model.model(input_ids=x, use_cache=False).logits[0, -1].float()
