"""Packed linears: on a CPU, the engine's steps run the model's `nn.Linear` layers through
oneDNN on weights packed once into its blocked layout.

PyTorch's dense CPU linear computes a product of few rows (a decode step, a short prefill
chunk) on one core, well under the memory bandwidth; oneDNN's kernel on a packed weight uses
every core (docs/BENCHMARKS.md has the figures). The swap is per model object and per
thread, like the attention dispatch (engine/runner.py): inside an engine step every plain
`nn.Linear` runs packed; anywhere else (a reference forward, the per-request path, another
library on the same model object) it is the model's own dense linear. The model's
parameters are never changed, so its fingerprint is not either. The packed copies take the
linear weights' size once more in host memory (a tied output projection included);
`LinearConfig(kernel="dense")` (`--linear-kernel dense`) keeps the dense kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
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
    elsewhere), `onednn` (that, or an error saying why not) or `dense`."""

    kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.kernel not in LINEAR_KERNELS:
            raise ValueError(f"linear kernel must be one of {LINEAR_KERNELS}, got {self.kernel!r}")

    def resolve(self, model: torch.nn.Module) -> str:
        """`onednn` or `dense` for this model; `LinearKernelError` for an `onednn` that
        cannot be."""
        if self.kernel == "dense":
            return "dense"
        why = onednn_unavailable(model)
        if why is None:
            return "onednn"
        if self.kernel == "onednn":
            raise LinearKernelError(f"--linear-kernel onednn: {why}; use auto or dense")
        return "dense"


def onednn_unavailable(model: torch.nn.Module) -> str | None:
    """Why the packed kernel cannot serve this model, or None when it can."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"the model is on {param.device.type}, oneDNN's packed linear is for CPUs"
    mkldnn = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not hasattr(mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN (mkldnn) linear"
    if param.dtype == torch.bfloat16 and not mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no bfloat16 instructions for oneDNN"
    if param.dtype not in (torch.float32, torch.bfloat16):
        return f"the model is {str(param.dtype).removeprefix('torch.')}, not float32 or bfloat16"
    return None


class PackedLinears:
    """The packed weights of one model's plain `nn.Linear` layers and the threads stepping
    on them (`step`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.local = threading.local()  # .on: this thread is in an engine step
        self.modules = [m for m in model.modules() if type(m) is torch.nn.Linear]
        self.users = 0  # runners on this model; the last to close restores every forward
        self.calls = 0  # packed products computed (tests count them)
        for module in self.modules:
            module.forward = self._forward_of(module)

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
        self.local.on = True
        try:
            yield
        finally:
            self.local.on = False

    def restore(self) -> None:
        """Every linear's own forward back; the packed copies go with the closures."""
        for module in self.modules:
            del module.forward


def install_linears(model: torch.nn.Module) -> PackedLinears:
    """The model's packed linears, packed by its first runner."""
    linears = getattr(model, "_kvstore_linears", None)
    if linears is None:
        linears = PackedLinears(model)
        model._kvstore_linears = linears
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
