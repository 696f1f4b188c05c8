"""A prompt as the engine takes it: validated token ids, text tokenized with the model's
tokenizer. Every way into the engine (submit, generate, the synchronous paths, the HTTP
route) goes through `prompt_ids`, so every request meets the same checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.loop.request import InvalidRequestError, Prompt, SamplingParams

if TYPE_CHECKING:
    from engine.model.loading import LoadedModel


def chat_prompt_ids(tokenizer: object, user: str, system: str | None = None) -> list[int] | None:
    """A user message (after a system one, if any) through the tokenizer's chat template,
    ready for the assistant's answer; None when the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": user})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(model: LoadedModel, prompt: Prompt, params: SamplingParams) -> list[int]:
    """Validated token ids of a prompt: ids in the model's vocabulary, room left in its
    positions for `params.max_new_tokens`; `InvalidRequestError` says what to fix."""
    if isinstance(prompt, str):
        ids = model.tokenizer(prompt)["input_ids"] if prompt else []
    elif isinstance(prompt, Sequence | torch.Tensor | np.ndarray):
        ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
        ids = [int(t) if isinstance(t, np.integer) else t for t in ids]
    else:
        raise InvalidRequestError(f"a prompt is a str or a list of token ids, got {prompt!r}")
    if not ids:
        raise InvalidRequestError("prompt is empty; give at least one token")
    vocab = model.vocab_size
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
        raise InvalidRequestError(f"token ids must be ints in [0, {vocab})")
    limit = model.max_positions
    if limit is not None and len(ids) + params.max_new_tokens > limit:
        raise InvalidRequestError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
            f"the model's {limit} positions; shorten the prompt or lower max_new_tokens"
        )
    return ids
