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
- `generate_batch` starts the manager's generation thread and stops it on return (thread
  join, `gc.collect`), even with `persistent_manager=True`: about 0.3 s per call on CPU. A
  server instead keeps one manager running (`continuous_batching_context_manager`) and feeds
  it with `add_request`, collecting each result with `get_result(request_id)`; hashed blocks
  outlive the request that filled them, so later requests match them.

The two peer modes, each `(model, warm, prompts, gen, cb, counter, bar) -> (seconds, outputs)`
with the warm-up prompts served first, outside the timing and the matched-token count:
- `run_batch`: every prompt in one `generate_batch` call (CB's natural mode);
- `serve_in_order`: one running manager fed one request at a time, each sent once the previous
  one's result is back, as kvstore's engine serves them.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvstore.units import cdiv

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
    return sum(cdiv(len(p) + new_tokens, page_size) for p in prompts)


def checked_outputs(out: dict, requests: int, new_tokens: int) -> list[list[int]]:
    """The generated tokens of CB's results by request id (as `generate_batch` returns them, in
    input order); RuntimeError if a request is missing, failed or generated another number of
    tokens."""
    results = list(out.values())
    errors = [r.error for r in results if r.error is not None]
    if len(results) != requests or errors:
        raise RuntimeError(f"{len(results)} results of {requests}, errors: {errors[:3]}")
    lengths = {len(r.generated_tokens) for r in results}
    if lengths != {new_tokens}:
        raise RuntimeError(f"generated {sorted(lengths)} tokens, not {new_tokens}")
    return [list(r.generated_tokens) for r in results]


REQUEST_TIMEOUT_S = 300.0  # per served request: a stuck manager fails the mode, never hangs it


def workload_hints(prompts: Sequence[Sequence[int]], new_tokens: int):
    """The hints `generate_batch` derives from its inputs (they size the block table and batch)."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    return WorkloadHints(
        max_prompt_length=max(map(len, prompts)),
        max_generated_length=new_tokens,
        num_requests=len(prompts),
    )


def run_batch(model, warm, prompts, gen, cb, counter, bar) -> tuple[float, list[list[int]]]:
    """Every prompt in one `generate_batch` call, on a persistent manager that the warm-up call
    created and sized."""
    model.generate_batch(warm, gen, cb, persistent_manager=True)
    counter.tokens = 0
    start = time.perf_counter()
    out = model.generate_batch(prompts, gen, cb, persistent_manager=True)
    outputs = checked_outputs(out, len(prompts), gen.max_new_tokens)
    bar.update(len(prompts))
    return time.perf_counter() - start, outputs


def serve_in_order(model, warm, prompts, gen, cb, counter, bar) -> tuple[float, list[list[int]]]:
    """One running manager, fed the warm-up prompts then the workload's, one request at a time;
    only the workload is timed (the manager's stop on exit is not)."""
    new_tokens = gen.max_new_tokens
    hints = workload_hints(prompts, new_tokens)
    with model.continuous_batching_context_manager(
        gen, block=True, timeout=5, continuous_batching_config=cb, workload_hints=hints
    ) as manager:
        for ids in warm:
            serve_one(manager, ids, new_tokens)
        counter.tokens = 0
        start, outputs = time.perf_counter(), []
        for ids in prompts:
            outputs.append(serve_one(manager, ids, new_tokens))
            bar.update(1)
        return time.perf_counter() - start, outputs


def serve_one(manager, ids: list[int], new_tokens: int) -> list[int]:
    """Adds one request to a running manager and waits for its result: its generated tokens.
    RuntimeError if the request is refused or fails or the loop stops without answering,
    TimeoutError after `REQUEST_TIMEOUT_S`."""
    request_id = manager.add_request(ids, max_new_tokens=new_tokens)
    if request_id is None:
        raise RuntimeError("the CB manager refused a request (stopping or stopped)")
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while True:
        running = manager.is_running()  # read first: a loop already gone has delivered all
        if (result := manager.get_result(request_id, timeout=0.1)) is not None:
            return checked_outputs({request_id: result}, 1, new_tokens)[0]
        if not running:
            raise RuntimeError("the CB generation loop stopped without answering a request")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no CB result after {REQUEST_TIMEOUT_S:.0f} s")
