"""Helpers for engine tests: a micro Llama (2 layers, hidden 64) and the no-cache reference."""

from __future__ import annotations

import os

import torch

from engine.contract import FP32_TOL, greedy_matches_reference  # noqa: F401 (re-exported)
from engine.model.loading import LoadedModel, wrap_model
from engine.model.tiny import (  # noqa: F401 (micro_config re-exported)
    BYTE_VOCAB_SIZE,
    byte_tokenizer,
    micro_config,
    random_model,
)
from kvstore.config import CacheConfig

BLOCK_SIZE = 4
TOL = FP32_TOL
# The micro model's and its pool's device: cpu (CI), or cuda to run these tests on a GPU
TEST_DEVICE = os.environ.get("KVSTORE_TEST_DEVICE", "cpu")


def micro_model(seed: int = 1) -> LoadedModel:
    model = random_model(micro_config(), seed).to(TEST_DEVICE)
    return wrap_model(model, byte_tokenizer(), f"micro-{seed}")


def micro_cache_config(**overrides: object) -> CacheConfig:
    values = {"block_size": BLOCK_SIZE, "device": TEST_DEVICE, "device_blocks": 256, **overrides}
    return CacheConfig(**values)


def reference_logits(model: LoadedModel, token_ids: list[int]) -> torch.Tensor:
    """Independent reference: one full forward of the whole sequence, no cache. [T, vocab]."""
    with torch.inference_mode():
        ids = torch.tensor([token_ids], device=model.device)
        return model.model(input_ids=ids, use_cache=False).logits[0].float()


def close_to_reference(logits: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> bool:
    """The contract: within tol, and the same argmax wherever the top-2 gap exceeds tol."""
    top2 = torch.topk(ref, 2).values
    same_argmax = int(torch.argmax(logits)) == int(torch.argmax(ref))
    return bool((logits - ref).abs().max() <= tol) and (same_argmax or top2[0] - top2[1] <= tol)
