"""The output contract (README.md, "Correctness"), checked against an independent full
no-cache forward."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from engine.model.loading import LoadedModel

FP32_TOL = 1e-4  # fp32 logits: absolute tolerance of the contract
HALF_TOL = 2e-2  # bf16 / fp16 logits


def tolerance_for(dtype: torch.dtype) -> float:
    """The contract's logit tolerance for a model computing in `dtype`."""
    return FP32_TOL if dtype == torch.float32 else HALF_TOL


def greedy_matches_reference(
    model: LoadedModel, prompt: list[int], output: list[int], tol: float = FP32_TOL
) -> bool:
    """Each greedy token equals the argmax of one full forward over prompt + the tokens before
    it, wherever that forward's top-2 logit gap exceeds `tol` (a near-tie may go either way).
    An empty prompt or output is no match."""
    if not prompt or not output:
        return False
    with torch.inference_mode():
        ids = torch.tensor([prompt + output[:-1]], device=model.device)
        ref = model.model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 :].float()
    top2 = torch.topk(ref, 2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > tol
    same = ref.argmax(-1).cpu() == torch.tensor(output)
    return bool((same | ~decisive.cpu()).all())


def count_meeting_contract(
    model: LoadedModel,
    prompts: Sequence[list[int]],
    outputs: Sequence[list[int]],
    length: int | None = None,
    tol: float = FP32_TOL,
) -> int:
    """How many greedy outputs meet the contract (`greedy_matches_reference`, at `tol`) and,
    if `length` is given, have exactly that many tokens."""
    check = functools.partial(greedy_matches_reference, model, tol=tol)
    return sum(
        (length is None or len(out) == length) and check(prompt, out)
        for prompt, out in zip(prompts, outputs, strict=True)
    )
