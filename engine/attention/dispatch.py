"""The attention of a model served by the engine: one `AttentionDispatch` per model,
registered with transformers' attention (and mask) interface. In a thread running a paged
step it is that runner's `PagedAttention` (and no mask is built); anywhere else it is the
model's own implementation (SDPA, or eager for models without SDPA such as Gemma 2) with
HF's own masks, so other users of the same model object (a reference forward, the
per-request path, another engine) are not affected, whatever thread they run in.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from engine.attention.paged import PagedAttention, PagedAttentionError

# The implementations a dispatch stands in for, and the mask function of each.
PLAIN_ATTENTION = {"sdpa": sdpa_mask, "eager": eager_mask}


@functools.cache
def _eager_attention(module_cls: type) -> Callable:
    """The eager attention of the module's own modeling file (softcapping and all)."""
    function = getattr(sys.modules[module_cls.__module__], "eager_attention_forward", None)
    if function is None:
        raise PagedAttentionError(f"{module_cls.__name__} has no eager_attention_forward")
    return function


class AttentionDispatch:
    """The attention of one model: the calling thread's paged step, else the model's own."""

    def __init__(self, plain: str = "sdpa") -> None:
        self.plain = plain  # the implementation the model had: "sdpa" or "eager"
        self.local = threading.local()  # .attention: the PagedAttention of this thread's step
        self.users = 0  # runners on this model; the last to close restores `plain`

    def active(self) -> PagedAttention | None:
        return getattr(self.local, "attention", None)

    def attention(self, module: torch.nn.Module, *args: object, **kwargs: object) -> object:
        paged = self.active()
        if paged is not None:
            return paged(module, *args, **kwargs)
        plain = sdpa_attention_forward if self.plain == "sdpa" else _eager_attention(type(module))
        return plain(module, *args, **kwargs)

    def mask(self, *args: object, **kwargs: object) -> object:
        if self.active() is not None:
            return None
        return PLAIN_ATTENTION[self.plain](*args, **kwargs)

    @contextmanager
    def step(self, attention: PagedAttention) -> Iterator[None]:
        self.local.attention = attention
        try:
            yield
        finally:
            self.local.attention = None
            attention.batch = None


def install_dispatch(model: torch.nn.Module) -> AttentionDispatch:
    """The model's dispatch, installed by its first runner (its attention must be SDPA or
    eager through transformers' attention interface)."""
    dispatch = getattr(model, "_kvstore_dispatch", None)
    if dispatch is None:
        config = model.config
        plain = config._attn_implementation
        if plain not in PLAIN_ATTENTION:
            raise PagedAttentionError(f"attention is {plain!r}, not sdpa or eager")
        dispatch, name = AttentionDispatch(plain), f"kvstore_dispatch_{id(model):x}"
        AttentionInterface.register(name, dispatch.attention)
        AttentionMaskInterface.register(name, dispatch.mask)
        config._attn_implementation = name
        model._kvstore_dispatch = dispatch
    dispatch.users += 1
    return dispatch


def uninstall_dispatch(model: torch.nn.Module) -> None:
    """Undo one `install_dispatch`; the last one gives the model its plain implementation
    back (so other libraries that check the implementation's name, as transformers' own
    batching does, accept the model again)."""
    dispatch = getattr(model, "_kvstore_dispatch", None)
    if dispatch is None:
        return
    dispatch.users -= 1
    if dispatch.users == 0:
        model.config._attn_implementation = dispatch.plain
        del model._kvstore_dispatch
