"""Packed linears: on a CPU, the engine's model work (its steps, its synchronous paths,
`Engine.on_loop`) runs the model's `nn.Linear` layers through oneDNN on weights packed once
into its blocked layout.

PyTorch's dense CPU linear computes a product of few rows (a decode step, a short prefill
chunk) on one core, well under the memory bandwidth; oneDNN's kernel on a packed weight uses
every core (docs/BENCHMARKS.md has the figures). The swap is per model object and per
thread, like the attention dispatch (engine/loop/runner.py): inside the engine's work every
plain `nn.Linear` runs packed; anywhere else (a reference forward, another library on the
same model object) it is the model's own dense linear. The model's
parameters are never changed, so its fingerprint is not either. The packed copies take the
linear weights' size once more in host memory (a tied output projection included);
`LinearConfig(kernel="dense")` (`--linear-kernel dense`) keeps the dense kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LINEAR_KERNELS = ("auto", "onednn", "dense")


class LinearKernelError(ValueError):
    """`kernel="onednn"` asked of a model or a torch build that cannot run it."""


@dataclass(frozen=True)
class LinearConfig:
    """How the engine's steps compute the model's linear layers: `auto` (oneDNN on a CPU
    model in float32, or bfloat16 where the CPU has bfloat16 instructions; dense
    elsewhere), `onednn` (that, or an error saying why not: device, dtype, torch build) or
    `dense`. Packed weights that fail to pack or fail the check at start
    (`packed_mismatch`) give way to dense ones, with a warning, `onednn` asked or not."""

    kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.kernel not in LINEAR_KERNELS:
            raise ValueError(f"linear kernel must be one of {LINEAR_KERNELS}, got {self.kernel!r}")

    def resolve(self, model: torch.nn.Module) -> str:
        """`onednn` or `dense` for this model (`auto`: dense where the linears are too small
        to pay oneDNN's call, `SMALL_LINEAR`); `LinearKernelError` for an `onednn` that
        cannot be."""
        if self.kernel == "dense":
            return "dense"
        why = onednn_unavailable(model)
        if why is None:
            return "onednn" if self.kernel == "onednn" or not small_linears(model) else "dense"
        if self.kernel == "onednn":
            raise LinearKernelError(f"--linear-kernel onednn: {why}; use auto or dense")
        return "dense"


# oneDNN's packed product costs about 20 us a call more than torch's dense one on a small
# weight (8 rows on 2 cores: 64x64 21 us against 4.4 us; 512x512 50 against 24) and wins only
# once the product is large (2048x2048: 0.60 ms against 1.13): under this mean size of a
# model's linear weights (elements) `auto` keeps the dense kernel.
SMALL_LINEAR = 1 << 18


def small_linears(model: torch.nn.Module) -> bool:
    """Whether the model's plain linear weights average under `SMALL_LINEAR` elements."""
    sizes = [m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear]
    return bool(sizes) and sum(sizes) / len(sizes) < SMALL_LINEAR


def onednn_unavailable(model: torch.nn.Module) -> str | None:
    """Why the packed kernel cannot serve this model, or None when it can."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"the model is on {param.device.type}, oneDNN's packed linear is for CPUs"
    mkldnn, ops = torch.ops.mkldnn, ("_linear_pointwise", "_reorder_linear_weight")
    if not torch.backends.mkldnn.is_available() or not all(hasattr(mkldnn, o) for o in ops):
        return "this torch build has no oneDNN (mkldnn) linear"
    bf16 = getattr(mkldnn, "_is_mkldnn_bf16_supported", None)
    if param.dtype == torch.bfloat16 and (bf16 is None or not bf16()):
        return "this CPU has no bfloat16 instructions for oneDNN"
    if param.dtype not in (torch.float32, torch.bfloat16):
        return f"the model is {str(param.dtype).removeprefix('torch.')}, not float32 or bfloat16"
    return None


class PackedLinears:
    """The packed weights of one model's plain `nn.Linear` layers and the threads stepping
    on them (`step`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.local = threading.local()  # .on: this thread is in an engine step
        # a module with a forward of its own instance (a hook's) is left as it is
        linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
        self.modules = [m for m in linears if "forward" not in vars(m)]
        self.users = 0  # runners on this model; the last to close restores every forward
        self.calls = 0  # packed products computed (tests count them)
        self.mismatch: str | None = None  # why they cannot stand in for dense (checked once)
        self._forwards: dict[torch.nn.Module, Callable] = {}
        try:
            for module in self.modules:
                module.forward = self._forwards[module] = self._forward_of(module)
        except BaseException:
            self.restore()
            raise

    def _forward_of(self, module: torch.nn.Linear):
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
        bias = None if module.bias is None else module.bias.detach()
        local = self.local

        def forward(x: torch.Tensor) -> torch.Tensor:
            if getattr(local, "on", False):
                self.calls += 1
                return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            return F.linear(x, module.weight, module.bias)

        return forward

    @contextmanager
    def step(self) -> Iterator[None]:
        before, self.local.on = getattr(self.local, "on", False), True
        try:
            yield
        finally:
            self.local.on = before

    def restore(self) -> None:
        """Every linear's own forward back (where it is still ours); the packed copies go
        with the closures."""
        for module, forward in self._forwards.items():
            if vars(module).get("forward") is forward:
                del module.forward
        self._forwards.clear()


# How far the packed products may move the logits from the dense ones, relative to the
# largest logit: rounding only (on SmolLM2 in fp32, 9e-5 of 33: 2.7e-6), never a wrong kernel.
PACKED_REL_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
CHECK_TOKENS = 24


def packed_mismatch(model: torch.nn.Module, linears: PackedLinears) -> str | None:
    """Why the packed products cannot stand in for the dense ones on this model (one
    forward of each over a fixed sequence: the logits too far apart, or another argmax past
    a near-tie), or None when they can."""
    vocab = model.config.get_text_config().vocab_size
    device = next(model.parameters()).device
    ids = torch.tensor([[(11 * i + 5) % vocab for i in range(CHECK_TOKENS)]], device=device)
    with torch.inference_mode():
        dense = model(input_ids=ids, use_cache=False).logits[0, -1].float()
        with linears.step():
            packed = model(input_ids=ids, use_cache=False).logits[0, -1].float()
    dtype = next(model.parameters()).dtype
    bound = PACKED_REL_TOL.get(dtype, 2e-2) * float(dense.abs().max())
    diff, top2 = float((packed - dense).abs().max()), torch.topk(dense, 2).values
    same = int(packed.argmax()) == int(dense.argmax()) or float(top2[0] - top2[1]) <= bound
    if diff <= bound and same:
        return None
    return f"packed linears move the logits by {diff:.2e} (at most {bound:.2e} allowed)"


def install_linears(model: torch.nn.Module) -> PackedLinears:
    """The model's packed linears, packed by its first runner."""
    linears = getattr(model, "_kvstore_linears", None)
    if linears is None:
        linears = PackedLinears(model)
        try:
            linears.mismatch = packed_mismatch(model, linears)
        except BaseException:
            linears.restore()
            raise
        model._kvstore_linears = linears  # only once packed and checked
    linears.users += 1
    return linears


def uninstall_linears(model: torch.nn.Module) -> None:
    """Undo one `install_linears`; the last gives every linear its own forward back."""
    linears = getattr(model, "_kvstore_linears", None)
    if linears is None:
        return
    linears.users -= 1
    if linears.users == 0:
        linears.restore()
        del model._kvstore_linears
