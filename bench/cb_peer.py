"""Helpers for transformers continuous batching (CB) with block sharing as a benchmark peer.

As found with transformers 5.23 on CPU:
- A request's complete blocks become shareable only once hashed, in `mark_complete_blocks`,
  which skips a request already FINISHED: one asking for a single token finishes in the step
  that completes its prefill, so its blocks are never hashed. Prompts submitted together are
  prefilled in one forward, before any of their blocks is hashed, so they do not share.
- Only whole pages are shared, and a match never covers a prompt's last token.
- transformers exposes no counter of matched tokens (no metric, attribute or output field);
  its only trace is a DEBUG record "Found a prefix match of N tokens ..." on the logger
  "ContinuousBatchingLogger", which `counting_prefix_matches` counts with a logging filter.
- Pages default to 256 tokens; left to itself the paged cache fills most of the free RAM,
  tens of seconds on CPU. `cb_config` sets both.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

CB_LOGGER = "ContinuousBatchingLogger"
CB_MATCH = re.compile(r"Found a prefix match of (\d+) tokens")


class PrefixMatchCounter(logging.Filter):
    """Sums the matched tokens of CB's "Found a prefix match" records; lets each distinct
    WARNING-or-worse message through once and drops the rest (DEBUG chatter, repeats)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = 0
        self.shown: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if match := CB_MATCH.match(message):
            self.tokens += int(match.group(1))
        if record.levelno < logging.WARNING or message in self.shown:
            return False
        self.shown.add(message)
        return True


@contextmanager
def counting_prefix_matches() -> Iterator[PrefixMatchCounter]:
    logger = logging.getLogger(CB_LOGGER)
    counter, level = PrefixMatchCounter(), logger.level
    logger.addFilter(counter)
    logger.setLevel(logging.DEBUG)
    try:
        yield counter
    finally:
        logger.removeFilter(counter)
        logger.setLevel(level)


def cb_config(page_size: int, num_blocks: int):
    """Block sharing on, pages of `page_size` tokens, a cache of `num_blocks` pages."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(
        allow_block_sharing=True, page_size=page_size, num_blocks=num_blocks
    )


def greedy_config(model, new_tokens: int):
    """Exactly `new_tokens` greedy tokens (no EOS stop)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=model.config.pad_token_id,
    )


def pages_for(prompts: Sequence[Sequence[int]], new_tokens: int, page_size: int) -> int:
    """Pages the prompts and their generated tokens occupy, one partial page each at most."""
    return sum(math.ceil((len(p) + new_tokens) / page_size) for p in prompts)


def checked_outputs(out: dict, requests: int, new_tokens: int) -> list[list[int]]:
    """The generated tokens of a `generate_batch` result, in input order; RuntimeError if a
    request is missing, failed or generated another number of tokens."""
    results = list(out.values())
    errors = [r.error for r in results if r.error is not None]
    if len(results) != requests or errors:
        raise RuntimeError(f"{len(results)} results of {requests}, errors: {errors[:3]}")
    lengths = {len(r.generated_tokens) for r in results}
    if lengths != {new_tokens}:
        raise RuntimeError(f"generated {sorted(lengths)} tokens, not {new_tokens}")
    return [list(r.generated_tokens) for r in results]
